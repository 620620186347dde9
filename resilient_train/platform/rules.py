"""Restart policy: ordered rules ``match -> actions`` with named budgets.

The shape is Kubernetes' podFailurePolicy: rules are evaluated in order and the first
match wins. A rule lists actions to try in order; an action with a budget is taken only
while its budget lasts, then the next one is tried (restart the worker 5 times, then
retry the job 3 times, then fail). Running out of every action fails the job.
Each default rule is named by what it matches (``transient-exit-code``); the table is the
platform's (docs/platform.md, "Restart rules").
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..errors import PLATFORM_TRANSIENT_EXIT_CODES


class Cause(str, Enum):
    """Why a worker (or the whole attempt) ended, as the launcher saw it."""

    EXIT = "exit"                # the worker's own exit: a code, or death by a signal it raised
    START_ERROR = "start_error"  # the command could not be started (not found, not executable)
    OOM = "oom"                  # out of memory: the launcher's limit, the kernel's OOM
                                 # killer, torch's own report (or injected)
    STOCKOUT = "stockout"        # not enough accelerators (or injected)
    INTERNAL = "internal"        # the launcher itself failed (or injected)
    MAINTENANCE = "maintenance"  # VM maintenance: restarted on another VM, never counted
    PREEMPTION = "preemption"    # Spot/standard VM preempted
    NODE_LOSS = "node_loss"      # the worker was killed from outside


class Action(str, Enum):
    SUCCEED_JOB = "succeed_job"
    WORKER_DONE = "worker_done"
    RESTART_WORKER = "restart_worker"
    RETRY_JOB = "retry_job"
    WAIT_FOR_CAPACITY = "wait_for_capacity"
    FAIL_JOB = "fail_job"


class Strategy(str, Enum):
    STANDARD = "standard"
    SPOT = "spot"
    FLEX_START = "flex-start"


# Budget scopes: "worker" counts per replica and resets with each job attempt (a retried
# job gets fresh workers); "job" counts over the whole job.
WORKER_SCOPE = "worker"
JOB_SCOPE = "job"


@dataclass(frozen=True)
class Budget:
    name: str
    limit: int
    scope: str = JOB_SCOPE

    def __post_init__(self) -> None:
        if self.scope not in (WORKER_SCOPE, JOB_SCOPE):
            raise PolicyError(f"budget {self.name!r}: scope must be 'worker' or 'job', "
                              f"got {self.scope!r}")
        if self.limit < 0:
            raise PolicyError(f"budget {self.name!r}: limit must be >= 0, got {self.limit}")


@dataclass(frozen=True)
class Outcome:
    """One worker's end (or an attempt-wide fault when ``replica`` is None)."""

    replica: str | None
    is_primary: bool
    cause: Cause
    exit_code: int | None  # shell convention: 128+N for death by signal N


@dataclass(frozen=True)
class Match:
    """All given fields must match; an empty Match matches everything."""

    causes: frozenset[Cause] | None = None
    exit_codes: frozenset[int] | None = None
    primary: bool | None = None

    def __call__(self, outcome: Outcome) -> bool:
        if self.causes is not None and outcome.cause not in self.causes:
            return False
        if self.exit_codes is not None and outcome.exit_code not in self.exit_codes:
            return False
        if self.primary is not None and outcome.is_primary != self.primary:
            return False
        return True


@dataclass(frozen=True)
class Step:
    """One action of a rule; ``budget`` None means unlimited and uncounted."""

    action: Action
    budget: str | None = None


@dataclass(frozen=True)
class Rule:
    name: str
    match: Match
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Policy:
    rules: tuple[Rule, ...]
    budgets: Mapping[str, Budget] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for rule in self.rules:
            for step in rule.steps:
                if step.budget is not None and step.budget not in self.budgets:
                    raise PolicyError(
                        f"rule {rule.name!r} uses budget {step.budget!r}, which is not defined; "
                        f"defined budgets: {sorted(self.budgets)}"
                    )

    def first_match(self, outcome: Outcome) -> Rule | None:
        return next((rule for rule in self.rules if rule.match(outcome)), None)


class PolicyError(ValueError):
    """A restart policy (usually a user's policy file) is invalid."""


_USER_EXIT = frozenset({Cause.EXIT, Cause.START_ERROR})
_INFRA = frozenset({Cause.PREEMPTION, Cause.NODE_LOSS})

DEFAULT_BUDGETS: Mapping[str, Budget] = {
    "worker_restarts": Budget("worker_restarts", 5, WORKER_SCOPE),
    "job_retries": Budget("job_retries", 3, JOB_SCOPE),
    # Internal errors: three attempts in all, whatever else happened.
    "internal_retries": Budget("internal_retries", 2, JOB_SCOPE),
    # A Spot preemption surfaces as a stockout and the job is restarted up to six times.
    "spot_retries": Budget("spot_retries", 6, JOB_SCOPE),
}


def default_policy(
    strategy: Strategy = Strategy.STANDARD, *, disable_retries: bool = False
) -> Policy:
    """The platform's restart rules (docs/platform.md, "Restart rules"), first match wins."""
    retry = Step(Action.RETRY_JOB, "job_retries")
    stockout = (
        (Step(Action.WAIT_FOR_CAPACITY),) if strategy is Strategy.FLEX_START else (retry,)
    )
    infra: tuple[Rule, ...]
    if strategy is Strategy.SPOT:
        infra = (
            Rule("spot-preemption", Match(causes=frozenset({Cause.PREEMPTION})),
                 (Step(Action.RETRY_JOB, "spot_retries"),)),
        )
    else:
        infra = ()
    rules = (
        Rule("primary-succeeded", Match(frozenset({Cause.EXIT}), frozenset({0}), True),
             (Step(Action.SUCCEED_JOB),)),
        Rule("worker-finished", Match(frozenset({Cause.EXIT}), frozenset({0}), False),
             (Step(Action.WORKER_DONE),)),
        Rule("out-of-memory", Match(causes=frozenset({Cause.OOM})), (Step(Action.FAIL_JOB),)),
        Rule("transient-exit-code",
             Match(causes=frozenset({Cause.EXIT}), exit_codes=PLATFORM_TRANSIENT_EXIT_CODES),
             (retry,)),
        Rule("stockout", Match(causes=frozenset({Cause.STOCKOUT})), stockout),
        Rule("internal-error", Match(causes=frozenset({Cause.INTERNAL})),
             (Step(Action.RETRY_JOB, "internal_retries"),)),
        *infra,
        Rule("maintenance", Match(causes=frozenset({Cause.MAINTENANCE})),
             (Step(Action.RESTART_WORKER),)),
        Rule("infrastructure-fault", Match(causes=_INFRA),
             (Step(Action.RESTART_WORKER, "worker_restarts"), retry)),
        Rule("user-code-error", Match(causes=_USER_EXIT), (Step(Action.FAIL_JOB),)),
    )
    policy = Policy(rules, dict(DEFAULT_BUDGETS))
    return without_retries(policy) if disable_retries else policy


def with_platform_defaults(policy: Policy, strategy: Strategy = Strategy.STANDARD) -> Policy:
    """A user's policy (its rules first) over the platform's table for ``strategy``: an
    outcome that none of the user's rules matches gets the platform's behaviour, as a pod
    failure that no podFailurePolicy rule matches gets Kubernetes' default handling. So a
    policy file names its exceptions only, and cannot leave an exit 0 or an OOM undecided."""
    base = default_policy(strategy)
    return Policy(policy.rules + base.rules, {**base.budgets, **policy.budgets})


def without_retries(policy: Policy) -> Policy:
    """``disable_retries``: the job is never retried; worker restarts still happen."""
    retry_budgets = {s.budget for r in policy.rules for s in r.steps
                     if s.action is Action.RETRY_JOB}
    budgets = {name: Budget(name, 0, b.scope) if name in retry_budgets else b
               for name, b in policy.budgets.items()}
    # An unbudgeted retry step has nothing to set to zero: drop it.
    rules = tuple(
        Rule(r.name, r.match, tuple(
            s for s in r.steps if not (s.action is Action.RETRY_JOB and s.budget is None)))
        for r in policy.rules
    )
    return Policy(rules, budgets)


# --- the file form -----------------------------------------------------------------

_RULE_KEYS = {"name", "match", "actions"}
_MATCH_KEYS = {"causes", "exit_codes", "primary"}


def policy_from_dict(data: Mapping[str, Any], *, source: str = "policy") -> Policy:
    """Build a Policy from the JSON form (docs/launcher.md, "Restart policy files")::

        {"budgets": {"worker_restarts": {"limit": 2, "scope": "worker"}, "job_retries": 1},
         "rules": [{"name": "oom", "match": {"causes": ["oom"]}, "actions": ["fail_job"]},
                   {"match": {"exit_codes": [42]}, "actions": ["restart_worker:worker_restarts",
                                                                "retry_job:job_retries"]}]}

    Budgets not given keep the platform's defaults.
    """
    if not isinstance(data, Mapping):
        raise PolicyError(f"{source}: expected a JSON object with 'rules', "
                          f"found {type(data).__name__}")
    unknown = set(data) - {"budgets", "rules"}
    if unknown:
        raise PolicyError(f"{source}: unknown top-level keys {sorted(unknown)}; "
                          "allowed: budgets, rules")
    budgets = dict(DEFAULT_BUDGETS)
    raw_budgets = data.get("budgets") or {}
    if not isinstance(raw_budgets, Mapping):
        raise PolicyError(f"{source}: 'budgets' must be an object of name -> limit, "
                          f"found {raw_budgets!r}")
    for name, spec in raw_budgets.items():
        try:
            if _is_int(spec):
                scope = budgets[name].scope if name in budgets else JOB_SCOPE
                budgets[name] = Budget(name, spec, scope)
            elif (isinstance(spec, Mapping) and _is_int(spec.get("limit"))
                  and not set(spec) - {"limit", "scope"}):
                budgets[name] = Budget(name, spec["limit"], str(spec.get("scope", JOB_SCOPE)))
            else:
                raise PolicyError(
                    f"budget {name!r} must be an integer or {{\"limit\": N, \"scope\": "
                    f"\"worker\"|\"job\"}}, found {spec!r}"
                )
        except PolicyError as exc:
            raise PolicyError(f"{source}: {exc}") from None
    raw_rules = data.get("rules")
    if not isinstance(raw_rules, Sequence) or isinstance(raw_rules, str) or not raw_rules:
        raise PolicyError(f"{source}: 'rules' must be a non-empty list of rules")
    rules = tuple(_rule_from_dict(raw, i, source) for i, raw in enumerate(raw_rules, 1))
    try:
        return Policy(rules, budgets)
    except PolicyError as exc:
        raise PolicyError(f"{source}: {exc}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _rule_from_dict(raw: Any, index: int, source: str) -> Rule:
    where = f"{source}: rule {index}"
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{where}: expected an object with 'match' and 'actions', found {raw!r}")
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        raise PolicyError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(_RULE_KEYS)}")
    match_raw = raw.get("match", {})
    if not isinstance(match_raw, Mapping) or set(match_raw) - _MATCH_KEYS:
        raise PolicyError(f"{where}: 'match' may only have {sorted(_MATCH_KEYS)}, "
                          f"found {match_raw!r}")
    valid_causes = ", ".join(c.value for c in Cause)
    raw_causes = match_raw.get("causes")
    if raw_causes is not None and not _is_list(raw_causes):
        raise PolicyError(f"{where}: causes must be a list like [\"oom\"], found {raw_causes!r}; "
                          f"valid causes: {valid_causes}")
    try:
        causes = frozenset(Cause(c) for c in raw_causes) if raw_causes is not None else None
    except ValueError as exc:
        raise PolicyError(f"{where}: {exc}; valid causes: {valid_causes}") from None
    codes = match_raw.get("exit_codes")
    if codes is not None and not (_is_list(codes) and all(_is_int(c) for c in codes)):
        raise PolicyError(f"{where}: exit_codes must be a list of integers, found {codes!r}")
    primary = match_raw.get("primary")
    if primary is not None and not isinstance(primary, bool):
        raise PolicyError(f"{where}: primary must be true or false, found {primary!r}")
    actions = raw.get("actions")
    if not isinstance(actions, Sequence) or isinstance(actions, str) or not actions:
        raise PolicyError(f"{where}: 'actions' must be a non-empty list like "
                          "[\"restart_worker:worker_restarts\", \"fail_job\"]")
    steps = []
    for text in actions:
        name, _, budget = str(text).partition(":")
        try:
            action = Action(name)
        except ValueError:
            raise PolicyError(
                f"{where}: unknown action {name!r}; valid actions: "
                f"{', '.join(a.value for a in Action)} "
                "(optionally ':BUDGET', e.g. retry_job:job_retries)"
            ) from None
        steps.append(Step(action, budget or None))
    return Rule(str(raw.get("name", f"user-{index}")), Match(
        causes, frozenset(codes) if codes is not None else None, primary), tuple(steps))


def load_policy(path: str | os.PathLike[str]) -> Policy:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise PolicyError(f"restart policy file {os.fspath(path)!r} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PolicyError(f"restart policy file {os.fspath(path)!r} is not valid JSON: "
                          f"{exc}") from None
    except OSError as exc:
        raise PolicyError(f"restart policy file {os.fspath(path)!r} cannot be read: "
                          f"{exc.strerror or exc}") from None
    return policy_from_dict(data, source=os.fspath(path))
