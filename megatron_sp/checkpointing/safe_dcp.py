"""Reading DCP checkpoints without running code from them, and an integrity record of their files.

Trust model: a checkpoint directory is data, never code. torch.distributed.checkpoint (torch 2.13)
reads `.metadata` with a bare `pickle.load` (a crafted file can call anything), and its default
load planner reads non-tensor entries with `torch.load(weights_only=False)`. Here instead:

- `.metadata` is unpickled by `_MetadataUnpickler`, which resolves only DCP's metadata classes,
  torch.Size, torch dtypes / layouts / memory formats and pathlib paths; any other global is
  refused before it is called;
- the metadata must describe tensors only (megatron_sp saves nothing else) stored in files of the
  checkpoint directory itself (no absolute or `..` paths); `SafeLoadPlanner` refuses byte entries;
- tensor data is read by DCP with `torch.load(weights_only=True)`, RNG files likewise;
- the integrity record (size and sha256 of every file, `metadata.json["files"]`, written by the
  save) is checked before anything is unpickled. It catches truncated and corrupted files (a
  partial copy, a bad disk), not tampering: whoever can write the directory can rewrite the record.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import warnings

from megatron_sp.checkpointing import files

METADATA_FILE = ".metadata"  # DCP's pickled index of the tensors
METADATA_LIMIT = 256 << 20  # bytes of `.metadata` read at most (a 70B model's index is a few MB)

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
        "BytesStorageMetadata",
    },  # Bytes: refused after loading
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}

# megatron-core's save also pickles every rank's save plan into `.metadata` (all_local_plans)
_MEGATRON_ALLOWED = {
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that is not what megatron_sp writes (and is therefore not unpickled)."""


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler resolving only the globals a DCP `.metadata` file needs."""

    def __init__(self, file, megatron: bool = False):
        super().__init__(file)
        self.megatron = megatron

    def find_class(self, module, name):
        import torch

        if name in _ALLOWED.get(module, ()) or (self.megatron and name in _MEGATRON_ALLOWED.get(module, ())):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout)
        ):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"refers to {module}.{name}, which a DCP index never needs")


def read_metadata(checkpoint: str, allow_objects: bool = False):
    """DCP's Metadata of a checkpoint directory, unpickled safely and checked (UnsafeCheckpointError).
    allow_objects (a Megatron-LM checkpoint): entries that are pickled objects (its `_extra_state`)
    are listed, not refused (`load` still never unpickles them), and megatron-core's save plans are
    admitted."""
    path = os.path.join(checkpoint, METADATA_FILE)
    try:
        data = files.read_bytes(path, checkpoint, METADATA_LIMIT)
    except files.UnreadableFile as err:
        raise UnsafeCheckpointError(str(err)) from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), megatron=allow_objects).load()
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(f"{path} {err}; refusing to unpickle it") from None
    except Exception as err:  # noqa: BLE001 - truncated or garbled pickle: any error class
        raise UnsafeCheckpointError(f"{path} is not a readable DCP index ({type(err).__name__}: {err})") from None
    _check_metadata(metadata, path, allow_objects)
    return metadata


def _check_metadata(metadata, path: str, allow_objects: bool = False) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not a DCP Metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if allow_objects and isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpointError(
                f"{path} declares {key!r} as a pickled object; megatron_sp checkpoints "
                f"hold tensors only, so it is refused"
            )
    _check_storage(metadata, checkpoint=os.path.dirname(path), path=path)


def _check_storage(metadata, checkpoint: str, path: str) -> None:
    """Every stored chunk lies in a regular file of the checkpoint directory itself, within its size,
    and the tensors declared hold no more bytes than the files store (so that a reader never
    allocates more than the checkpoint holds: a forged 2^40-element entry is refused here)."""
    sizes = {}
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not files.is_plain_name(name):
            raise UnsafeCheckpointError(f"{path} points outside its directory ({name!r})")
        if name not in sizes:
            file = os.path.join(checkpoint, name)
            problem = files.regular_file_problem(file, checkpoint)
            if problem:
                raise UnsafeCheckpointError(f"{path} names a shard that is not a file of the checkpoint: {problem}")
            sizes[name] = os.path.getsize(file)
        offset, length = getattr(info, "offset", 0), getattr(info, "length", 0)
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length):
            raise UnsafeCheckpointError(f"{path} declares a chunk of {name} at a malformed place")
        if offset + length > sizes[name]:
            raise UnsafeCheckpointError(
                f"{path} declares bytes {offset}..{offset + length} of {name}, which holds {sizes[name]} (truncated?)"
            )
    try:
        declared = sum(
            _tensor_bytes(entry) for entry in metadata.state_dict_metadata.values() if hasattr(entry, "chunks")
        )
    except (AttributeError, TypeError, ValueError):
        raise UnsafeCheckpointError(f"{path} declares a tensor with a malformed shape or dtype") from None
    if declared > sum(sizes.values()):
        raise UnsafeCheckpointError(
            f"{path} declares tensors of {declared} bytes but its shards hold {sum(sizes.values())}"
        )


def _tensor_bytes(entry) -> int:
    """Bytes of one declared tensor: its whole shape or its chunks, whichever is larger."""
    import math

    import torch

    if not isinstance(entry.properties.dtype, torch.dtype):
        raise TypeError("not a dtype")
    shapes = [list(entry.size)] + [list(chunk.sizes) for chunk in entry.chunks]
    if not all(isinstance(n, int) and n >= 0 for shape in shapes for n in shape):
        raise ValueError("not a shape")
    whole = math.prod(shapes[0])
    chunks = sum(math.prod(shape) for shape in shapes[1:])
    return entry.properties.dtype.itemsize * max(whole, chunks)


def _reader_class():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeFileSystemReader(FileSystemReader):
        """FileSystemReader whose `.metadata` goes through `read_metadata` above."""

        allow_objects = False  # read_metadata's (a Megatron-LM checkpoint)

        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:  # per-rank metadata files: never written by us
                raise UnsafeCheckpointError(f"{self.path} asks for per-rank DCP metadata")
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_metadata(str(self.path), self.allow_objects)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner that never torch.load()s a non-tensor entry (weights_only=False there)."""

        def load_bytes(self, read_item, value):
            raise UnsafeCheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object")

    return SafeFileSystemReader, SafeLoadPlanner


def load(state_dict: dict, checkpoint: str, allow_objects: bool = False, **kwargs) -> None:
    """dcp.load into `state_dict` through the safe reader and planner (collective unless no_dist);
    allow_objects: read_metadata's."""
    module = safe_module()
    reader = module.FileSystemReader(checkpoint)
    reader.allow_objects = allow_objects
    module.load(state_dict, storage_reader=reader, **kwargs)


class _SafeDCP:
    """torch.distributed.checkpoint with its reading side replaced: `FileSystemReader` and `load`
    are the safe ones above; everything else (save, FileSystemWriter, ...) is DCP's own."""

    def __init__(self, dcp):
        self._dcp = dcp
        self.FileSystemReader, self._planner = _reader_class()

    def __getattr__(self, name):
        return getattr(self._dcp, name)

    def load(self, state_dict, *, checkpoint_id=None, storage_reader=None, planner=None, **kwargs):
        if storage_reader is None:
            storage_reader = self.FileSystemReader(checkpoint_id)
        if not isinstance(storage_reader, self.FileSystemReader):
            raise UnsafeCheckpointError(f"{type(storage_reader).__name__} is not the safe checkpoint reader")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._dcp.load(state_dict, storage_reader=storage_reader, planner=planner or self._planner(), **kwargs)


_MODULE = []


def safe_module() -> _SafeDCP:
    """The DCP module to use for reading (checkpointing._dcp() returns it)."""
    if not _MODULE:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch.distributed.checkpoint as dcp
        _MODULE.append(_SafeDCP(dcp))
    return _MODULE[0]


# ---- integrity record ----------------------------------------------------------------------------


def file_digest(path: str) -> dict:
    """{"size": bytes, "sha256": hex} of one file."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
            size += len(block)
    return {"size": size, "sha256": digest.hexdigest()}


def integrity_record(checkpoint: str) -> dict:
    """Collective: {file: {size, sha256}} of a checkpoint being saved; each rank hashes the files it
    wrote (DCP names them __<rank>_*.distcp; rank 0 also writes .metadata), in parallel."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = [
        n
        for n in os.listdir(checkpoint)
        if n.startswith(f"__{rank}_") or n == f"rng_rank{rank}.pt" or (rank == 0 and n == METADATA_FILE)
    ]
    record = {name: file_digest(os.path.join(checkpoint, name)) for name in mine}
    if not dist.is_initialized():
        return record
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, record)
    return {name: digest for view in views for name, digest in view.items()}


def check_sizes(checkpoint: str, record: dict) -> str | None:
    """Cheap part of the check (no reading): every recorded file exists with its size. None or why not."""
    for name, expected in sorted(record.items()):
        path = os.path.join(checkpoint, name)
        problem = files.regular_file_problem(path, checkpoint) if files.is_plain_name(name) else None
        if problem or not files.is_plain_name(name):
            return problem or f"{name!r} is not a file name of the checkpoint"
        size = os.path.getsize(path)
        if size != expected["size"]:
            return f"{path} has {size} bytes but was saved with {expected['size']} (truncated or overwritten)"
    return None


def check_digests(checkpoint: str, names) -> str | None:
    """sha256 of each named file against the record; None or the first mismatch."""
    for name, expected in names:
        path = os.path.join(checkpoint, name)
        try:
            actual = file_digest(path)
        except OSError as err:
            return f"{path} cannot be read ({err.strerror or err})"
        if actual != expected:
            return f"{path} does not match the sha256 recorded when it was saved (corrupted)"
    return None
