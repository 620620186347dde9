"""The restart policy: the platform's restart rules (docs/platform.md), its budgets, the
``disable_retries`` transformation and the JSON file form (with its error messages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilient_train.platform.rules import (
    JOB_SCOPE,
    WORKER_SCOPE,
    Action,
    Budget,
    Cause,
    Match,
    Outcome,
    Policy,
    PolicyError,
    Rule,
    Step,
    Strategy,
    default_policy,
    load_policy,
    policy_from_dict,
    without_retries,
)

PRIMARY, WORKER = "workerpool0-0", "workerpool1-0"


def outcome(cause: Cause, code: int | None = 1, replica: str | None = WORKER) -> Outcome:
    return Outcome(replica, replica == PRIMARY, cause, code)


def decide(policy: Policy, out: Outcome) -> tuple[str, list[tuple[Action, str | None]]]:
    rule = policy.first_match(out)
    assert rule is not None, f"no rule for {out}"
    return rule.name, [(s.action, s.budget) for s in rule.steps]


RETRY = (Action.RETRY_JOB, "job_retries")

# (outcome, rule name, steps) for the STANDARD strategy: one line per rule of the default table (docs/platform.md, "Restart rules").
DEFAULT_TABLE = [
    (outcome(Cause.EXIT, 0, PRIMARY), "primary-succeeded", [(Action.SUCCEED_JOB, None)]),
    (outcome(Cause.EXIT, 0), "worker-finished", [(Action.WORKER_DONE, None)]),
    (outcome(Cause.OOM, 137), "out-of-memory", [(Action.FAIL_JOB, None)]),
    (outcome(Cause.OOM, 0, PRIMARY), "out-of-memory", [(Action.FAIL_JOB, None)]),
    *[(outcome(Cause.EXIT, code), "transient-exit-code", [RETRY]) for code in (6, 11, 134, 139)],
    (outcome(Cause.EXIT, 134, PRIMARY), "transient-exit-code", [RETRY]),
    (outcome(Cause.STOCKOUT, None, None), "stockout", [RETRY]),
    (outcome(Cause.INTERNAL, None, None), "internal-error", [(Action.RETRY_JOB, "internal_retries")]),
    (outcome(Cause.INTERNAL, 70), "internal-error", [(Action.RETRY_JOB, "internal_retries")]),
    (outcome(Cause.MAINTENANCE, 143), "maintenance", [(Action.RESTART_WORKER, None)]),
    (outcome(Cause.PREEMPTION, 143), "infrastructure-fault",
     [(Action.RESTART_WORKER, "worker_restarts"), RETRY]),
    (outcome(Cause.NODE_LOSS, 137), "infrastructure-fault",
     [(Action.RESTART_WORKER, "worker_restarts"), RETRY]),
    # An infrastructure fault is never a success, even when the worker exited 0 on SIGTERM.
    (outcome(Cause.NODE_LOSS, 0, PRIMARY), "infrastructure-fault",
     [(Action.RESTART_WORKER, "worker_restarts"), RETRY]),
    (outcome(Cause.EXIT, 1), "user-code-error", [(Action.FAIL_JOB, None)]),
    (outcome(Cause.EXIT, 42, PRIMARY), "user-code-error", [(Action.FAIL_JOB, None)]),
    (outcome(Cause.EXIT, 143), "user-code-error", [(Action.FAIL_JOB, None)]),
    # A command that cannot start is exit 128; not transient even with a transient-looking code.
    (outcome(Cause.START_ERROR, 128), "user-code-error", [(Action.FAIL_JOB, None)]),
    (outcome(Cause.START_ERROR, 134), "user-code-error", [(Action.FAIL_JOB, None)]),
]


@pytest.mark.parametrize("out,rule,steps", DEFAULT_TABLE,
                         ids=[f"{o.cause.value}-{o.exit_code}-{r}" for o, r, _ in DEFAULT_TABLE])
def test_default_table_first_match(out: Outcome, rule: str, steps: list) -> None:
    assert decide(default_policy(), out) == (rule, steps)


def test_default_budgets() -> None:
    budgets = default_policy().budgets
    assert {n: (b.limit, b.scope) for n, b in budgets.items()} == {
        "worker_restarts": (5, WORKER_SCOPE),
        "job_retries": (3, JOB_SCOPE),
        "internal_retries": (2, JOB_SCOPE),   # three attempts in all
        "spot_retries": (6, JOB_SCOPE),
    }


def test_spot_preemption_retries_the_job_but_node_loss_restarts_the_worker() -> None:
    spot = default_policy(Strategy.SPOT)
    assert decide(spot, outcome(Cause.PREEMPTION, 143)) == (
        "spot-preemption", [(Action.RETRY_JOB, "spot_retries")])
    assert decide(spot, outcome(Cause.NODE_LOSS, 137))[0] == "infrastructure-fault"
    assert decide(spot, outcome(Cause.MAINTENANCE, 143))[0] == "maintenance"


def test_flex_start_stockout_waits_for_capacity() -> None:
    flex = default_policy(Strategy.FLEX_START)
    assert decide(flex, outcome(Cause.STOCKOUT, None, None)) == (
        "stockout", [(Action.WAIT_FOR_CAPACITY, None)])
    # Everything else is the standard table.
    assert decide(flex, outcome(Cause.EXIT, 134)) == ("transient-exit-code", [RETRY])


@pytest.mark.parametrize("strategy", list(Strategy))
def test_disable_retries_zeroes_every_retry_budget_and_keeps_worker_restarts(strategy: Strategy) -> None:
    policy = default_policy(strategy, disable_retries=True)
    limits = {n: b.limit for n, b in policy.budgets.items()}
    retry_budgets = {s.budget for r in policy.rules for s in r.steps if s.action is Action.RETRY_JOB}
    assert {"job_retries", "internal_retries"} <= retry_budgets
    assert ("spot_retries" in retry_budgets) == (strategy is Strategy.SPOT)
    assert all(limits[name] == 0 for name in retry_budgets)
    assert limits["worker_restarts"] == 5
    assert policy == without_retries(default_policy(strategy))
    assert without_retries(policy) == policy   # idempotent
    # The rules themselves are unchanged: the budgets do the work.
    assert [r.name for r in policy.rules] == [r.name for r in default_policy(strategy).rules]


def test_without_retries_drops_unbudgeted_retry_steps() -> None:
    policy = Policy((Rule("r", Match(), (Step(Action.RETRY_JOB), Step(Action.FAIL_JOB))),), {})
    assert without_retries(policy).rules[0].steps == (Step(Action.FAIL_JOB),)


def test_match_fields_are_all_required_and_empty_match_matches_all() -> None:
    assert Match()(outcome(Cause.INTERNAL, None, None))
    m = Match(frozenset({Cause.EXIT}), frozenset({42}), primary=False)
    assert m(outcome(Cause.EXIT, 42))
    assert not m(outcome(Cause.EXIT, 42, PRIMARY))
    assert not m(outcome(Cause.EXIT, 41))
    assert not m(outcome(Cause.OOM, 42))
    assert not Match(exit_codes=frozenset({0}))(outcome(Cause.STOCKOUT, None, None))


def test_policy_rejects_a_rule_using_an_undefined_budget() -> None:
    with pytest.raises(PolicyError, match=r"uses budget 'nope', which is not defined"):
        Policy((Rule("r", Match(), (Step(Action.RETRY_JOB, "nope"),)),), {})


@pytest.mark.parametrize("kwargs,problem", [
    ({"limit": -1}, "limit must be >= 0"),
    ({"limit": 1, "scope": "pool"}, "scope must be 'worker' or 'job'"),
])
def test_budget_validation(kwargs: dict, problem: str) -> None:
    with pytest.raises(PolicyError, match=problem):
        Budget("b", **kwargs)


# --- the file form --------------------------------------------------------------------

FLAKY = {
    "budgets": {"flaky": {"limit": 2, "scope": "worker"}, "job_retries": 1},
    "rules": [
        {"name": "ok", "match": {"causes": ["exit"], "exit_codes": [0], "primary": True},
         "actions": ["succeed_job"]},
        {"match": {"exit_codes": [42]}, "actions": ["restart_worker:flaky", "retry_job:job_retries"]},
        {"match": {}, "actions": ["fail_job"]},
    ],
}


def test_policy_from_dict_builds_rules_and_keeps_default_budgets() -> None:
    policy = policy_from_dict(FLAKY)
    assert [r.name for r in policy.rules] == ["ok", "user-2", "user-3"]
    assert decide(policy, outcome(Cause.EXIT, 42)) == (
        "user-2", [(Action.RESTART_WORKER, "flaky"), (Action.RETRY_JOB, "job_retries")])
    assert decide(policy, outcome(Cause.EXIT, 0, PRIMARY))[0] == "ok"
    assert decide(policy, outcome(Cause.OOM, 42))[0] == "user-2"   # exit code only: any cause
    assert decide(policy, outcome(Cause.EXIT, 0))[0] == "user-3"   # primary: true excludes workers
    b = policy.budgets
    assert (b["flaky"].limit, b["flaky"].scope) == (2, WORKER_SCOPE)
    assert (b["job_retries"].limit, b["job_retries"].scope) == (1, JOB_SCOPE)
    assert b["worker_restarts"] == Budget("worker_restarts", 5, WORKER_SCOPE)   # untouched default


def test_an_integer_budget_keeps_the_default_scope() -> None:
    policy = policy_from_dict({"budgets": {"worker_restarts": 1, "mine": 4},
                               "rules": [{"actions": ["fail_job"]}]})
    assert policy.budgets["worker_restarts"] == Budget("worker_restarts", 1, WORKER_SCOPE)
    assert policy.budgets["mine"] == Budget("mine", 4, JOB_SCOPE)


def test_the_default_table_survives_a_round_trip_through_the_file_form() -> None:
    """Every default rule can be written by a user: the file form is as expressive."""
    def as_dict(rule: Rule) -> dict:
        m = rule.match
        match = {k: v for k, v in {
            "causes": sorted(c.value for c in m.causes) if m.causes is not None else None,
            "exit_codes": sorted(m.exit_codes) if m.exit_codes is not None else None,
            "primary": m.primary}.items() if v is not None}
        return {"name": rule.name, "match": match,
                "actions": [s.action.value + (f":{s.budget}" if s.budget else "") for s in rule.steps]}

    for strategy in Strategy:
        policy = default_policy(strategy)
        assert policy_from_dict({"rules": [as_dict(r) for r in policy.rules]}) == policy


BAD_POLICIES = [
    pytest.param([1, 2], "expected a JSON object with 'rules', found list", id="not-an-object"),
    pytest.param({"rules": [{"actions": ["fail_job"]}], "retries": 3},
                 "unknown top-level keys ['retries']", id="unknown-top-key"),
    pytest.param({}, "'rules' must be a non-empty list", id="no-rules"),
    pytest.param({"rules": "fail_job"}, "'rules' must be a non-empty list", id="rules-a-string"),
    pytest.param({"rules": ["fail_job"]}, "rule 1: expected an object", id="rule-not-object"),
    pytest.param({"rules": [{"actions": ["fail_job"], "when": "always"}]},
                 "rule 1: unknown keys ['when']", id="unknown-rule-key"),
    pytest.param({"rules": [{"match": {"code": 1}, "actions": ["fail_job"]}]},
                 "rule 1: 'match' may only have", id="unknown-match-key"),
    pytest.param({"rules": [{"match": {"causes": ["oom", "cosmic_ray"]}, "actions": ["fail_job"]}]},
                 "rule 1: 'cosmic_ray' is not a valid Cause; valid causes: exit, start_error, oom",
                 id="unknown-cause"),
    pytest.param({"rules": [{"match": {"causes": "oom"}, "actions": ["fail_job"]}]},
                 "causes must be a list", id="causes-not-a-list"),
    pytest.param({"rules": [{"match": {"exit_codes": 42}, "actions": ["fail_job"]}]},
                 "exit_codes must be a list of integers", id="exit-codes-not-a-list"),
    pytest.param({"rules": [{"match": {"exit_codes": ["42"]}, "actions": ["fail_job"]}]},
                 "exit_codes must be a list of integers", id="exit-code-a-string"),
    pytest.param({"rules": [{"match": {"exit_codes": [True]}, "actions": ["fail_job"]}]},
                 "exit_codes must be a list of integers", id="exit-code-a-bool"),
    pytest.param({"rules": [{"match": {"primary": "yes"}, "actions": ["fail_job"]}]},
                 "primary must be true or false", id="primary-not-bool"),
    pytest.param({"rules": [{"match": {}}]}, "'actions' must be a non-empty list", id="no-actions"),
    pytest.param({"rules": [{"actions": "fail_job"}]}, "'actions' must be a non-empty list",
                 id="actions-a-string"),
    pytest.param({"rules": [{"actions": ["reboot_worker"]}]},
                 "rule 1: unknown action 'reboot_worker'; valid actions: succeed_job", id="unknown-action"),
    pytest.param({"rules": [{"actions": ["fail_job"]}, {"actions": ["retry_job:retries"]}]},
                 "rule 'user-2' uses budget 'retries', which is not defined", id="undefined-budget"),
    pytest.param({"budgets": {"job_retries": "3"}, "rules": [{"actions": ["fail_job"]}]},
                 "budget 'job_retries' must be an integer", id="budget-a-string"),
    pytest.param({"budgets": {"job_retries": -1}, "rules": [{"actions": ["fail_job"]}]},
                 "limit must be >= 0", id="budget-negative"),
    pytest.param({"budgets": {"b": {"limit": 2, "scope": "pool"}}, "rules": [{"actions": ["fail_job"]}]},
                 "scope must be 'worker' or 'job'", id="budget-bad-scope"),
    pytest.param({"budgets": {"b": {"limit": 2, "scop": "worker"}}, "rules": [{"actions": ["fail_job"]}]},
                 "budget 'b' must be an integer or", id="budget-unknown-key"),
    pytest.param({"budgets": ["job_retries"], "rules": [{"actions": ["fail_job"]}]},
                 "'budgets' must be an object", id="budgets-a-list"),
]


@pytest.mark.parametrize("data,problem", BAD_POLICIES)
def test_bad_policies_raise_policy_error_naming_the_problem(data: object, problem: str) -> None:
    with pytest.raises(PolicyError) as info:
        policy_from_dict(data, source="my-policy.json")   # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("my-policy.json: "), message
    assert problem in message, message


def write(tmp_path: Path, text: str, name: str = "policy.json") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_load_policy_reads_a_valid_file(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps(FLAKY))
    assert load_policy(path) == policy_from_dict(FLAKY)
    assert load_policy(str(path)) == policy_from_dict(FLAKY)


def test_load_policy_errors_name_the_file(tmp_path: Path) -> None:
    bad_action = write(tmp_path, json.dumps({"rules": [{"actions": ["explode"]}]}), "bad.json")
    with pytest.raises(PolicyError, match=rf"^{bad_action}: rule 1: unknown action 'explode'"):
        load_policy(bad_action)

    not_json = write(tmp_path, '{"rules": [', "broken.json")
    with pytest.raises(PolicyError, match=r"restart policy file '.*broken.json' is not valid JSON"):
        load_policy(not_json)

    with pytest.raises(PolicyError, match=r"restart policy file '.*missing.json' does not exist"):
        load_policy(tmp_path / "missing.json")

    with pytest.raises(PolicyError, match=r"restart policy file '.*' cannot be read"):
        load_policy(tmp_path)   # a directory

    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PolicyError, match=r"is not valid JSON"):
        load_policy(binary)
