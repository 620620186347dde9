"""State capture: RNG round trips, the weights-only check against the real torch.load,
host snapshots, and collect/restore of model + optimizer + scheduler + scaler."""

from __future__ import annotations

import collections
import enum
import io
import logging
import pickle
import random
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient_train.checkpoint.state.capture import (
    HostSnapshot,
    RngState,
    Stateful,
    StateMismatchError,
    UnsafeStateError,
    capture_rng,
    check_weights_only,
    collect,
    restore,
    restore_rng,
    rng_fingerprint,
    tree_map_tensors,
    tree_nbytes,
    tree_on_host,
    unwrap_model,
)

try:
    import numpy as np
except ImportError:  # the package must work without numpy
    np = None  # type: ignore[assignment]

needs_numpy = pytest.mark.skipif(np is None, reason="numpy not installed")


def roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# --- RNG -----------------------------------------------------------------------------


def draw() -> list[Any]:
    out: list[Any] = [random.random(), random.gauss(0, 1), torch.rand(5), torch.randn(3)]
    if np is not None:
        out += [np.random.rand(4).tolist(), float(np.random.standard_normal())]
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(a, b, strict=True))


def test_rng_round_trip_through_weights_only_load() -> None:
    torch.manual_seed(1)
    random.seed(1)
    if np is not None:
        np.random.seed(1)
    draw()  # leaves cached gaussians in python's and numpy's generators: captured too
    state = roundtrip(capture_rng())
    check_weights_only(state)
    assert state["python"][2] is not None
    if np is not None:
        assert state["numpy"]["has_gauss"] == 1
    first = draw()
    restore_rng(state)
    assert same(first, draw())


@needs_numpy
def test_numpy_rng_is_read_again_exactly_when_it_may_have_moved() -> None:
    """numpy's state is reused from the last reading while the generator's raw key and
    position are unchanged (peer recovery reads it twice a step); a cached Gaussian, which
    the next draw consumes without moving them, and a restore are never taken for
    unchanged."""
    from resilient_train.checkpoint.state import capture as state_mod

    def numpy_now() -> tuple[Any, ...]:
        _, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        return key.tobytes(), int(pos), int(has_gauss), float(cached)

    def fingerprint_ok() -> None:
        assert rng_fingerprint()[3] == numpy_now()
        got = capture_rng()["numpy"]
        assert rng_fingerprint({**capture_rng(), "numpy": got})[3] == numpy_now()

    np.random.seed(3)
    reading = state_mod._NUMPY_RNG.read(np)
    assert state_mod._NUMPY_RNG._fast, "numpy's MT19937 layout was not recognised"
    assert state_mod._NUMPY_RNG.read(np) is reading          # nothing drawn: reused
    fingerprint_ok()
    np.random.rand()                                           # the key's position moves
    fingerprint_ok()
    np.random.standard_normal()                                # draws two, caches one
    assert capture_rng()["numpy"]["has_gauss"] == 1
    fingerprint_ok()
    pos = np.random.get_state()[2]
    np.random.standard_normal()                                # the cached one: no move
    assert np.random.get_state()[2] == pos
    assert capture_rng()["numpy"]["has_gauss"] == 0
    fingerprint_ok()
    np.random.standard_normal()
    with_gauss = capture_rng()
    np.random.seed(3)
    np.random.rand(4)
    plain = capture_rng()                                      # has_gauss 0
    restore_rng(with_gauss)                                    # set_state: read again
    assert capture_rng()["numpy"]["has_gauss"] == 1
    fingerprint_ok()
    restore_rng(plain)
    assert capture_rng()["numpy"]["has_gauss"] == 0
    first = np.random.rand(3)
    restore_rng(plain)
    assert np.array_equal(first, np.random.rand(3))
    one, two = capture_rng(), capture_rng()                    # own dicts, one key tensor
    assert one["numpy"] is not two["numpy"] and one["numpy"]["key"] is two["numpy"]["key"]


def test_rng_stateful_wrapper() -> None:
    rng = RngState()
    assert isinstance(rng, Stateful)
    sd = rng.state_dict()
    first = draw()
    rng.load_state_dict(sd)
    assert same(first, draw())


def test_rng_without_numpy(monkeypatch: pytest.MonkeyPatch,
                           caplog: pytest.LogCaptureFixture) -> None:
    full = capture_rng()
    full.setdefault("numpy", {"bit_generator": "MT19937", "pos": 0, "has_gauss": 0,
                              "key": torch.zeros(624, dtype=torch.int64), "cached_gaussian": 0.0})
    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy -> ImportError
    assert "numpy" not in capture_rng()
    first = (torch.rand(3), random.random())
    with caplog.at_level(logging.WARNING):
        restore_rng(full)
    assert "numpy is not importable" in caplog.text
    # The rest was restored.
    again = (torch.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and first[1] == again[1]


def test_rng_cuda_device_count_mismatch(monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    # No GPU here: fake the torch.cuda surface the module touches.
    fake = [torch.full((16,), i, dtype=torch.uint8) for i in range(3)]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(fake))
    state = capture_rng()
    assert [t.tolist() for t in state["torch_cuda"]] == [t.tolist() for t in fake]
    set_calls: list[tuple[list[int], int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda st, device: set_calls.append((st.tolist(), device)))
    with caplog.at_level(logging.WARNING):
        restore_rng(state)
    assert [d for _, d in set_calls] == [0, 1]
    assert set_calls[1][0] == fake[1].tolist()
    assert "CUDA RNG states for 3 device(s), this process sees 2" in caplog.text

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        restore_rng(state)
    assert "CUDA is not available here" in caplog.text


def test_capture_does_not_initialise_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> None:
        raise AssertionError("capture_rng must not read CUDA state when CUDA is not initialised")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", boom)
    assert "torch_cuda" not in capture_rng()


def test_restore_rng_rejects_non_mapping() -> None:
    with pytest.raises(TypeError, match="expected the dict capture_rng"):
        restore_rng([1, 2])  # type: ignore[arg-type]


# --- weights-only check agrees with torch.load(weights_only=True) --------------------


class Color(enum.Enum):
    RED = 1


Point = collections.namedtuple("Point", "x y")


class Plain:
    pass


def _tensor_with_attr(value: Any) -> torch.Tensor:
    t = torch.zeros(2)
    t.note = value  # type: ignore[attr-defined]
    return t


def _od_with_metadata(extra: Any = None) -> OrderedDict[str, Any]:
    sd = torch.nn.BatchNorm1d(3).state_dict()
    if extra is not None:
        sd._metadata["extra"] = extra  # type: ignore[attr-defined]
    return sd


class MyTensor(torch.Tensor):
    pass


CASES: dict[str, Any] = {
    # accepted
    "plain scalars": {"a": 1, "b": 2.5, "c": "s", "d": None, "e": True, "f": 1 + 2j},
    "containers": [(1, 2), {3, 4}, collections.Counter("ab"), OrderedDict(x=1)],
    "bytes and bytearray": {"b": b"xy", "ba": bytearray(b"z"), "empty ba": bytearray()},
    "torch values": [torch.Size([2, 3]), torch.device("cpu"), torch.float16, torch.strided],
    "tensors": [torch.zeros(2), torch.nn.Parameter(torch.ones(2)), torch.arange(9)[2:5]],
    "sparse tensor": torch.eye(2).to_sparse(),
    "tensor with plain attr": _tensor_with_attr("hello"),
    "state_dict with _metadata": _od_with_metadata(),
    "non-str dict keys": {(1, "a"): 1, torch.float32: 2, 3: 4},
    "big int just fits": 2 ** 2030,
    "a run of small ints (an RNG state)": (3, tuple(range(-300, 400)), None),
    "a run of mixed scalars": [1, 2.5, "s", None, True, -(2 ** 2030)],
    # rejected
    "empty bytes": {"x": b""},
    "huge int": [2 ** 2100],
    "huge int at the end of a run": tuple([7] * 600 + [-(2 ** 2100)]),
    "empty bytes in a run": [1, 2, b""],
    "frozenset": frozenset({1}),
    "enum": {"c": Color.RED},
    "namedtuple": Point(1, 2),
    "defaultdict": collections.defaultdict(int),
    "custom object": {"user": {"loader": [0, 1, 2, Plain()]}},
    "range": range(3),
    "tensor subclass": torch.zeros(2).as_subclass(MyTensor),
    "tensor attr unsafe": _tensor_with_attr(frozenset()),
    "generator": torch.Generator(),
    "enum dict key": {Color.RED: 1},
    "set with enum": {Color.RED},
    "metadata unsafe": _od_with_metadata(Color.RED),
    "uninitialized parameter": torch.nn.parameter.UninitializedParameter(),
}
if np is not None:
    CASES.update({"numpy array": np.zeros(3), "numpy scalar": {"loss": np.float64(0.5)}})


def torch_accepts(obj: Any) -> bool:
    try:
        roundtrip(obj)
    # A failure of either torch.save or the weights-only load counts as rejected.
    except (pickle.PicklingError, pickle.UnpicklingError, TypeError, RuntimeError):
        return False
    return True


@pytest.mark.parametrize("name", list(CASES))
def test_check_agrees_with_torch_load(name: str) -> None:
    obj = CASES[name]
    try:
        check_weights_only(obj)
        ours = True
    except UnsafeStateError:
        ours = False
    assert ours == torch_accepts(obj), f"{name}: check says {ours}, torch.load disagrees"


def test_unsafe_error_names_path_type_and_fix() -> None:
    tree = {"user": {"loader": [0, 1, 2, Plain()]}, "ok": torch.zeros(1), "c": Color.RED}
    with pytest.raises(UnsafeStateError) as err:
        check_weights_only(tree, where="state")
    msg = str(err.value)
    assert "2 value(s) in state would make torch.load(weights_only=True) fail" in msg
    assert f"  state['user']['loader'][3]: {__name__}.Plain\n" in msg
    assert f"  state['c']: {__name__}.Color (enum: store x.value or x.name)" in msg
    assert "fix: convert them to tensors or plain containers" in msg
    assert isinstance(err.value, TypeError)
    assert [p for p, _ in err.value.problems] == ["state['user']['loader'][3]", "state['c']"]


def test_unsafe_error_paths_for_attributes_and_keys() -> None:
    od = torch.nn.Linear(2, 2).state_dict()
    od._metadata[""]["bad"] = Color.RED  # type: ignore[attr-defined]
    with pytest.raises(UnsafeStateError) as err:
        check_weights_only({"model": od, "k": {Color.RED: 1}}, where="ckpt")
    paths = [p for p, _ in err.value.problems]
    assert paths == ["ckpt['model']._metadata['']['bad']", "ckpt['k']"]
    assert f"ckpt['k']: a dict key <Color.RED: 1> of type {__name__}.Color (enum" in str(err.value)


@needs_numpy
def test_unsafe_numpy_hints() -> None:
    with pytest.raises(UnsafeStateError) as err:
        check_weights_only({"a": np.zeros(2), "b": np.int64(3)})
    msg = str(err.value)
    assert "state['a']: numpy.ndarray (convert with torch.from_numpy(x))" in msg
    assert "state['b']: numpy.int64 (numpy scalar: use x.item(), int(x) or float(x))" in msg


def test_check_handles_cycles_and_deep_trees() -> None:
    cyclic: list[Any] = [1]
    cyclic.append(cyclic)
    check_weights_only(cyclic)
    deep: Any = 0
    for _ in range(5000):
        deep = [deep]
    check_weights_only(deep)  # no RecursionError


# --- host snapshots --------------------------------------------------------------------


def test_snapshot_reuses_buffers_and_is_independent() -> None:
    live = {"w": torch.randn(4, 3), "opt": {"step": torch.tensor(3.0), "lr": 0.1}, "n": [1, 2]}
    snap = HostSnapshot()
    s1 = snap.snapshot(live)
    assert s1["opt"]["lr"] == 0.1 and s1["n"] == [1, 2]
    assert torch.equal(s1["w"], live["w"]) and s1["w"].data_ptr() != live["w"].data_ptr()
    before = s1["w"].clone()
    live["w"].add_(1.0)
    live["n"].append(3)
    assert torch.equal(s1["w"], before) and s1["n"] == [1, 2]
    ptrs = (s1["w"].data_ptr(), s1["opt"]["step"].data_ptr())
    s2 = snap.snapshot(live)
    assert (s2["w"].data_ptr(), s2["opt"]["step"].data_ptr()) == ptrs
    assert torch.equal(s2["w"], live["w"])
    assert snap.nbytes == 4 * 3 * 4 + 4 == tree_nbytes(s2)
    assert snap.copy_seconds > 0


def test_snapshot_copies_a_state_dicts_metadata() -> None:
    live = {"model": torch.nn.BatchNorm1d(3).state_dict(), "rng": (3, tuple(range(625)), None),
            "runs": [[1, 2], (3, 4)]}
    live["model"]._metadata["odd"] = {"version": [1]}   # type: ignore[attr-defined]
    snap = HostSnapshot().snapshot(live)
    meta = snap["model"]._metadata
    assert meta == live["model"]._metadata   # type: ignore[attr-defined]
    assert meta is not live["model"]._metadata   # type: ignore[attr-defined]
    assert meta[""] is not live["model"]._metadata[""]   # type: ignore[attr-defined]
    live["model"]._metadata[""]["version"] = 99   # type: ignore[attr-defined]
    live["model"]._metadata["odd"]["version"].append(2)   # type: ignore[attr-defined]
    assert meta[""]["version"] != 99 and meta["odd"] == {"version": [1]}
    assert snap["rng"] == live["rng"] and snap["runs"] == [[1, 2], (3, 4)]
    assert snap["runs"][0] is not live["runs"][0]   # a list is copied, never shared
    live["runs"][0].append(5)
    assert snap["runs"][0] == [1, 2]


def test_snapshot_non_contiguous_views_and_conj() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    live = {"t": base.t(), "v": base[1:3, ::2], "c": torch.tensor([1 + 2j]).conj(),
            "p": torch.nn.Parameter(torch.ones(2))}
    snap = HostSnapshot()
    s = snap.snapshot(live)
    for k in ("t", "v", "c"):
        assert torch.equal(s[k], live[k].resolve_conj())
        assert s[k].is_contiguous()
    assert not s["c"].is_conj() and s["c"].item() == 1 - 2j
    assert type(s["p"]) is torch.Tensor and not s["p"].requires_grad
    base.zero_()
    assert s["t"].sum().item() == sum(range(24))
    assert s["v"].tolist() == [[6.0, 8.0, 10.0], [12.0, 14.0, 16.0]]


def test_snapshot_tied_tensors_share_one_copy() -> None:
    w = torch.randn(3)
    snap = HostSnapshot()
    s = snap.snapshot({"a": w, "b": w})
    assert s["a"] is s["b"] and snap.nbytes == 12


def test_snapshot_reallocates_on_dtype_or_shape_change_and_drops_stale() -> None:
    snap = HostSnapshot()
    first = snap.snapshot({"x": torch.zeros(4), "y": torch.zeros(100)})["x"]
    s = snap.snapshot({"x": torch.ones(4, dtype=torch.float64)})
    assert s["x"] is not first and s["x"].dtype == torch.float64 and s["x"].sum() == 4
    assert snap.nbytes == 32  # "y" is gone from the tree: its buffer is released
    s2 = snap.snapshot({"x": torch.ones(2, 2, dtype=torch.float64)})
    assert s2["x"] is not s["x"] and s2["x"].shape == (2, 2)
    assert first.sum() == 0  # old results are never written to


def test_snapshot_keeps_structure_and_metadata() -> None:
    sd = torch.nn.BatchNorm1d(3).state_dict()
    live = {"bn": sd, "pt": Point(1, torch.ones(1)), "tup": (torch.zeros(1), "x"),
            "size": torch.Size([2])}
    s = HostSnapshot().snapshot(live)
    assert type(s["bn"]) is OrderedDict and s["bn"]._metadata == sd._metadata
    assert s["bn"]._metadata is not sd._metadata
    assert type(s["pt"]) is Point and type(s["tup"]) is tuple and type(s["size"]) is torch.Size
    roundtrip(s["bn"])
    assert list(s["bn"]) == list(sd)


@pytest.mark.parametrize("tensor, match", [
    (torch.eye(2).to_sparse(), r"state\['x'\] is a torch.sparse_coo tensor"),
    (torch.empty(2, device="meta"), r"state\['x'\] is a meta tensor \(shape \(2,\)\), which has no data"),
    (torch.zeros(2).as_subclass(MyTensor), r"tensor subclass"),
])
def test_snapshot_rejects_unsupported_tensors(tensor: torch.Tensor, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        HostSnapshot().snapshot({"x": tensor})


def test_snapshot_dtensor_points_to_distributed_checkpoint() -> None:
    class DTensor(torch.Tensor):  # stands in for torch.distributed.tensor.DTensor
        pass

    with pytest.raises(TypeError, match="sharded state goes through the distributed checkpoint"):
        HostSnapshot().snapshot({"w": torch.zeros(1).as_subclass(DTensor)})


def test_snapshot_rejects_cycles() -> None:
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="contains itself"):
        HostSnapshot().snapshot({"c": cyclic})


def test_tree_helpers() -> None:
    tree = {"a": [torch.zeros(2), 3], "b": (torch.ones(3, dtype=torch.float64),)}
    doubled = tree_map_tensors(lambda t: t * 2, tree)
    assert doubled["a"][1] == 3 and doubled["b"][0].tolist() == [2.0, 2.0, 2.0]
    assert tree_nbytes(tree) == 8 + 24


# --- collect / restore -------------------------------------------------------------------


def make_run(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler,
            "rng": RngState()}


def train(run: dict[str, Any], steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 8)  # drawn from the global RNG, as is the dropout mask
        loss = (run["model"](x) - x.sum(1, keepdim=True)).pow(2).mean()
        run["optimizer"].zero_grad()
        run["scaler"].scale(loss).backward()
        run["scaler"].step(run["optimizer"])
        run["scaler"].update()
        run["scheduler"].step()
        losses.append(loss.item())
    return losses


def test_collect_save_load_restore_trains_bitwise_identical(tmp_path: Path) -> None:
    orig = make_run(0)
    train(orig, 3)
    tracked = {**orig, "step": 3, "loader": {"epoch": 0, "index": 48}}
    snap = HostSnapshot().snapshot(collect(tracked))
    check_weights_only(snap)
    torch.save(snap, tmp_path / "ckpt.pt")
    expected_losses = train(orig, 4)

    fresh = make_run(1)  # different init: the restore must overwrite all of it
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    plain = restore({**fresh, "step": 0, "loader": {}}, loaded)
    assert plain == {"step": 3, "loader": {"epoch": 0, "index": 48}}
    assert train(fresh, 4) == expected_losses
    for a, b in zip(orig["model"].state_dict().values(), fresh["model"].state_dict().values()):
        assert torch.equal(a, b)
    for sa, sb in zip(orig["optimizer"].state.values(), fresh["optimizer"].state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert orig["scheduler"].get_last_lr() == fresh["scheduler"].get_last_lr()
    assert orig["scaler"].state_dict() == fresh["scaler"].state_dict()


def named(**modules: torch.nn.Module) -> torch.nn.Module:
    return torch.nn.Sequential(OrderedDict(modules))


def test_shape_mismatch_message_exact() -> None:
    ckpt = {"model": named(layer=torch.nn.Linear(16, 64)).state_dict()}
    with pytest.raises(StateMismatchError) as err:
        restore({"model": named(layer=torch.nn.Linear(16, 32))}, ckpt)
    assert str(err.value) == (
        "checkpoint does not match the tracked objects:\n"
        "  'model' (torch.nn.Module Sequential):\n"
        "    shape mismatches, 2:\n"
        "      layer.weight: checkpoint (64, 16) vs model (32, 16)\n"
        "      layer.bias: checkpoint (64,) vs model (32,)\n"
        "    fix: is this the same model config as the run that wrote the checkpoint?"
    )


def test_missing_and_unexpected_keys_message_exact() -> None:
    sd = named(layer=torch.nn.Linear(4, 4)).state_dict()
    del sd["layer.bias"]
    sd["extra.weight"] = torch.zeros(1)
    model = named(layer=torch.nn.Linear(4, 4))
    before = model.layer.weight.detach().clone()
    with pytest.raises(StateMismatchError) as err:
        restore({"model": model}, {"model": sd})
    assert str(err.value) == (
        "checkpoint does not match the tracked objects:\n"
        "  'model' (torch.nn.Module Sequential):\n"
        "    missing keys (in the model, not in the checkpoint), 1:\n"
        "      layer.bias\n"
        "    unexpected keys (in the checkpoint, not in the model), 1:\n"
        "      extra.weight\n"
        "    fix: is this the same model config as the run that wrote the checkpoint?"
    )
    assert torch.equal(model.layer.weight, before)  # checked before anything was loaded
    # strict=False: missing/unexpected keys are skipped, the rest loads.
    restore({"model": model}, {"model": sd}, strict=False)
    assert torch.equal(model.layer.weight, sd["layer.weight"])


def test_many_missing_keys_are_truncated() -> None:
    big = named(**{f"l{i}": torch.nn.Linear(1, 1, bias=False) for i in range(25)})
    with pytest.raises(StateMismatchError) as err:
        restore({"model": big}, {"model": {}})
    msg = str(err.value)
    assert "missing keys (in the model, not in the checkpoint), 25:" in msg
    assert "      l19.weight\n      ... and 5 more\n" in msg and "l20.weight" not in msg


class Wrapper(torch.nn.Module):
    """A wrapper of a user's own that, like DDP, puts 'module.' before every key."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def bn_net() -> torch.nn.Module:
    net = named(lin=torch.nn.Linear(3, 4), bn=torch.nn.BatchNorm1d(4))
    net(torch.randn(8, 3))   # running statistics away from their defaults
    return net


@pytest.mark.parametrize("wrapped_side", ["checkpoint", "model"])
def test_keys_that_differ_by_a_wrapper_prefix_load(
        wrapped_side: str, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint of a DDP-wrapped (or compiled) model loads into the bare model and the
    other way round: the keys differ only by the wrapper's prefix, and nothing else."""
    src, dst = bn_net(), bn_net().eval()
    torch.nn.init.zeros_(dst.lin.weight)
    saved = (Wrapper(src) if wrapped_side == "checkpoint" else src).state_dict()
    into = Wrapper(dst) if wrapped_side == "model" else dst
    with caplog.at_level(logging.INFO, logger="resilient_train.checkpoint.state.capture"):
        restore({"model": into}, {"model": saved})
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    how = "carry" if wrapped_side == "checkpoint" else "lack"
    assert f"the checkpoint's keys {how} the 'module.' prefix of a model wrapper" in caplog.text


def test_a_prefix_on_some_keys_only_is_still_a_mismatch() -> None:
    model = named(a=torch.nn.Linear(2, 2), b=torch.nn.Linear(2, 2))
    sd = model.state_dict()
    sd = {("module." + k if k.startswith("a.") else k): v for k, v in sd.items()}
    with pytest.raises(StateMismatchError, match="missing keys") as err:
        restore({"model": model}, {"model": sd})
    assert "module.a.weight" in str(err.value)


def test_unwrap_model_peels_compile_and_data_parallel() -> None:
    inner = torch.nn.Linear(2, 2)
    assert unwrap_model(torch.nn.DataParallel(torch.compile(inner))) is inner
    assert unwrap_model(torch.compile(torch.nn.DataParallel(inner))) is inner
    own = Wrapper(inner)
    assert unwrap_model(own) is own and unwrap_model(3) == 3   # not a wrapper we know


def test_optimizer_param_count_mismatch_message_exact() -> None:
    big = named(a=torch.nn.Linear(2, 2), b=torch.nn.Linear(2, 2))
    small = named(a=torch.nn.Linear(2, 2))
    ckpt = {"opt": torch.optim.SGD(big.parameters(), lr=0.1).state_dict()}
    with pytest.raises(StateMismatchError) as err:
        restore({"opt": torch.optim.SGD(small.parameters(), lr=0.1)}, ckpt)
    assert str(err.value) == (
        "checkpoint does not match the tracked objects:\n"
        "  'opt' (torch.optim.SGD):\n"
        "    param count mismatches, 1:\n"
        "      param group 0: checkpoint 4 params vs optimizer 2 params\n"
        "    fix: was the optimizer built over the same parameters (model config, param "
        "groups, frozen layers) as in the run that wrote the checkpoint?"
    )
    two_groups = torch.optim.SGD([{"params": [big.a.weight]}, {"params": [big.b.weight]}], lr=0.1)
    with pytest.raises(StateMismatchError, match="param groups: checkpoint 1 vs optimizer 2"):
        restore({"opt": two_groups}, ckpt)


def _stepped_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, model.in_features)).sum().backward()
    opt.step()
    return opt


def test_optimizer_state_of_another_model_with_as_many_params_is_refused() -> None:
    # Linear(4, 3) and Linear(5, 3) both have 2 parameters: only the state's shapes differ,
    # and torch would load it and fail at the first step() with a size error.
    ckpt = {"opt": _stepped_adamw(torch.nn.Linear(4, 3)).state_dict()}
    other = torch.optim.AdamW(torch.nn.Linear(5, 3).parameters())
    before = other.state_dict()
    with pytest.raises(StateMismatchError) as err:
        restore({"opt": other}, ckpt)
    text = str(err.value)
    assert "state shape mismatches, 2:" in text
    assert "param 0 exp_avg: checkpoint (3, 4) vs parameter (3, 5)" in text
    assert other.state_dict() == before   # nothing loaded


def test_optimizer_state_of_another_optimizer_class_is_refused() -> None:
    model = torch.nn.Linear(4, 3)
    ckpt = {"opt": _stepped_adamw(model).state_dict()}
    with pytest.raises(StateMismatchError, match=r"the checkpoint's .*betas.*; this "
                                                 r"optimizer's .*momentum.*another optimizer"):
        restore({"opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}, ckpt)
    # Adam and AdamW share their hyperparameters and state: that restore is allowed.
    assert restore({"opt": torch.optim.Adam(model.parameters())}, ckpt) == {}


def test_tracked_names_mismatch(caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(StateMismatchError) as err:
        restore({"model": model, "ema": torch.nn.Linear(2, 2)},
                {"model": model.state_dict(), "old": 1})
    assert str(err.value) == (
        "checkpoint does not match the tracked objects:\n"
        "  tracked but not in the checkpoint, 1:\n"
        "    ema\n"
        "  in the checkpoint but not tracked, 1:\n"
        "    old\n"
        "  fix: track the same names as the run that wrote the checkpoint, "
        "or pass strict=False to skip them"
    )
    with caplog.at_level(logging.WARNING):
        plain = restore({"model": model, "ema": torch.nn.Linear(2, 2)},
                        {"model": model.state_dict(), "old": 1}, strict=False)
    assert plain == {} and "strict=False" in caplog.text and "old" in caplog.text
    assert "pass strict=False" not in caplog.text   # it was: no advice to do it again


def test_optimizer_state_dict_that_is_not_one() -> None:
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(StateMismatchError,
                       match=r"expected an Optimizer.state_dict\(\) with 'state' and "
                             r"'param_groups', found \['lr'\]"):
        restore({"opt": opt}, {"opt": {"lr": 0.1}})


def test_tree_on_host_sees_tensors_off_the_cpu() -> None:
    # A blocking save writes a tree as it is only when this holds; accelerator state goes
    # through the host snapshot, so no file ever holds device tensors.
    assert tree_on_host({"a": [torch.ones(2), (1, "x")], "b": {"c": torch.zeros(1)}})
    assert tree_on_host({"no": "tensors"})
    assert not tree_on_host({"a": [torch.ones(2), torch.empty(3, device="meta")]})


_RANK_LOCAL = """
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.optim import ZeroRedundancyOptimizer
from resilient_train import CheckpointManager
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store",
                        rank=0, world_size=1)
fsdp1 = FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(2, 2)),
                                 device_id=torch.device("cpu"))
zero = ZeroRedundancyOptimizer(torch.nn.Linear(2, 2).parameters(),
                               optimizer_class=torch.optim.SGD, lr=0.1)
with CheckpointManager(sys.argv[1] + "/ckpt") as mgr:
    for name, obj in (("model", fsdp1), ("opt", zero)):
        try:
            mgr.track(**{name: obj})
        except TypeError as exc:
            print(exc)
    mgr.track(ok=torch.nn.Linear(2, 2))
    print("tracked", sorted(mgr._tracked))
dist.destroy_process_group()
"""


def test_state_that_no_rank_can_save_alone_is_refused_at_track_naming_the_fix(
        tmp_path: Path) -> None:
    """FSDP1's state_dict() is a collective (the primary's save alone would hang) and ZeRO's
    raises until consolidated: both are refused when tracked, before any training."""
    out = subprocess.run([sys.executable, "-c", _RANK_LOCAL, str(tmp_path)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    fsdp1, zero, tracked = out.strip().splitlines()
    assert "FullyShardedDataParallel (FSDP1)" in fsdp1 and "first save would hang" in fsdp1
    assert "fully_shard(model)" in fsdp1
    assert "ZeroRedundancyOptimizer" in zero and "consolidate_state_dict()" in zero
    assert "reshard_after_forward=False" in zero
    assert tracked == "tracked ['ok']"   # nothing refused was tracked


def test_a_generator_is_refused_at_track_saying_to_keep_it_per_rank(tmp_path: Path) -> None:
    from resilient_train import CheckpointManager

    gen = torch.Generator().manual_seed(3)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(TypeError, match=r"ctx.track\(gen=...\) got a torch.Generator") \
                as err:
            mgr.track(gen=gen)
        assert "ctx.values['gen'] = gen.get_state()" in str(err.value)
        assert "gen" not in mgr._tracked


def test_a_numpy_or_random_generator_is_refused_at_track_and_its_kept_state_loads(
        tmp_path: Path) -> None:
    """np.random.default_rng() and random.Random() in the main process are each rank's own
    streams too: refused at track with the per-rank recipe (not "numpy scalar: use
    x.item()", which it said before), and the recipe works: their state goes in
    ctx.values, is saved, and loads weights-only into new generators that then draw what
    the first would have."""
    import random

    import numpy as np

    from resilient_train import CheckpointManager

    rng, py = np.random.default_rng(7), random.Random(7)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        for name, obj, kind in (("rng", rng, "a NumPy Generator"),
                                ("legacy", np.random.RandomState(7), "a NumPy RandomState"),
                                ("py", py, "a random.Random")):
            with pytest.raises(TypeError, match=rf"ctx.track\({name}=...\) got {kind}"):
                mgr.track(**{name: obj})
        rng.random(5), py.random()
        mgr.values["rng"] = rng.bit_generator.state   # the recipes: checked as they are set
        mgr.values["py"] = py.getstate()
        mgr.save(1, blocking=True)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore_latest(strict=False) == 1
        again, py_again = np.random.default_rng(0), random.Random(0)
        again.bit_generator.state = mgr.values["rng"]
        py_again.setstate(mgr.values["py"])
        assert again.random(3).tolist() == rng.random(3).tolist()
        assert py_again.random() == py.random()


def test_a_stateless_object_is_refused_at_track_not_at_the_first_save(
        tmp_path: Path) -> None:
    """A DataLoader tracked to resume its position (it has no state_dict) failed at the
    first save, perhaps hours in, with a generic message: it is refused when tracked,
    naming ResumableLoader. Any other value that would not load as weights only too; a
    plain value still tracks."""
    from resilient_train import CheckpointManager

    loader = torch.utils.data.DataLoader(torch.arange(4.0), batch_size=2)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(TypeError, match=r"ctx.track\(data=...\) got a torch DataLoader") \
                as err:
            mgr.track(data=loader)
        assert "rt.ResumableLoader(dataset, batch_size=..." in str(err.value)
        with pytest.raises(UnsafeStateError, match=r"in ctx.track\(odd=...\) would make"):
            mgr.track(odd=Plain())
        mgr.track(counts={"seen": 3}, table=torch.zeros(2))
        assert sorted(mgr._tracked) == ["counts", "table"]
