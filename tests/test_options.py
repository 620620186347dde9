"""CheckpointOptions and MainOptions: one way to say when to save, the 4-hour ceiling under
every policy unless removed by name, and a clear error for options that contradict."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import resilient_train as rt
from resilient_train.checkpoint.commit.directory import scan
from resilient_train.checkpoint.commit.retention import RetentionPolicy
from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.schedule.policies import (
    FOUR_HOURS,
    SaveContext,
    SavePolicy,
    auto_interval,
    every,
    every_n_steps,
    never,
)
from resilient_train.runtime import Context, MainOptions


def ctx(step: int, now: float, last_step: int | None = None, last_time: float = 0.0
        ) -> SaveContext:
    return SaveContext(step, now, last_step, last_time)


class OnlyAtEpochEnd(SavePolicy):
    """A user's own policy that, on its own, would not save within these tests."""

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % 10**9 == 0


# --- one way to say when to save -------------------------------------------------------

def test_save_every_steps_and_policy_together_is_an_error() -> None:
    with pytest.raises(ValueError) as info:
        CheckpointOptions(save_every_steps=500, policy=every(3600))
    msg = str(info.value)
    assert "save_every_steps=500" in msg and "policy=every(seconds=3600)" in msg
    assert "policy=rt.every_n_steps(500) |" in msg             # the fix


@pytest.mark.parametrize(("field", "value", "fix"), [
    ("save_every_steps", 0, ">= 1, or None"),
    ("save_every_steps", -5, ">= 1, or None"),
    ("save_every_steps", 2.5, "whole number"),
    ("save_every_steps", True, "whole number"),
    ("max_interval_s", 0, "or None (no ceiling)"),
    ("max_interval_s", -1.0, "or None (no ceiling)"),
    ("max_interval_s", math.inf, "or None (no ceiling)"),
    ("max_interval_s", math.nan, "or None (no ceiling)"),
    ("max_interval_s", "4h", "or None (no ceiling)"),
    ("sync_interval_s", 0, "positive, finite"),
    ("policy", 500, "rt.every_n_steps(1000)"),
    ("retention", 3, "rt.RetentionPolicy(keep_last=...)"),
    ("retry", {"deadline_s": 5}, "rt.RetryOptions(...)"),
    ("async_save", "no", "True or False"),
    ("save_on_sigterm", "no", "True or False or None"),
    ("storage_options", "anon", "dict of fsspec options"),
    ("undo_torn_steps", 1, "True or False"),
])
def test_a_bad_value_names_the_field_the_value_and_the_fix(field: str, value: Any,
                                                           fix: str) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        CheckpointOptions(**{field: value})
    msg = str(info.value)
    assert f"CheckpointOptions.{field}={value!r}" in msg and fix in msg


def test_undoing_torn_steps_without_peer_recovery_is_a_contradiction() -> None:
    with pytest.raises(ValueError, match="undo_torn_steps=True takes a torn step back for "
                                         "peer recovery, which peer_recovery=False turns off"):
        CheckpointOptions(undo_torn_steps=True, peer_recovery=False)


def test_metadata_that_the_manifest_cannot_hold_fails_at_once() -> None:
    with pytest.raises(ValueError, match="metadata cannot be written into the manifest"):
        CheckpointOptions(metadata={"run": object()})
    with pytest.raises(ValueError, match="str keys"):
        CheckpointOptions(metadata={1: "a", "b": 2})  # type: ignore[dict-item]  # mixed keys
    CheckpointOptions(metadata={"run": "a", "lr": 1e-3, "tags": ["x"]})


@pytest.mark.parametrize("build, says", [
    # Another class's option: how to pass it from here, one level down or up.
    (lambda: rt.CheckpointOptions(checkpoint_dir="/ckpt"),
     "rt.MainOptions(checkpoint_dir=..., checkpoint=rt.CheckpointOptions(...))"),
    (lambda: rt.MainOptions(save_every_steps=100),
     "rt.MainOptions(checkpoint=rt.CheckpointOptions(save_every_steps=...))"),
    (lambda: rt.MainOptions(hang_timeout_s=60),
     "rt.MainOptions(distributed=rt.DistributedOptions(hang_timeout_s=...))"),
    # A name two classes take: both ways.
    (lambda: rt.CheckpointOptions(keep_last=2),
     "rt.CheckpointOptions(node_local=rt.NodeLocal(keep_last=...)) or "
     "rt.CheckpointOptions(retention=rt.RetentionPolicy(keep_last=...))"),
    # A typo: the option meant.
    (lambda: rt.CheckpointOptions(save_every=100), "did you mean save_every_steps=...?"),
    (lambda: rt.RetryOptions(deadline=30), "did you mean deadline_s=...?"),
    (lambda: rt.NodeLocal(persistent_every_steps=5), "did you mean persistent_every=...?"),
    # Neither: the class's options.
    (lambda: rt.DistributedOptions(world=4), "its options are: backend, join_timeout_s"),
])
def test_an_unknown_option_says_where_it_belongs(build: Any, says: str) -> None:
    with pytest.raises(TypeError) as info:
        build()
    assert "has no option" in str(info.value)
    assert says in str(info.value)


@pytest.mark.parametrize("decorate, says", [
    (lambda: rt.main(options=rt.CheckpointOptions(save_every_steps=5)),
     "rt.main(options=CheckpointOptions(...)): options takes rt.MainOptions; pass "
     "options=rt.MainOptions(checkpoint=rt.CheckpointOptions(...))"),
    (lambda: rt.main(options=rt.DistributedOptions()),
     "pass options=rt.MainOptions(distributed=rt.DistributedOptions(...))"),
    (lambda: rt.main(options={"checkpoint_dir": "/ckpt"}),   # type: ignore[arg-type]
     "rt.main(options=dict(...)): options takes rt.MainOptions; pass options="
     "rt.MainOptions(...)"),
    # Positional: the options object would be taken for the function (and the group
    # formed as the decorator is applied).
    (lambda: rt.main(rt.MainOptions()),   # type: ignore[arg-type]
     "rt.main(MainOptions(...)): the options go by name, @rt.main(options=rt.MainOptions"),
])
def test_options_given_to_rt_main_wrongly_fail_as_it_decorates(decorate: Any,
                                                                says: str) -> None:
    with pytest.raises(TypeError) as info:
        decorate()
    assert says in str(info.value)


def test_a_script_that_never_calls_its_rt_main_function_is_told_at_exit(
        tmp_path: Path) -> None:
    """A job whose script decorates ``train`` and forgets to call it exits 0 at once, and
    the job SUCCEEDS having trained nothing: the worker says why as it exits (only in a
    job: ``python train.py --help`` at a terminal ends without calling it too)."""
    script = tmp_path / "train.py"
    script.write_text("import resilient_train as rt\n\n@rt.main\ndef train(ctx):\n"
                      "    pass\n")
    spec = ('{"cluster": {"workerpool0": ["localhost:2222"]}, "environment": "cloud", '
            '"task": {"type": "workerpool0", "index": 0}}')
    env = {k: v for k, v in os.environ.items() if k != "CLUSTER_SPEC"}
    in_job = subprocess.run([sys.executable, str(script)], env=env | {"CLUSTER_SPEC": spec},
                            capture_output=True, text=True, timeout=60, check=False)
    assert in_job.returncode == 0
    assert ("train() is decorated with @rt.main but the script never called it, so nothing "
            'was trained: end the script with `if __name__ == "__main__": train()`'
            ) in in_job.stderr
    at_terminal = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                                 text=True, timeout=60, check=False)
    assert at_terminal.returncode == 0 and "never called" not in at_terminal.stderr


def test_the_uncalled_check_is_quiet_once_one_entry_point_ran(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from resilient_train.runtime import _Uncalled

    monkeypatch.setenv("CLUSTER_SPEC", "{}")
    monkeypatch.setattr("atexit.register", lambda fn: fn)

    def entry(name: str, module: str = "__main__") -> Any:
        def fn() -> None: ...
        fn.__module__, fn.__qualname__ = module, name
        return fn

    two = _Uncalled()
    two.decorated(entry("train"))
    two.decorated(entry("evaluate"))
    two.decorated(entry("helper", module="mylib"))   # a library's: not the script's
    with caplog.at_level("WARNING"):
        two.check()
    assert "train() and evaluate() are decorated with @rt.main but the script never " \
           "called either" in caplog.text and "helper" not in caplog.text
    caplog.clear()
    two.called()   # one of the script's entry points ran: the other is its choice
    two.check()
    imported = _Uncalled()
    imported.decorated(entry("helper", module="mylib"))
    imported.check()
    assert caplog.text == ""


def test_a_known_option_still_builds_and_replaces() -> None:
    opts = rt.CheckpointOptions(save_every_steps=3, node_local=rt.NodeLocal(keep_last=2))
    assert replace(opts, async_save=False).node_local == rt.NodeLocal(keep_last=2)


def test_replace_validates_again() -> None:
    base = CheckpointOptions(save_every_steps=100)
    with pytest.raises(ValueError, match="give one"):
        replace(base, policy=every(60))
    assert replace(base, save_every_steps=None, policy=every(60)).policy == every(60)


# --- the 4-hour ceiling -------------------------------------------------------------------

def test_the_ceiling_holds_under_a_users_policy() -> None:
    p = CheckpointOptions(policy=OnlyAtEpochEnd()).save_policy()
    assert not p.should_save(ctx(7, now=FOUR_HOURS - 1))
    assert p.should_save(ctx(7, now=FOUR_HOURS))                 # 4 h after the last commit
    assert not p.should_save(ctx(7, now=FOUR_HOURS, last_step=7))
    assert p.should_save(ctx(9, now=2 * FOUR_HOURS, last_step=8, last_time=FOUR_HOURS))
    steps = CheckpointOptions(policy=every_n_steps(10**6)).save_policy()
    assert steps.should_save(ctx(3, now=FOUR_HOURS))


def test_the_ceiling_holds_under_save_every_steps_and_by_default() -> None:
    p = CheckpointOptions(save_every_steps=500).save_policy()
    assert p.should_save(ctx(500, now=1)) and p.should_save(ctx(3, now=FOUR_HOURS))
    assert not p.should_save(ctx(3, now=FOUR_HOURS - 1))
    default = CheckpointOptions().save_policy()
    assert not default.should_save(ctx(10**6, now=FOUR_HOURS - 1))
    assert default.should_save(ctx(3, now=FOUR_HOURS))


def test_a_lower_ceiling_by_name() -> None:
    p = CheckpointOptions(policy=OnlyAtEpochEnd(), max_interval_s=600).save_policy()
    assert not p.should_save(ctx(3, now=599)) and p.should_save(ctx(3, now=600))


def test_removing_the_ceiling_by_name() -> None:
    user = OnlyAtEpochEnd()
    p = CheckpointOptions(policy=user, max_interval_s=None).save_policy()
    assert p is user                                              # nothing joined to it
    assert not p.should_save(ctx(3, now=100 * FOUR_HOURS))
    bare = CheckpointOptions(max_interval_s=None).save_policy()   # no condition at all
    assert bare == never() and not bare.should_save(ctx(3, now=100 * FOUR_HOURS))


def test_the_manager_saves_at_the_ceiling_under_a_users_policy(tmp_path: Path) -> None:
    t = [1000.0]
    opts = CheckpointOptions(policy=every_n_steps(10**6), async_save=False)
    with CheckpointManager(tmp_path / "c", options=opts, clock=lambda: t[0]) as mgr:
        mgr.track(model=torch.nn.Linear(2, 2))
        assert not mgr.maybe_save(1)
        t[0] += FOUR_HOURS - 1
        assert not mgr.maybe_save(2)
        t[0] += 1
        assert mgr.maybe_save(3)                                  # 4 h: due whatever the policy
        assert not mgr.maybe_save(4)                              # the clock restarts
    assert [s.step for s in scan(mgr.storage) if s.ok] == [3]

    t = [1000.0]
    opts = replace(opts, max_interval_s=None)
    with CheckpointManager(tmp_path / "d", options=opts, clock=lambda: t[0]) as mgr:
        mgr.track(model=torch.nn.Linear(2, 2))
        t[0] += 100 * FOUR_HOURS
        assert not mgr.maybe_save(1)                              # the ceiling removed by name
    assert scan(mgr.storage) == []


def test_never_with_the_default_ceiling_is_an_error() -> None:
    with pytest.raises(ValueError) as info:
        CheckpointOptions(policy=never())
    msg = str(info.value)
    assert "policy=never()" in msg and "max_interval_s=14400" in msg
    assert "CheckpointOptions(policy=never(), max_interval_s=None)" in msg   # the fix
    p = CheckpointOptions(policy=never(), max_interval_s=None).save_policy()
    assert not p.should_save(ctx(10**6, now=100 * FOUR_HOURS))
    # never() inside a composition is only a part of the policy: no contradiction.
    assert CheckpointOptions(policy=never() | every_n_steps(5)).save_policy().should_save(
        ctx(3, now=FOUR_HOURS))


def test_a_policy_slower_than_the_ceiling_is_an_error() -> None:
    with pytest.raises(ValueError) as info:
        CheckpointOptions(policy=every_n_steps(100) | every(6 * 3600))
    msg = str(info.value)
    assert "every(21600)" in msg and "max_interval_s=14400" in msg
    assert "max_interval_s=21600, or None" in msg                     # the fix
    with pytest.raises(ValueError, match="every\\(21600\\) contradicts"):
        CheckpointOptions(policy=every_n_steps(2) & every(6 * 3600))
    p = CheckpointOptions(policy=every(6 * 3600), max_interval_s=6 * 3600).save_policy()
    assert not p.should_save(ctx(3, now=FOUR_HOURS)) and p.should_save(ctx(3, now=6 * 3600))
    CheckpointOptions(policy=every(FOUR_HOURS))                       # equal: no conflict


def test_auto_interval_and_the_ceiling() -> None:
    # auto_interval's own ceiling is the same 4 h: fine, and the options' ceiling holds.
    p = CheckpointOptions(policy=auto_interval(10**9)).save_policy()
    assert p.should_save(ctx(3, now=FOUR_HOURS))
    with pytest.raises(ValueError) as info:
        CheckpointOptions(policy=auto_interval(10**9, ceiling_s=8 * 3600))
    assert "auto_interval(ceiling_s=28800)" in str(info.value)
    assert "max_interval_s=28800, or None" in str(info.value)
    lifted = CheckpointOptions(policy=auto_interval(10**9, ceiling_s=8 * 3600),
                               max_interval_s=None).save_policy()
    assert not lifted.should_save(SaveContext(3, FOUR_HOURS, None, 0.0, 1.0))
    assert lifted.should_save(SaveContext(3, 8 * 3600, None, 0.0, 1.0))
    CheckpointOptions(policy=auto_interval(ceiling_s=3600))           # lower: no conflict


def test_defaults_are_kept() -> None:
    o = CheckpointOptions()
    assert (o.save_every_steps, o.max_interval_s, o.policy) == (None, FOUR_HOURS, None)
    assert o.retention == RetentionPolicy() and o.retention.keep_last == 3
    assert o.async_save and o.save_on_sigterm is None and o.sync_interval_s == 1.0
    m = MainOptions()
    assert m.final_save and m.save_on_sigterm is None and m.checkpoint is None


# --- SIGTERM: one place decides -----------------------------------------------------------

@pytest.mark.parametrize(("main", "ckpt", "expected"), [
    (None, None, True),         # @rt.main's default
    (False, None, False),       # said in MainOptions only (as before)
    (True, None, True),
    (None, False, False),       # said in CheckpointOptions only: no longer overridden
    (None, True, True),
    (True, True, True),         # said twice, the same way: fine
    (False, False, False),
])
def test_save_on_sigterm_is_decided_in_one_place(main: bool | None, ckpt: bool | None,
                                                 expected: bool) -> None:
    opts = MainOptions(save_on_sigterm=main, checkpoint=CheckpointOptions(save_on_sigterm=ckpt))
    assert opts.checkpoint_options().save_on_sigterm is expected


@pytest.mark.parametrize(("main", "ckpt"), [(True, False), (False, True)])
def test_save_on_sigterm_said_twice_differently_is_an_error(main: bool, ckpt: bool) -> None:
    with pytest.raises(ValueError) as info:
        MainOptions(save_on_sigterm=main, checkpoint=CheckpointOptions(save_on_sigterm=ckpt))
    msg = str(info.value)
    assert f"MainOptions.save_on_sigterm={main}" in msg
    assert f"MainOptions.checkpoint.save_on_sigterm={ckpt}" in msg and "leave the other None" in msg


class Group:
    rank, world_size, is_primary, device = 0, 1, True, torch.device("cpu")


@pytest.mark.parametrize(("opts", "installed"), [
    (MainOptions(), True),
    (MainOptions(checkpoint=CheckpointOptions(save_on_sigterm=False)), False),
    (MainOptions(save_on_sigterm=False), False),
])
def test_the_context_installs_the_sigterm_handler_as_decided(
        tmp_path: Path, opts: MainOptions, installed: bool) -> None:
    before = signal.getsignal(signal.SIGTERM)
    context = Context(Group(), replace(opts, checkpoint_dir=str(tmp_path)))
    try:
        assert context.checkpoints.options.save_on_sigterm is installed
        assert (signal.getsignal(signal.SIGTERM) is not before) is installed
    finally:
        context.checkpoints.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_standalone_manager_leaves_sigterm_alone(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(tmp_path) as mgr:
        assert not mgr.options.save_on_sigterm
        assert signal.getsignal(signal.SIGTERM) is before


# --- MainOptions' other fields ------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "fix"), [
    ({"checkpoint": {"save_every_steps": 5}}, "expected rt.CheckpointOptions(...)"),
    ({"distributed": CheckpointOptions()}, "expected rt.DistributedOptions(...)"),
    ({"checkpoint_dir": ""}, "expected a path or URL"),
    ({"checkpoint_dir": 3}, "expected a path or URL"),
    ({"final_save": "yes"}, "True or False"),
    ({"save_on_sigterm": 1}, "True, False or None"),
])
def test_main_options_refuse_a_bad_value(kwargs: dict[str, Any], fix: str) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        MainOptions(**kwargs)
    (name, value), = kwargs.items()
    assert f"MainOptions.{name}={value!r}" in str(info.value) and fix in str(info.value)


def test_main_options_accept_what_they_document(tmp_path: Path) -> None:
    MainOptions(checkpoint_dir=tmp_path, checkpoint=CheckpointOptions(),
                distributed=rt.DistributedOptions(), final_save=False)
    assert MainOptions(checkpoint_dir="gs://bucket/run").checkpoint_options() == replace(
        CheckpointOptions(), save_on_sigterm=True)


def test_objects_tracked_unnamed_or_a_total_not_a_whole_number_are_named_with_the_fix(
        tmp_path: Path) -> None:
    context = Context(Group(), MainOptions(checkpoint_dir=str(tmp_path)))
    try:
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(TypeError, match=r"takes each object by name, the name it has in "
                           r"the checkpoint: ctx\.track\(model=\.\.\., optimizer=\.\.\., "
                           r"model2=\.\.\., name=\.\.\.\)"):
            context.track(model, opt, torch.nn.Linear(1, 1), 3)
        context.track(model=model, optimizer=opt)
        for total in (1e2, -1, True, "10"):
            with pytest.raises(TypeError, match=r"expected a whole number of steps >= 0"):
                next(context.steps(total))   # type: ignore[arg-type]
    finally:
        context.checkpoints.close()
