"""Capture and restore training state: RNGs, stateful objects and host snapshots.

Everything captured here must survive ``torch.load(weights_only=True)`` (docs/design.md,
"Commit protocols": loading a checkpoint runs no code), so RNG states are stored as tensors
and plain containers, and :func:`check_weights_only` finds any leaf that would be rejected
*before* a save, naming its path, instead of after a crash when the checkpoint is needed.

:class:`HostSnapshot` copies a state tree into host buffers it keeps between saves: a copy
into already-touched buffers is 5-10x faster than a fresh ``clone`` (docs/libraries.md,
"Local disk and torch"), and training may continue while a writer thread serialises the copy.
"""

from __future__ import annotations

import copy
import ctypes
import enum
import functools
import logging
import pickle
import random
import re
import sys
import threading
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "HostSnapshot",
    "RngState",
    "SnapshotOptions",
    "StateMismatchError",
    "Stateful",
    "UnsafeStateError",
    "capture_rng",
    "check_weights_only",
    "collect",
    "clear_step_leftovers",
    "restore",
    "restore_rng",
    "rng_fingerprint",
    "has_dtensor",
    "tree_map_tensors",
    "weights_only_refusal",
    "tree_nbytes",
]

RNG_FORMAT_VERSION = 1
# Lists in error messages stay readable: this many items, then "... and N more".
MAX_LISTED = 20


class UnsafeStateError(TypeError):
    """State holds values that ``torch.load(weights_only=True)`` would refuse to load."""

    def __init__(self, message: str, problems: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.problems = problems  # (path, what was found)


class StateMismatchError(ValueError):
    """A checkpoint does not fit the objects it is restored into."""


# --------------------------------------------------------------------------------------
# Paths and small helpers


def _fmt_path(where: str, segments: tuple[str, ...]) -> str:
    return where + "".join(segments)


def _type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _short_repr(obj: Any, limit: int = 40) -> str:
    r = repr(obj)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _listing(items: list[str], indent: str) -> list[str]:
    lines = [indent + item for item in items[:MAX_LISTED]]
    if len(items) > MAX_LISTED:
        lines.append(f"{indent}... and {len(items) - MAX_LISTED} more")
    return lines


# --------------------------------------------------------------------------------------
# RNG


def capture_rng() -> dict[str, Any]:
    """The process's RNG states as tensors and plain containers (weights-only loadable).

    Keys: ``python`` (``random.getstate()``), ``torch_cpu``, ``torch_cuda`` (one state per
    device, only when CUDA is already initialised: reading it must not initialise CUDA),
    ``numpy`` (the legacy global ``np.random`` state, when numpy is importable).
    """
    state: dict[str, Any] = {
        "version": RNG_FORMAT_VERSION,
        "python": random.getstate(),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():
        state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
    np = _numpy()
    if np is not None:
        state["numpy"] = dict(_NUMPY_RNG.read(np).captured)
    return state


def rng_fingerprint(captured: Mapping[str, Any] | None = None) -> tuple[Any, ...]:
    """Something that compares equal exactly when no RNG that :func:`capture_rng` captures
    has moved: of ``captured`` (what capture_rng returned), or of the RNGs now, at a
    fraction of capture_rng's cost (no tensor of the numpy state, no copied CUDA states)."""
    if captured is not None:
        np_state = captured.get("numpy")
        return (bytes(captured["torch_cpu"].numpy()), captured["python"],
                tuple(bytes(s.numpy()) for s in captured.get("torch_cuda", ())),
                None if np_state is None else (
                    np_state["key"].numpy().astype("uint32").tobytes(), np_state["pos"],
                    np_state["has_gauss"], np_state["cached_gaussian"]))
    cuda = tuple(bytes(s.numpy()) for s in torch.cuda.get_rng_state_all()) \
        if torch.cuda.is_initialized() else ()
    np = _numpy()
    return (bytes(torch.get_rng_state().numpy()), random.getstate(), cuda,
            None if np is None else _NUMPY_RNG.read(np).fingerprint)


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng` captured. A part that cannot be restored here
    (numpy missing, fewer CUDA devices, no CUDA) is logged as a warning and skipped."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"restore_rng expected the dict capture_rng() returned, found {_type_name(state)}; "
            "pass the 'rng' entry of the checkpoint, not the whole checkpoint or a file path"
        )
    known = {"version", "python", "torch_cpu", "torch_cuda", "numpy"}
    unknown = sorted(str(k) for k in state if k not in known)
    if unknown:
        logger.warning("RNG state has entries this version does not know, ignored: %s", unknown)
    if "python" in state:
        version, internal, gauss = state["python"]
        # Tuples, not lists: random.setstate insists (a JSON round trip would make lists).
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if "torch_cpu" in state:
        # set_rng_state needs a CPU ByteTensor; a load with map_location may have moved it.
        torch.set_rng_state(state["torch_cpu"].to("cpu", torch.uint8))
    if "torch_cuda" in state:
        _restore_cuda_rng(list(state["torch_cuda"]))
    elif torch.cuda.is_initialized():
        logger.debug("checkpoint has no CUDA RNG state (CUDA was not initialised when it "
                     "was captured); CUDA generators keep their current state")
    if "numpy" in state:
        _restore_numpy_rng(state["numpy"])


def _restore_cuda_rng(states: list[torch.Tensor]) -> None:
    if not torch.cuda.is_available():
        logger.warning(
            "checkpoint has CUDA RNG states for %d device(s) but CUDA is not available here; "
            "they are not restored, so GPU random draws will differ from the original run",
            len(states))
        return
    count = torch.cuda.device_count()  # does not initialise CUDA
    if count != len(states):
        logger.warning(
            "checkpoint has CUDA RNG states for %d device(s), this process sees %d; restoring "
            "the first %d (is CUDA_VISIBLE_DEVICES the same as in the original run?)",
            len(states), count, min(count, len(states)))
    for index, st in enumerate(states[:count]):
        # Lazy when CUDA is not initialised yet: applied at initialisation, no init now.
        torch.cuda.set_rng_state(st.to("cpu", torch.uint8), index)


def _restore_numpy_rng(np_state: Mapping[str, Any]) -> None:
    np = _numpy()
    if np is None:
        logger.warning("checkpoint has numpy's RNG state but numpy is not importable here; "
                       "not restored (install numpy if the training code draws from it)")
        return
    _NUMPY_RNG.forget()   # the state set may differ from the last reading in its Gaussian
    np.random.set_state((
        np_state["bit_generator"],
        np_state["key"].cpu().numpy().astype(np.uint32),
        int(np_state["pos"]),
        int(np_state["has_gauss"]),
        float(np_state["cached_gaussian"]),
    ))


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


@dataclass(frozen=True)
class _NumpyReading:
    raw: bytes                    # the generator's key and position, as numpy holds them
    has_gauss: int
    captured: dict[str, Any]      # capture_rng's "numpy" entry
    fingerprint: tuple[Any, ...]  # rng_fingerprint's part for numpy


class _NumpyRng:
    """numpy's legacy global generator (``np.random.get_state(legacy=True)``), read again
    only where it may have moved. ``get_state`` copies the 624-word key into a new array
    (some 45 us), and peer recovery reads the state twice a step (tiers/peers.py) although most
    loops never draw from numpy. The generator's raw state, its key and position (numpy's
    ``mt19937_state`` struct, at the documented ``BitGenerator.ctypes.state_address``),
    is a 2.5 KB memcpy: unchanged bytes mean an unchanged state, except for the legacy
    Gaussian that a draw caches and the next draw consumes without moving the key. So a
    reading that holds a cached Gaussian is never reused, and :func:`restore_rng`'s
    ``set_state`` forgets the last reading. The layout is checked against ``get_state``
    at the first reading; where it differs (another numpy), every reading is a full one.
    """

    _SIZE = 624 * 4 + 4   # uint32 key[624]; int pos

    def __init__(self) -> None:
        self._last: _NumpyReading | None = None
        self._fast: bool | None = None   # None: the layout is not checked yet

    def forget(self) -> None:
        self._last = None

    def read(self, np: Any) -> _NumpyReading:
        raw = self._raw(np) if self._fast is not False else b""
        last = self._last
        if raw and last is not None and not last.has_gauss and raw == last.raw:
            return last
        name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        if self._fast is None:
            self._fast = raw == key.tobytes() + int(pos).to_bytes(4, sys.byteorder, signed=True)
            if not self._fast:
                logger.debug("numpy's MT19937 state is not laid out as expected: its RNG is "
                             "read with get_state every time")
        captured = {
            "bit_generator": str(name),
            # uint32 -> int64: every torch version stores and loads int64 tensors.
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
        reading = _NumpyReading(raw if self._fast else b"", int(has_gauss), captured,
                                (key.tobytes(), int(pos), int(has_gauss), float(cached)))
        self._last = reading
        return reading

    @staticmethod
    def _raw(np: Any) -> bytes:
        try:
            address = np.random.mtrand._rand._bit_generator.ctypes.state_address
        except AttributeError:
            return b""
        return ctypes.string_at(address, _NumpyRng._SIZE)


_NUMPY_RNG = _NumpyRng()


class RngState:
    """A :class:`Stateful` wrapper around the process RNGs, so they can be tracked by name."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        restore_rng(state_dict)


# --------------------------------------------------------------------------------------
# Weights-only check

# Exactly what torch/_weights_only_unpickler.py rebuilds by default (torch 2.13, pickle
# protocol 2 as torch.save writes). Exact types: subclasses (np.float64 is a float,
# namedtuples are tuples, IntEnum is an int) pickle as their own class and are rejected.
_SCALAR_TYPES: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray,
     torch.device, torch.dtype, torch.layout, torch.qscheme}
)
# Ints of 256+ bytes pickle as LONG4, an opcode the weights-only unpickler does not know.
_LONG4_MIN_BYTES = 256
_TENSOR_TYPES: tuple[type, ...] = (torch.Tensor, torch.nn.Parameter)


def _scalar_problem(obj: Any) -> str | None:
    """Why a non-container, non-tensor value is rejected, or None if it is accepted."""
    t = type(obj)
    if t in _SCALAR_TYPES:
        if t is int and obj.bit_length() >= 8 * (_LONG4_MIN_BYTES - 1) and \
                len(pickle.encode_long(obj)) >= _LONG4_MIN_BYTES:  # type: ignore[attr-defined]
            return f"int of {obj.bit_length()} bits (store it as a str or a tensor)"
        if t is bytes and not obj:
            # b"" pickles as a call to builtins.bytes, which is not allowlisted.
            return "empty bytes b'' (store bytearray() or a str instead)"
        return None
    if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
        return None
    return _unsafe_hint(obj)


def _unsafe_hint(obj: Any) -> str:
    name = _type_name(obj)
    module = type(obj).__module__
    if module.startswith("numpy"):
        if hasattr(obj, "shape") and getattr(obj, "ndim", 0) > 0:
            return f"{name} (convert with torch.from_numpy(x))"
        if hasattr(obj, "dtype") and hasattr(obj, "item"):
            return f"{name} (numpy scalar: use x.item(), int(x) or float(x))"
        return name
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return f"{name} (namedtuple: convert with tuple(x) or x._asdict())"
    if isinstance(obj, enum.Enum):
        return f"{name} (enum: store x.value or x.name)"
    if isinstance(obj, frozenset):
        return f"{name} (convert to a set or a sorted list)"
    if isinstance(obj, (dict, list, tuple, set, str, int, float, bytes)):
        # The exact plain types were accepted before we got here: this is a subclass.
        return f"{name} (subclass of a plain type: convert to the plain type, e.g. dict(x))"
    return name


def check_weights_only(tree: Any, *, where: str = "state") -> None:
    """Raise :class:`UnsafeStateError` if ``torch.load(weights_only=True)`` would reject
    anything in ``tree``; the message names each offending path (``state['user'][3]``)
    and its type. Types allowlisted with ``torch.serialization.add_safe_globals`` are
    still reported: the process that loads the checkpoint may not have registered them."""
    problems: list[tuple[str, str]] = []
    for path, found in _unsafe_leaves(tree, where):
        problems.append((path, found))
    if not problems:
        return
    lines = [(
        f"{len(problems)} value(s) in {where} would make torch.load(weights_only=True) fail "
        "when the checkpoint is read back:"
    )]
    lines += _listing([f"{path}: {found}" for path, found in problems], "  ")
    lines.append(
        "fix: convert them to tensors or plain containers (dict, list, tuple, set, str, int, "
        "float, bool, None), or keep them out of the checkpoint. Checkpoints load with "
        "weights_only=True so that loading one cannot run code."
    )
    raise UnsafeStateError("\n".join(lines), problems)


# Sentences of torch's weights-only refusal that advise rather than explain: re-running with
# weights_only=False (what a tampered file wants), allowlisting the global, the docs link.
_ADVICE = re.compile(
    r"weights_only` (?:argument|set to)|weights_only=False|arbitrary code|trusted source|"
    r"trust the source|safe_globals|file an issue|documentation of torch\.load|"
    r"two options|Alternatively|In PyTorch 2\.6", re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_REASON_LIMIT = 600


def weights_only_refusal(exc: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, without torch's advice.

    torch's message leads with advice to load with ``weights_only=False`` (which runs
    whatever code a tampered file carries) and puts the reason last ("Trying to load
    unsupported GLOBAL posix.system whose module posix is blocked"); a cut at a fixed
    length keeps only the advice. This keeps the sentences that say what was found.
    """
    text = _ANSI.sub("", str(exc)).replace("WeightsUnpickler error:", " ")
    sentences = [re.sub(r"^\(\d\)\s*", "", part.strip()) for line in text.splitlines()
                 for part in re.split(r"(?<=[.!?])\s+", line)]
    kept = [s for s in sentences if s and not _ADVICE.search(s)
            and s.rstrip(".") != "Weights only load failed"]
    reason = " ".join(kept) or type(exc).__name__
    if len(reason) > _REASON_LIMIT:  # the reason comes first: what is cut is detail
        reason = reason[:_REASON_LIMIT].rsplit(" ", 1)[0] + " ..."
    return reason


# Leaves that weights-only loading always accepts, so the walk need not visit them (ints
# only below LONG4's size; bytes are not here: b"" is refused).
_PLAIN_LEAVES: frozenset[type] = _SCALAR_TYPES - {int, bytes, bytearray}
_SHORT_INT_BITS = 8 * (_LONG4_MIN_BYTES - 1)


def _accepted(value: Any) -> bool:
    t = type(value)
    return t in _PLAIN_LEAVES or (t is int and value.bit_length() < _SHORT_INT_BITS)


def _plain_run(seq: Any) -> bool:
    """Whether every item of a list or tuple is accepted, checked at C speed for the
    common runs (an RNG state is a tuple of 625 ints)."""
    kinds = set(map(type, seq))
    if kinds <= _PLAIN_LEAVES:
        return True
    return kinds == {int} and max(map(abs, seq)).bit_length() < _SHORT_INT_BITS


# A path in the walk below is built as linked pairs (parent, (kind, key)) and spelled out
# only for a value that is reported: a save walks every leaf of the state each time.
_Path = tuple[Any, ...]


def _spell(where: str, path: _Path) -> str:
    parts: list[str] = []
    while path:
        path, (kind, key) = path
        parts.append(f"[{key!r}]" if kind == "[" else f".{key}")
    return where + "".join(reversed(parts))


def _unsafe_leaves(tree: Any, where: str) -> Iterator[tuple[str, str]]:
    # Iterative walk: deep trees must not hit the recursion limit; `seen` stops cycles
    # (pickle's memo handles shared and cyclic references, so they are fine to save).
    stack: list[tuple[_Path, Any]] = [((), tree)]
    seen: set[int] = set()
    accepted = _accepted
    while stack:
        path, obj = stack.pop()
        t = type(obj)
        if t in (dict, OrderedDict, Counter, list, tuple, set, torch.Size) or t in _TENSOR_TYPES:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
        children: list[tuple[_Path, Any]] = []
        if t in (dict, OrderedDict, Counter):
            for key, value in obj.items():
                # str/int keys (nearly all of them) skip the walk.
                kp = None if type(key) in (str, int) else _first_problem(key)
                if kp is not None:
                    yield (_spell(where, path), f"a dict key {_short_repr(key)} of type {kp}")
                    continue
                if not accepted(value):
                    children.append(((path, ("[", key)), value))
            if t is not dict:
                # OrderedDict attributes are pickled too (a state_dict's _metadata).
                children += [((path, (".", k)), v) for k, v in vars(obj).items()]
        elif t in (list, tuple, torch.Size):
            if not _plain_run(obj):
                children = [((path, ("[", i)), v) for i, v in enumerate(obj)
                            if not accepted(v)]
        elif t is set:
            for member in obj:
                mp = _first_problem(member)
                if mp is not None:
                    yield (_spell(where, path), f"a set member {_short_repr(member)} of type {mp}")
        elif t in _TENSOR_TYPES:
            # Python attributes set on a tensor are pickled with it.
            if obj.__dict__:
                children = [((path, (".", k)), v) for k, v in vars(obj).items()]
        elif isinstance(obj, torch.Tensor):
            yield (_spell(where, path), _tensor_subclass_problem(obj))
        else:
            problem = _scalar_problem(obj)
            if problem is not None:
                yield (_spell(where, path), problem)
        stack.extend(reversed(children))


def _first_problem(obj: Any) -> str | None:
    for _path, found in _unsafe_leaves(obj, ""):
        return found
    return None


def _tensor_subclass_problem(t: torch.Tensor) -> str:
    name = _type_name(t)
    if _is_dtensor(t):
        return (f"{name} (sharded state goes through the distributed checkpoint path, "
                "torch.distributed.checkpoint, not this one)")
    if isinstance(t, torch.nn.parameter.UninitializedParameter):
        return f"{name} (a lazy module that never ran forward: run one batch first)"
    return f"{name} (tensor subclass: convert with x.as_subclass(torch.Tensor) if it holds " \
           "no extra state)"


def _is_dtensor(t: torch.Tensor) -> bool:
    return _is_dtensor_type(type(t))


@functools.cache
def _is_dtensor_type(t: type) -> bool:
    # By name: importing torch.distributed.tensor just to check would be heavy.
    return any(c.__name__ == "DTensor" for c in t.__mro__)


# --------------------------------------------------------------------------------------
# Tree walking


# Immutable scalars: copy.deepcopy returns them as they are.
_ATOMS: frozenset[type] = frozenset({type(None), bool, int, float, complex, str, bytes})


def _copy_leaf(obj: Any) -> Any:
    """copy.deepcopy, without its dispatch for the scalars that fill a state tree."""
    return obj if type(obj) in _ATOMS else copy.deepcopy(obj)


def _copy_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """copy.deepcopy of an OrderedDict's attributes. A state_dict's ``_metadata`` (an
    OrderedDict of small dicts of scalars, one per submodule) is copied directly: deepcopy's
    machinery cost more than the rest of a small model's snapshot."""
    out: dict[str, Any] = {}
    for name, value in attrs.items():
        if type(value) is OrderedDict and all(
                type(m) is dict and all(type(x) in _ATOMS for x in m.values())
                for m in value.values()):
            out[name] = OrderedDict((k, dict(m)) for k, m in value.items())
        else:
            out[name] = copy.deepcopy(value)
    return out


def _map_tree(
    tree: Any,
    on_tensor: Callable[[tuple[Any, ...], torch.Tensor], Any],
    on_leaf: Callable[[Any], Any],
    where: str = "state",
) -> Any:
    """Rebuild ``tree``'s containers, mapping tensors and other leaves. Containers kept:
    dict, OrderedDict (with its attributes), Counter, list, tuple, namedtuple.
    ``on_leaf`` must return an immutable scalar (an _ATOMS type) unchanged."""
    active: set[int] = set()

    def walk(obj: Any, key: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            return on_tensor(key, obj)
        t = type(obj)
        is_container = t in (dict, OrderedDict, Counter, list) or (
            isinstance(obj, tuple) and t is not torch.Size and (t is tuple or hasattr(obj, "_fields")))
        if not is_container:
            return on_leaf(obj)
        if id(obj) in active:
            raise ValueError(
                f"{_fmt_path(where, _segments(key))} contains itself; a state tree must not "
                "have cycles: break the cycle or keep that object out of the checkpoint")
        if t in (list, tuple) and set(map(type, obj)) <= _ATOMS:
            # A run of plain scalars (an RNG state is 625 ints): what on_leaf makes of each
            # is the value itself (every caller's on_leaf returns an atom unchanged).
            return list(obj) if t is list else obj
        active.add(id(obj))
        try:
            if t in (dict, OrderedDict, Counter):
                out: dict[Any, Any] = t()
                for k, v in obj.items():
                    out[k] = walk(v, key + (k,))
                if t is not dict:
                    out.__dict__.update(_copy_attrs(vars(obj)))
                return out
            items = [walk(v, key + (i,)) for i, v in enumerate(obj)]
            if t is list:
                return items
            return t(*items) if t is not tuple else tuple(items)
        finally:
            active.discard(id(obj))

    return walk(tree, ())


def _segments(key: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(f"[{k!r}]" for k in key)


def tree_map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """A copy of ``tree``'s containers with ``fn`` applied to every tensor; other leaves
    are shared with the input, not copied."""
    return _map_tree(tree, lambda _key, t: fn(t), lambda x: x)


def has_dtensor(tree: Any) -> bool:
    """True when some tensor in ``tree`` is a DTensor (sharded state: FSDP2, TP)."""
    found: list[bool] = []
    _map_tree(tree, lambda _key, t: found.append(_is_dtensor(t)), lambda x: x)
    return any(found)


def tree_on_host(tree: Any) -> bool:
    """True when every tensor in ``tree`` lives in host memory (none on an accelerator)."""
    devices: set[str] = set()
    _map_tree(tree, lambda _key, t: devices.add(t.device.type), lambda x: x)
    return devices <= {"cpu"}


def tree_nbytes(tree: Any) -> int:
    """Bytes of tensor data in ``tree`` (each tensor object counted once)."""
    seen: dict[int, int] = {}

    def count(_key: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
        seen[id(t)] = t.numel() * t.element_size()
        return t

    _map_tree(tree, count, lambda x: x)
    return sum(seen.values())


# --------------------------------------------------------------------------------------
# Host snapshots


# A snapshot defers its copies to a thread only when they are at least this large: a
# smaller copy takes less than starting the thread and the step's wait for it.
MIN_DEFER_BYTES = 16 << 20


@dataclass(frozen=True)
class SnapshotOptions:
    # Page-locked buffers for CUDA sources: faster device-to-host copies that can run
    # asynchronously; costs locked host memory equal to the GPU state.
    pin_memory: bool = True


class HostSnapshot:
    """Copies state trees into host buffers that are kept and reused between calls.

    The tree returned by :meth:`snapshot` is valid until the next call, which overwrites
    the same buffers: finish writing one snapshot before taking the next.
    """

    def __init__(self, options: SnapshotOptions | None = None) -> None:
        self.options = options or SnapshotOptions()
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._copy_seconds = 0.0
        # The deferred part of the last snapshot is copied by a thread of its own; any
        # thread may wait for it (the training thread's optimizer step, the writer).
        self._copied = threading.Event()
        self._copied.set()
        self._copy_error: BaseException | None = None
        self.deferred_bytes = 0   # of the last snapshot: copied while training went on

    def wait(self, *, errors: bool = True) -> None:
        """Block until the deferred copies of the last snapshot are done (at once when
        there are none); raise what failed in them (``errors``), in every thread that
        waits."""
        self._copied.wait()
        if errors and self._copy_error is not None:
            raise self._copy_error

    @property
    def copying(self) -> bool:
        return not self._copied.is_set()

    @property
    def nbytes(self) -> int:
        """Bytes held in host buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def copy_seconds(self) -> float:
        """Wall time of the last :meth:`snapshot`, device synchronisation included."""
        return self._copy_seconds

    def clear(self) -> None:
        """Drop all buffers (the next snapshot allocates afresh)."""
        self._buffers = {}

    def snapshot(self, tree: Any, *, where: str = "state",
                 defer: frozenset[int] = frozenset()) -> Any:
        """A structurally identical tree whose tensors are plain CPU copies in buffers owned
        here (Parameters come back as plain tensors); other leaves are deep-copied.

        ``defer``: storage addresses (``data_ptr()``) of host tensors that nothing writes
        until :meth:`wait` is called (parameters and optimizer state, which only an
        optimizer step writes: the manager waits in a step pre-hook). They are copied by a
        thread while training goes on (CheckFreq's pipelined snapshot): the call returns
        after copying the rest. The tree is complete once :meth:`wait` returns."""
        self._copied.wait()   # the previous snapshot's buffers are about to be reused
        self._copy_error = None
        t0 = time.perf_counter()
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        new_buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        # The same tensor object at two paths (tied weights) gets one copy, as torch.save would.
        memo: dict[int, torch.Tensor] = {}
        cuda_devices: set[torch.device] = set()

        def on_tensor(key: tuple[Any, ...], src: torch.Tensor) -> torch.Tensor:
            done = memo.get(id(src))
            if done is not None:
                return done
            _check_snapshottable(src, key, where)
            pin = src.is_cuda and self.options.pin_memory and torch.cuda.is_available()
            buf = self._buffers.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or (
                    pin and not buf.is_pinned()):
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            # copy_ materialises views, strides and conj/neg bits: the buffer never aliases
            # the live tensor.
            if not pin and src.device.type == "cpu" and src.data_ptr() in defer:
                later.append((buf, src))
            else:
                buf.copy_(src, non_blocking=pin)
            if pin:
                cuda_devices.add(src.device)
            if buf.__dict__ or src.__dict__:
                buf.__dict__.clear()
                buf.__dict__.update(copy.deepcopy(vars(src)))
            new_buffers[key] = buf
            memo[id(src)] = buf
            return buf

        with torch.no_grad():  # once, not per tensor: it costs microseconds each time
            out = _map_tree(tree, on_tensor, _copy_leaf, where)
        for device in cuda_devices:
            torch.cuda.synchronize(device)  # non_blocking copies must land before use
        # Paths gone from this tree release their buffers.
        self._buffers = new_buffers
        self.deferred_bytes = sum(b.numel() * b.element_size() for b, _ in later)
        if self.deferred_bytes < MIN_DEFER_BYTES:   # a thread costs more than it saves
            with torch.no_grad():
                for buf, src in later:
                    buf.copy_(src)
            later, self.deferred_bytes = [], 0
        if later:
            self._copied.clear()
            threading.Thread(target=self._copy_later, args=(later,), name="rt-snapshot-copy",
                             daemon=True).start()
        self._copy_seconds = time.perf_counter() - t0
        return out

    def _copy_later(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            with torch.no_grad():   # copy_ releases the GIL: the training thread runs on
                for buf, src in pairs:
                    buf.copy_(src)
        except BaseException as exc:  # noqa: BLE001 - raised by wait(), in the caller
            self._copy_error = exc
        finally:
            self._copied.set()


def _check_snapshottable(t: torch.Tensor, key: tuple[Any, ...], where: str) -> None:
    if type(t) in _TENSOR_TYPES and t.layout == torch.strided and not (
            t.is_meta or t.is_nested or t.is_quantized):
        return
    path = _fmt_path(where, _segments(key))
    if type(t) not in _TENSOR_TYPES:
        raise TypeError(f"{path} is a {_tensor_subclass_problem(t)}; HostSnapshot copies "
                        "plain tensors only")
    if t.is_meta:
        raise TypeError(
            f"{path} is a meta tensor (shape {tuple(t.shape)}), which has no data to save; "
            "materialise the module (to_empty() + init, or load weights) before checkpointing")
    if t.layout != torch.strided or t.is_nested or t.is_quantized:
        kind = "nested" if t.is_nested else "quantized" if t.is_quantized else str(t.layout)
        raise TypeError(
            f"{path} is a {kind} tensor; HostSnapshot copies dense strided tensors only: "
            "convert it (e.g. x.to_dense() or x.dequantize()) or keep it out of the checkpoint")


# --------------------------------------------------------------------------------------
# Stateful objects


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


class FollowsSteps:
    """A tracked object whose state follows the training steps by itself, and so is no
    model and needs no copy before a step: a data loader's position
    (data.ResumableLoader). A base class here so that the checkpoint code can tell one
    without importing the loader."""


def has_state_dict(obj: Any) -> bool:
    """Whether ``obj`` holds state of its own to save (an instance with ``state_dict``)."""
    return not isinstance(obj, type) and callable(getattr(obj, "state_dict", None))


def collect(tracked: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: obj.state_dict()}`` for stateful objects, the value itself otherwise.

    The result aliases live tensors (a module's state_dict is a view of its parameters):
    snapshot it with :class:`HostSnapshot` before training continues.
    """
    out: dict[str, Any] = {}
    for name, obj in tracked.items():
        if type(name) is not str:
            raise TypeError(f"tracked names must be str, found {_short_repr(name)} of type "
                            f"{_type_name(name)}; track objects under string names")
        out[name] = obj.state_dict() if has_state_dict(obj) else obj
    return out


def restore(tracked: Mapping[str, Any], state: Mapping[str, Any], *,
            strict: bool = True) -> dict[str, Any]:
    """Load ``state`` (from :func:`collect`) back into the tracked objects.

    Everything is checked before anything is loaded, so a mismatch leaves the objects
    untouched. Plain values cannot be restored in place: they are returned as
    ``{name: value}``. With ``strict=False`` names on one side only and missing /
    unexpected module keys are logged and skipped; shape mismatches still raise.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"restore expected a mapping of name -> state (what collect() "
                        f"returned), found {_type_name(state)}")
    sections: list[list[str]] = []
    missing = [n for n in tracked if n not in state]
    unexpected = [str(n) for n in state if n not in tracked]
    if missing or unexpected:
        lines = []
        if missing:
            lines.append(f"  tracked but not in the checkpoint, {len(missing)}:")
            lines += _listing(sorted(missing), "    ")
        if unexpected:
            lines.append(f"  in the checkpoint but not tracked, {len(unexpected)}:")
            lines += _listing(sorted(unexpected), "    ")
        if strict:
            lines.append("  fix: track the same names as the run that wrote the checkpoint, "
                         "or pass strict=False to skip them")
            sections.append(lines)
        else:
            logger.warning("restore (strict=False) skips names on one side only:\n%s",
                           "\n".join(lines))

    names = [n for n in tracked if n in state]
    state = {n: _rekeyed(n, tracked[n], state[n]) if isinstance(tracked[n], torch.nn.Module)
             and isinstance(state[n], Mapping) else state[n] for n in names}
    for name in names:
        obj, sd = tracked[name], state[name]
        if isinstance(obj, torch.nn.Module):
            section = _module_problems(name, obj, sd, strict)
        elif isinstance(obj, torch.optim.Optimizer):
            section = _optimizer_problems(name, obj, sd)
        else:
            section = None
        if section:
            sections.append(section)
    if sections:
        raise StateMismatchError("\n".join(
            ["checkpoint does not match the tracked objects:"] + [ln for s in sections for ln in s]))

    plain: dict[str, Any] = {}
    for name in names:
        obj, sd = tracked[name], state[name]
        if isinstance(obj, torch.nn.Module):
            obj.load_state_dict(sd, strict=strict)
        elif has_state_dict(obj) and callable(getattr(obj, "load_state_dict", None)):
            obj.load_state_dict(sd)
        else:
            plain[name] = sd
    return plain


def clear_step_leftovers(tracked: Mapping[str, Any]) -> None:
    """Leave the tracked objects as a new process has them at a step boundary: no
    gradients, and no GradScaler step half done. A restore puts back a boundary's state,
    which holds neither, and a step that failed halfway (its all-reduce, or the ring
    exchange before ``opt.step()``, cut by a lost peer) leaves both where the next life
    trains the same objects on (built outside the training function): its gradients would
    be added to the next step's where the loop zeroes them after ``opt.step()``, and the
    scaler, whose ``unscale_`` had run, would refuse the next one ("unscale_() has already
    been called on this optimizer since the last update()")."""
    for obj in tracked.values():
        if isinstance(obj, torch.amp.GradScaler):
            _forget_scaler_step(obj)
        elif isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
            obj.zero_grad(set_to_none=True)


def _forget_scaler_step(scaler: Any) -> None:
    # What GradScaler.update() does at its end: a fresh stage per optimizer (torch keeps
    # no public way to drop a step begun; a torch without these names keeps its own).
    from torch.amp import grad_scaler

    fresh = getattr(grad_scaler, "_refresh_per_optimizer_state", None)
    if fresh is not None and hasattr(scaler, "_per_optimizer_states"):
        scaler._per_optimizer_states = defaultdict(fresh)


# Lazy modules' placeholders have no shape to compare yet.
_UNINITIALIZED = (torch.nn.parameter.UninitializedParameter, torch.nn.parameter.UninitializedBuffer)


def _module_problems(name: str, module: torch.nn.Module, sd: Any, strict: bool) -> list[str]:
    head = f"  {name!r} (torch.nn.Module {type(module).__name__}):"
    if not isinstance(sd, Mapping):
        return [head, f"    expected a state_dict mapping, found {_type_name(sd)}"]
    expected = module.state_dict()
    missing = [k for k in expected if k not in sd]
    unexpected = [str(k) for k in sd if k not in expected]
    shapes = []
    for k, want in expected.items():
        got = sd.get(k)
        if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) \
                and not isinstance(want, _UNINITIALIZED) \
                and got.shape != want.shape:
            shapes.append(f"{k}: checkpoint {tuple(got.shape)} vs model {tuple(want.shape)}")
    if not strict and (missing or unexpected):
        logger.warning("restoring %r with strict=False: %d missing key(s) %s, %d unexpected "
                       "key(s) %s", name, len(missing), missing[:MAX_LISTED], len(unexpected),
                       unexpected[:MAX_LISTED])
        missing, unexpected = [], []
    if not (missing or unexpected or shapes):
        return []
    lines = [head]
    if missing:
        lines.append(f"    missing keys (in the model, not in the checkpoint), {len(missing)}:")
        lines += _listing(missing, "      ")
    if unexpected:
        lines.append(
            f"    unexpected keys (in the checkpoint, not in the model), {len(unexpected)}:")
        lines += _listing(unexpected, "      ")
    if shapes:
        lines.append(f"    shape mismatches, {len(shapes)}:")
        lines += _listing(shapes, "      ")
    lines.append("    fix: is this the same model config as the run that wrote the "
                 "checkpoint?")
    return lines


# What a model wrapper puts in front of every key of the module it wraps.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")   # DDP and DataParallel; torch.compile


def unwrap_model(obj: Any) -> Any:
    """The module under ``obj``'s wrappers (torch.compile's ``OptimizedModule``, DDP,
    DataParallel), which holds the same parameters under keys without the wrappers'
    prefixes; anything else as it is. Tracking it makes a checkpoint load the same into a
    compiled or plain, wrapped or bare model."""
    while isinstance(obj, torch.nn.Module):
        if isinstance(obj, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            obj = obj.module
        elif type(obj).__name__ == "OptimizedModule" and isinstance(
                getattr(obj, "_orig_mod", None), torch.nn.Module):
            obj = obj._orig_mod   # by name: importing torch._dynamo costs a second
        else:
            break
    return obj


def refuse_rank_local_state(name: str, obj: Any) -> None:
    """Raise TypeError, naming the fix, for an object whose state the primary cannot save
    for every rank: a ``torch.Generator`` is each rank's own stream; FSDP1 and
    ``ZeroRedundancyOptimizer`` keep part of it on each rank, and their ``state_dict()`` is
    a collective that the primary, saving alone, would wait in forever (FSDP1) or that
    raises (ZeRO, unconsolidated). Those two by class name: importing their modules costs
    seconds."""
    if isinstance(obj, torch.nn.Module) and any(
            type(m).__name__ == "FullyShardedDataParallel" for m in obj.modules()):
        raise TypeError(
            f"ctx.track({name}=...) got a model wrapped in FullyShardedDataParallel (FSDP1): "
            "its state_dict() is a collective every rank must call together and its shards "
            "are ShardedTensors, which these checkpoints cannot save (the first save would "
            "hang). Shard it with FSDP2 instead, torch.distributed.fsdp.fully_shard(model), "
            "whose state is saved sharded and rebuilt from peers "
            '(docs/checkpointing.md, "How a save works")')
    kind = type(obj).__name__
    if isinstance(obj, torch.Generator):
        _refuse_generator(name, "a torch.Generator", "in ctx.values, which is saved per rank: "
                          + _kept(name, f"{name}.get_state()", f"{name}.set_state(VALUE)")
                          + " (the global RNGs are saved per rank already)")
    if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
        _refuse_generator(name, "a random.Random", "per rank: " + _kept(
            name, f"{name}.getstate()", f"{name}.setstate(VALUE)"))
    if type(obj).__module__.startswith("numpy.random") and kind in ("Generator",
                                                                     "RandomState"):
        _refuse_generator(name, f"a NumPy {kind}", "per rank: " + (
            _kept(name, f"{name}.bit_generator.state", f"{name}.bit_generator.state = VALUE")
            if kind == "Generator" else
            "draw from np.random's global functions (saved per rank already) or from "
            "np.random.default_rng(), whose state can be kept in ctx.values"))
    if kind == "ZeroRedundancyOptimizer":
        raise TypeError(
            f"ctx.track({name}=...) got a ZeroRedundancyOptimizer: each rank holds only its "
            "part of the optimizer state, and state_dict() raises unless every rank first "
            "calls consolidate_state_dict(), so no rank can save it alone. Use a plain "
            "optimizer under DDP, or shard the optimizer state with FSDP2 "
            "(fully_shard(model, reshard_after_forward=False) shards it as ZeRO-2 does), "
            "whose state is saved sharded")


def _refuse_generator(name: str, what: str, keep: str) -> None:
    raise TypeError(
        f"ctx.track({name}=...) got {what}: tracked objects are saved once, by the primary, "
        f"for every rank, and a generator's stream is usually each rank's own. Keep its "
        f"state {keep}")


def _kept(name: str, get: str, put: str) -> str:
    """The recipe for keeping a generator's state in ``ctx.values``: ``put`` sets VALUE."""
    value = f"ctx.values[{name!r}]"
    return (f"{value} = {get} before opt.step(), and {put.replace('VALUE', value)} after "
            "ctx.restore() when ctx.restored_step is set")


def refuse_stateless(name: str, obj: Any) -> None:
    """At ``track``, not at the first save (perhaps hours later): an object with no
    ``state_dict`` is saved as a value, so it must be one that loads as weights only. A
    ``DataLoader`` is the usual case, tracked to resume its position, which it cannot."""
    if has_state_dict(obj):
        return
    if isinstance(obj, torch.utils.data.DataLoader):
        raise TypeError(
            f"ctx.track({name}=...) got a torch DataLoader, which has no state_dict: its "
            "position cannot be saved, and the first save would fail. Build it as "
            "rt.ResumableLoader(dataset, batch_size=..., shuffle=..., num_workers=...) with "
            "the DataLoader's arguments: its position (epoch, samples consumed) is saved and "
            "restored mid-epoch, and each sample's randomness with it")
    if not has_dtensor(obj):   # sharded state is saved by DCP (commit/sharded.py), not pickled
        check_weights_only(obj, where=f"ctx.track({name}=...)")


def _rekeyed(name: str, module: torch.nn.Module, sd: Mapping[str, Any]) -> Mapping[str, Any]:
    """``sd`` under ``module``'s keys where the two differ only by a wrapper's prefix (a
    checkpoint of a DDP-wrapped or compiled model, restored into the bare one, or the other
    way round); ``sd`` itself otherwise, for the checks to report."""
    ours, theirs = set(module.state_dict()), {str(k) for k in sd}
    if ours == theirs or not ours:
        return sd
    for prefix in _WRAPPER_PREFIXES:
        if {prefix + k for k in ours} == theirs:
            how = "carry"
        elif {prefix + k for k in theirs} == ours:
            how = "lack"
        else:
            continue

        def rename(key: str, p: str = prefix, strip: bool = how == "carry") -> str:
            return key[len(p):] if strip else p + key

        logger.info("restoring %r: the checkpoint's keys %s the %r prefix of a model wrapper "
                    "(DDP, torch.compile) that the model's %s; the keys matched without it",
                    name, how, prefix, "lack" if how == "carry" else "carry")
        out: OrderedDict[str, Any] = OrderedDict((rename(str(k)), v) for k, v in sd.items())
        meta = getattr(sd, "_metadata", None)
        if isinstance(meta, Mapping):   # per-submodule versions, keyed by module path
            # "module.0" <-> "0", "module" <-> "" (the wrapper's own entry goes).
            out._metadata = OrderedDict(  # type: ignore[attr-defined]
                (rename(f"{k}.").rstrip("."), v) for k, v in meta.items()
                if how == "lack" or f"{k}.".startswith(prefix))
        return out
    return sd


def _optimizer_problems(name: str, opt: torch.optim.Optimizer, sd: Any) -> list[str]:
    head = f"  {name!r} (torch.optim.{type(opt).__name__}):"
    if not isinstance(sd, Mapping) or "param_groups" not in sd or "state" not in sd:
        found = sorted(map(str, sd)) if isinstance(sd, Mapping) else _type_name(sd)
        return [head, ("    expected an Optimizer.state_dict() with 'state' and "
                       f"'param_groups', found {found}")]
    ck_groups, groups = list(sd["param_groups"]), opt.param_groups
    fix = ("    fix: was the optimizer built over the same parameters (model config, param "
           "groups, frozen layers) as in the run that wrote the checkpoint?")
    if len(ck_groups) != len(groups):
        return [head, f"    param groups: checkpoint {len(ck_groups)} vs optimizer {len(groups)}",
                fix]
    diffs = [
        f"param group {i}: checkpoint {len(c['params'])} params vs optimizer "
        f"{len(g['params'])} params"
        for i, (c, g) in enumerate(zip(ck_groups, groups))
        if len(c["params"]) != len(g["params"])
    ]
    if diffs:
        return [head, f"    param count mismatches, {len(diffs)}:", *_listing(diffs, "      "),
                fix]
    lines = _optimizer_kind_problems(ck_groups, groups) + _optimizer_shape_problems(
        ck_groups, groups, sd["state"])
    return [head, *lines, fix] if lines else []


def _optimizer_kind_problems(ck_groups: list[Any], groups: list[dict[str, Any]]) -> list[str]:
    """Hyperparameter names that differ both ways: another optimizer class wrote it (SGD's
    momentum against Adam's betas). One-way differences are torch versions adding options,
    which load_state_dict fills with defaults."""
    for i, (c, g) in enumerate(zip(ck_groups, groups)):
        ours, theirs = set(g) - {"params"}, set(c) - {"params"}
        if ours - theirs and theirs - ours:
            return [f"    param group {i} has other hyperparameters: the checkpoint's "
                    f"{', '.join(sorted(theirs - ours))}; this optimizer's "
                    f"{', '.join(sorted(ours - theirs))} (written by another optimizer class?)"]
    return []


def _optimizer_shape_problems(ck_groups: list[Any], groups: list[dict[str, Any]],
                              ck_state: Any) -> list[str]:
    """Per-parameter state (exp_avg, momentum_buffer ...) whose shape is not its parameter's:
    the same number of parameters, but of another model."""
    if not isinstance(ck_state, Mapping):
        return []
    shapes = []
    for c, g in zip(ck_groups, groups):
        for index, param in zip(c["params"], g["params"]):
            for key, value in (ck_state.get(index) or {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 \
                        and value.shape != param.shape:
                    shapes.append(f"param {index} {key}: checkpoint {tuple(value.shape)} vs "
                                  f"parameter {tuple(param.shape)}")
    if not shapes:
        return []
    return [f"    state shape mismatches, {len(shapes)}:", *_listing(shapes, "      ")]
