"""The "sharded" checkpoint layout: FSDP2 / DTensor state through torch.distributed.checkpoint.

When a tracked object's state holds DTensors (``fully_shard``), no rank has the whole
model, so the replicated layout (the primary writes ``shared.pt``) cannot work. Such a step
looks like this::

    step-000000001200/
        dcp/.metadata           DCP's global metadata (rank 0 writes it)
        dcp/__0_0.distcp        rank 0's shards (DCP names files __<rank>_<n>.distcp)
        dcp/__1_0.distcp        rank 1's shards
        shared.pt               tracked objects outside DCP (schedulers, plain values); primary
        rank-00000.pt           RNG states and user values, as in the replicated layout
        manifest.json           every file above with size and crc32c; layout "sharded"
        COMMITTED               last

Modules and optimizers always go through DCP in this layout (model state via
``get_model_state_dict``, optimizer state via ``get_optimizer_state_dict``, both keyed by
parameter names, which is what lets DCP reshard: save with 2 ranks, load with 1). Any other
tracked object goes through DCP only if its state holds a DTensor.

Saving (torch 2.13):
    * the training thread only *stages*: ``DefaultStager`` copies every tensor into host
      buffers it keeps between saves (keyed by the source storage), so later saves copy into
      already-touched memory; the staged tree keeps the DTensor layout (a DTensor whose local
      tensor is the host copy);
    * the writer thread runs ``dcp.save`` over the staged tree on the coordinator's *writer*
      gloo group (the group that thread already owns for the commit), then every rank checksums
      the files it wrote (its ``__<rank>_*.distcp``; rank 0 also ``.metadata``) and those
      entries join the gathered manifest, so the marker-last commit and the integrity checks
      work unchanged. On local disk DCP writes inside the manager's temporary step directory,
      so the directory rename still commits everything at once; on object stores it writes in
      place under the step's token directory, before the marker.
    * measured here, 2 ranks x 50 MB (FSDP2 MLP + AdamW, ~100 MB in all), CPU + gloo, time the
      training thread is blocked: this staging 16-25 ms (40-50 ms with the 2 cores busy
      elsewhere); ``dcp.async_save`` 36-100 ms (85-195 ms), because its default stager
      allocates fresh buffers on every call and it starts a thread per save next to ours;
      ``dcp.save`` 0.31-0.33 s (0.30-0.44 s). Hence: a kept stager + ``dcp.save`` in the writer.

Loading:
    * every rank deep-verifies (size + crc32c against the manifest) ``.metadata`` and the
      ``.distcp`` files of the saved ranks assigned to it (saved rank ``s`` -> loading rank
      ``s % world_size``: its own files when the world size did not change); the manager's
      allreduce makes all ranks agree, so every file is checked by someone before anyone loads;
    * ``.metadata`` is a pickle, and DCP's reader unpickles it with ``pickle.load``; we parse
      the verified bytes ourselves with an allowlisting unpickler and hand that to DCP, and
      non-tensor items (DCP's ``torch.load(weights_only=False)``) must pass a weights-only load
      first: a checkpoint must not be able to run code (docs/design.md, "Loading runs no
      code");
    * ``dcp.load`` fills the state dicts of the live objects in place (collective on the
      coordinator's main group, the training thread's), then ``set_model_state_dict`` /
      ``set_optimizer_state_dict`` apply them.
"""

from __future__ import annotations

import functools
import io
import logging
import pickle
import re
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..schedule.coordination import Coordinator
from ..state.capture import collect, restore, weights_only_refusal
from ..storage.base import Storage
from .manifest import (
    CheckpointError,
    CorruptCheckpointError,
    Crc32c,
    FileEntry,
    Manifest,
    check_entry,
    read_verified,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.metadata import Metadata

log = logging.getLogger(__name__)

SHARDED_LAYOUT = "sharded"
DCP_DIR = "dcp"
DCP_METADATA = ".metadata"
_DISTCP = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_CHUNK = 8 << 20


# --- when the sharded layout applies -----------------------------------------------------

def _is_dtensor(obj: Any) -> bool:
    # By name, like state/capture.py: importing torch.distributed.tensor costs seconds. Plain
    # tensors and parameters first: every save asks this of every parameter.
    t = type(obj)
    if t is torch.Tensor or t is torch.nn.Parameter:
        return False
    return isinstance(obj, torch.Tensor) and any(c.__name__ == "DTensor" for c in t.__mro__)


def _tree_has_dtensor(tree: Any) -> bool:
    stack, seen = [tree], set()
    while stack:
        obj = stack.pop()
        if _is_dtensor(obj):
            return True
        if id(obj) in seen:  # shared or cyclic containers
            continue
        seen.add(id(obj))
        if isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return False


def uses_sharded_layout(tracked: Mapping[str, Any]) -> bool:
    """True when any tracked object's state holds a DTensor (FSDP2, tensor parallel).

    Modules and optimizers are checked through their parameters, without calling
    ``state_dict()``; other objects through their state dict."""
    for name, obj in tracked.items():
        if isinstance(obj, torch.nn.Module):
            if any(_is_dtensor(t) for t in obj.parameters()) or \
                    any(_is_dtensor(t) for t in obj.buffers()):
                return True
        elif isinstance(obj, torch.optim.Optimizer):
            if any(_is_dtensor(p) for g in obj.param_groups for p in g["params"]):
                return True
        elif _tree_has_dtensor(collect({name: obj})[name]):
            return True
    return False


def owner_module(name: str, opt: torch.optim.Optimizer,
                 tracked: Mapping[str, Any]) -> torch.nn.Module:
    """The tracked module whose parameters the optimizer updates: DCP keys optimizer state
    by that module's parameter names (the key to resharding)."""
    wanted = {id(p) for g in opt.param_groups for p in g["params"]}
    for obj in tracked.values():
        if isinstance(obj, torch.nn.Module) and wanted <= {id(p) for p in obj.parameters()}:
            return obj
    modules = [n for n, o in tracked.items() if isinstance(o, torch.nn.Module)]
    raise CheckpointError(
        f"optimizer {name!r}: no tracked module holds all of its {len(wanted)} parameters "
        f"(tracked modules: {modules or 'none'}). Sharded checkpoints store optimizer state "
        "by parameter name: track the model the optimizer was built over, e.g. "
        "track(model=model, optimizer=opt)")


# --- process groups ------------------------------------------------------------------------

def _group(coord: Coordinator, which: str) -> ProcessGroup | None:
    """The coordinator's gloo group for one thread: 'writer' (commit) or 'main' (training).

    DCP runs collectives; on the default group they could interleave with the training
    thread's own collectives (FSDP's all-gathers), so a multi-rank job must provide one."""
    if coord.world_size == 1:
        return None
    group = getattr(coord, f"{which}_group", None)
    if group is None:
        raise CheckpointError(
            f"sharded checkpoints with {coord.world_size} ranks need a coordinator with its own "
            f"{which} process group (TorchDistributed); {type(coord).__name__} has none")
    return group


def _dist_kwargs(coord: Coordinator, which: str) -> dict[str, Any]:
    import torch.distributed as dist

    if coord.world_size == 1:
        # One process: DCP needs no group (and must not use a default group of a larger job).
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise CheckpointError(
                f"the checkpoint coordinator has 1 rank but torch.distributed has "
                f"{dist.get_world_size()}: pass coordinator=TorchDistributed() (or none) so all "
                "ranks write one sharded checkpoint together")
        return {"no_dist": True}
    return {"process_group": _group(coord, which)}


# --- safe loading ---------------------------------------------------------------------------

_SAFE_GLOBALS = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's Metadata (dataclasses, torch.Size, dtypes, paths) and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _METADATA_MODULE:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:  # its own classes only
                return obj
        raise pickle.UnpicklingError(
            f"refusing {module}.{name}: DCP metadata holds only checkpoint metadata classes")


def parse_metadata(data: bytes, where: str) -> Metadata:
    """DCP's ``.metadata`` from bytes, without letting the pickle run code."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: unreadable DCP metadata ({exc})") from exc
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{where}: not DCP metadata (found {type(md).__name__})")
    return md


@dataclass(frozen=True)
class _DcpClasses:
    local_reader: Any
    remote_reader: Any
    remote_writer: Any
    load_planner: Any


@functools.cache
def _dcp_classes() -> _DcpClasses:
    """Reader, writer and planner subclasses, built on first use (DCP takes seconds to import)."""
    from torch.distributed.checkpoint import (
        DefaultLoadPlanner,
        FileSystemReader,
        FileSystemWriter,
    )
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.metadata import StorageMeta

    def on_filesystem(fs: Any) -> Any:
        # Storage's filesystem object, not one FsspecWriter/Reader would build from the URL
        # alone: ours carries the credentials / emulator setup (storage_options).
        wrapper = FsspecFileSystem()
        wrapper.fs = fs
        return wrapper

    class VerifiedMetadata:
        """Hands DCP the metadata we already verified and parsed, instead of unpickling the
        file again (DCP would use plain pickle.load, and the file could change meanwhile)."""

        rt_metadata: Any
        load_id: str

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            md = self.rt_metadata
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    class LocalReader(VerifiedMetadata, FileSystemReader):  # type: ignore[misc]
        def __init__(self, path: str, metadata: Any) -> None:
            super().__init__(path)
            self.rt_metadata = metadata

    class RemoteReader(VerifiedMetadata, FsspecReader):  # type: ignore[misc]
        def __init__(self, path: str, metadata: Any, fs: Any) -> None:
            FileSystemReader.__init__(self, path)  # not FsspecReader's: no filesystem from a URL
            self.fs = on_filesystem(fs)
            self.path = path
            self.rt_metadata = metadata

    class RemoteWriter(FsspecWriter):  # type: ignore[misc]
        def __init__(self, path: str, fs: Any, **kwargs: Any) -> None:
            FileSystemWriter.__init__(self, path, **kwargs)  # see RemoteReader
            self.fs = on_filesystem(fs)
            self.path = path

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):  # type: ignore[misc]
        """DCP loads non-tensor items with torch.load(weights_only=False); refuse any that a
        weights-only load would reject, so the full load cannot run code either."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except Exception as exc:
                raise CorruptCheckpointError(
                    f"DCP item {read_item.dest_index.fqn!r} is refused by "
                    f"torch.load(weights_only=True) ({weights_only_refusal(exc)})") from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return _DcpClasses(LocalReader, RemoteReader, RemoteWriter, WeightsOnlyLoadPlanner)


# --- the layout ----------------------------------------------------------------------------

@dataclass
class StagedSharded:
    """What a sharded save carries from the training thread to the writer."""

    dcp_state: dict[str, Any]    # host copies (DTensors keep their layout) for dcp.save
    replicated: dict[str, Any]   # tracked objects outside DCP, live: snapshot before writing
    stage_s: float = 0.0


@dataclass(frozen=True)
class _Verified:
    name: str
    metadata: Any


class ShardedCheckpointer:
    """DCP reads and writes for :class:`~.manager.CheckpointManager`'s sharded layout."""

    def __init__(self, coord: Coordinator, *, thread_count: int = 1) -> None:
        self.coord = coord
        self.thread_count = thread_count
        self._stager: Any = None
        self._verified: dict[int, _Verified] = {}
        self.last_write_s = 0.0

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # -- saving (stage: training thread; write: writer thread)

    def stage(self, tracked: Mapping[str, Any]) -> StagedSharded | None:
        """None when nothing tracked holds a DTensor (the replicated layout applies); else a
        host copy of the DCP part, safe to write while training continues."""
        if not uses_sharded_layout(tracked):
            return None
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        t0 = time.perf_counter()
        live: dict[str, Any] = {}
        replicated: dict[str, Any] = {}
        for name, obj in tracked.items():
            if isinstance(obj, torch.nn.Module):
                live[name] = get_model_state_dict(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                # NB: DCP initialises an optimizer without state with a zero-lr step.
                live[name] = get_optimizer_state_dict(owner_module(name, obj, tracked), obj)
            else:
                # Other objects (a scheduler, a plain dict of tensors): through DCP only if
                # their state holds a DTensor, else in shared.pt as in the replicated layout.
                state = collect({name: obj})[name]
                if _tree_has_dtensor(state):
                    live[name] = state
                else:
                    replicated[name] = state
        staged = self._get_stager().stage(live)
        return StagedSharded(staged, replicated, time.perf_counter() - t0)

    def _get_stager(self) -> Any:
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            accel = torch.accelerator.is_available()
            # Synchronous staging into kept buffers: after it returns, training may change
            # the live tensors. Pinned memory and non-blocking copies only with a GPU.
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=accel, use_shared_memory=False, use_async_staging=False,
                use_non_blocking_copy=accel))
        return self._stager

    def write(self, storage: Storage, work: str, staged: StagedSharded) -> dict[str, FileEntry]:
        """``dcp.save`` into ``<work>/dcp`` (collective on the writer group), then the size and
        crc32c of the files this rank wrote, keyed by their path in the step directory."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        rel = f"{work}/{DCP_DIR}"
        t0 = time.perf_counter()
        kwargs = _dist_kwargs(self.coord, "writer")
        dcp.save(staged.dcp_state, storage_writer=self._writer(storage, rel), **kwargs)
        group = kwargs.get("process_group")
        # DCP names files by the rank in its group, and its coordinator (rank 0) writes .metadata.
        grank = dist.get_rank(group) if group is not None else 0
        mine = [f for f in storage.listdir(rel)
                if (m := _DISTCP.match(f)) is not None and int(m.group(1)) == grank]
        if grank == 0:
            mine.append(DCP_METADATA)
        # A rank may own no file (all its items were replicated and deduplicated away): then
        # it contributes nothing, and the metadata check on load still sees every reference.
        entries = {f"{DCP_DIR}/{f}": _checksum(storage, f"{rel}/{f}") for f in mine}
        storage.fsync_dir(rel)  # the new names survive a power loss (local disk)
        self.last_write_s = time.perf_counter() - t0
        log.debug("dcp.save to %s: %.2fs, %d file(s) of rank %d", storage.url_of(rel),
                  self.last_write_s, len(mine), grank)
        return entries

    def _writer(self, storage: Storage, rel: str) -> Any:
        options: dict[str, Any] = {"sync_files": True, "thread_count": self.thread_count}
        if storage.capabilities.posix_paths:  # local disk or a FUSE mount
            from torch.distributed.checkpoint import FileSystemWriter

            return FileSystemWriter(storage.url_of(rel), **options)
        return _dcp_classes().remote_writer(storage.url_of(rel), _filesystem(storage),
                                            **options)

    # -- loading (training thread)

    def verify(self, storage: Storage, name: str, manifest: Manifest) -> None:
        """Deep-check ``.metadata`` and the ``.distcp`` files assigned to this rank; raise
        :class:`CorruptCheckpointError` on any problem. Remembers the parsed metadata for
        :meth:`load` of the same step."""
        where = storage.url_of(f"{name}/{DCP_DIR}")
        meta_rel = f"{DCP_DIR}/{DCP_METADATA}"
        if meta_rel not in manifest.files:
            raise CorruptCheckpointError(f"{where}: the manifest lists no {DCP_METADATA}")
        md = parse_metadata(read_verified(storage, name, meta_rel, manifest), where)
        referenced = {f"{DCP_DIR}/{si.relative_path}"
                      for si in (md.storage_data or {}).values()}
        unlisted = sorted(referenced - set(manifest.files))
        if unlisted:
            raise CorruptCheckpointError(
                f"{where}: the DCP metadata references files the manifest does not list: "
                + ", ".join(unlisted[:10]))
        for fname in sorted(manifest.files):
            m = _DISTCP.match(fname.removeprefix(f"{DCP_DIR}/"))
            if fname.startswith(f"{DCP_DIR}/") and m is not None \
                    and int(m.group(1)) % self.coord.world_size == self.coord.rank:
                _checksum_against(storage, name, fname, manifest)
        self._verified = {manifest.step: _Verified(name, md)}

    def load(self, storage: Storage, manifest: Manifest, tracked: Mapping[str, Any],
             shared: Mapping[str, Any], *, strict: bool = True) -> None:
        """Load a verified sharded step into the tracked objects (collective: every rank)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        verified = self._verified.get(manifest.step)
        if verified is None:
            raise CheckpointError(f"step {manifest.step} was not verified before loading")
        in_dcp = _dcp_names(verified.metadata)
        names = [n for n in tracked if n in in_dcp]
        untracked = sorted(in_dcp - set(tracked))
        if untracked:  # checked before anything is loaded
            msg = (f"step {manifest.step}: sharded state in the checkpoint is not tracked: "
                   f"{untracked}; track the same names as the run that wrote it")
            if strict:
                raise CheckpointError(msg + ", or pass strict=False to skip them")
            log.warning("%s (skipped, strict=False)", msg)
        # The rest as in the replicated layout; restore() checks the names on both sides.
        restore({n: o for n, o in tracked.items() if n not in in_dcp}, shared, strict=strict)

        options = StateDictOptions(strict=strict)
        target: dict[str, Any] = {}
        for n in names:
            obj = tracked[n]
            if isinstance(obj, torch.nn.Module):
                target[n] = get_model_state_dict(obj, options=options)
            elif isinstance(obj, torch.optim.Optimizer):
                # Initialises missing optimizer state, so DCP has tensors to load into.
                target[n] = get_optimizer_state_dict(owner_module(n, obj, tracked), obj)
            else:  # a stateful object, or a plain tree that dcp.load fills in place
                target[n] = collect({n: obj})[n]
        classes = _dcp_classes()
        path = storage.url_of(f"{verified.name}/{DCP_DIR}")
        reader = classes.local_reader(path, verified.metadata) \
            if storage.capabilities.posix_paths \
            else classes.remote_reader(path, verified.metadata, _filesystem(storage))
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            # We chose no_dist on purpose for one process; DCP warns about it anyway. (Safe
            # here: a restore runs with no save in flight, so no other thread is warning.)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                    category=UserWarning)
            dcp.load(target, storage_reader=reader,
                     planner=classes.load_planner(allow_partial_load=not strict),
                     **_dist_kwargs(self.coord, "main"))
        for n in names:
            obj = tracked[n]
            if isinstance(obj, torch.nn.Module):
                set_model_state_dict(obj, target[n], options=options)
            elif isinstance(obj, torch.optim.Optimizer):
                set_optimizer_state_dict(owner_module(n, obj, tracked), obj, target[n], options=options)
            elif callable(getattr(obj, "load_state_dict", None)):
                obj.load_state_dict(target[n])
        self._verified.clear()
        log.info("loaded sharded step %d (%s) in %.2fs", manifest.step, ", ".join(names),
                 time.perf_counter() - t0)


def _dcp_names(md: Any) -> set[str]:
    """Top-level names in a DCP checkpoint (the tracked names it was saved under)."""
    planner_data = md.planner_data if isinstance(md.planner_data, Mapping) else {}
    names = {str(path[0]) for path in planner_data.values() if path}
    if not names:  # saved without flattening: keys are the names themselves
        names = {k.split(".", 1)[0] for k in md.state_dict_metadata}
    return names


def _filesystem(storage: Storage) -> Any:
    """The fsspec filesystem DCP reads and writes through, where paths are not local."""
    if storage.fs is None:
        raise CheckpointError(
            f"sharded checkpoints need local paths or an fsspec filesystem; {storage!r} "
            "has neither")
    return storage.fs


def _checksum(storage: Storage, rel: str) -> FileEntry:
    crc = Crc32c()
    with storage.open_read(rel) as f:
        while chunk := f.read(_CHUNK):
            crc.update(chunk)
    return crc.entry()


def _checksum_against(storage: Storage, name: str, fname: str, manifest: Manifest) -> None:
    where = storage.url_of(f"{name}/{fname}")
    entry = manifest.files[fname]
    try:
        got = _checksum(storage, f"{name}/{fname}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: missing") from None
    check_entry(got, entry, where)


__all__ = [
    "DCP_DIR",
    "SHARDED_LAYOUT",
    "ShardedCheckpointer",
    "StagedSharded",
    "parse_metadata",
    "uses_sharded_layout",
]
