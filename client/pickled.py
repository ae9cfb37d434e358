"""Reading the pickled files users arrive with, on the client only, never with a full unpickler.

The store itself holds JSON and safetensors only; this module is the one place that reads
PyTorch's pickle-based files, to import them:

- ``.pt`` / ``.pth`` / ``.bin`` / Lightning ``.ckpt`` files, and a Trainer folder's
  ``optimizer.pt``, ``scheduler.pt`` and ``rng_state*.pth``, through
  ``torch.load(weights_only=True)``: torch's restricted unpickler, which builds tensors,
  dicts, lists, tuples and plain values and refuses every other global. A file that needs
  more is refused, naming the global it asked for.
- A DCP folder's ``.metadata``, a plain pickle of DCP's metadata dataclasses (torch's
  restricted unpickler does not read its protocol), through an unpickler that resolves
  exactly the globals DCP writes there (its metadata classes, ``torch.Size``, dtypes,
  layouts, the checkpoint's path) and refuses any other. Its ``*.distcp`` files are read by
  DCP's own ``FileSystemReader``, which loads each tensor with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle  # noqa: TID251 - a restricted Unpickler subclass; see _MetadataUnpickler
import re
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any

import torch

from service.errors import InvalidInputError

#: The largest DCP metadata file read (it lists every chunk of every tensor).
MAX_METADATA_BYTES = 1 << 30


def _offending_global(exc: Exception) -> str:
    """The global a refused file asked for, from torch's message ("Unsupported global: GLOBAL x.Y …")."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return found.group(1) if found else str(exc).splitlines()[0][:200]


def _numpy_arrays() -> list[Any]:
    """The globals a numpy array of RNG state is rebuilt from (as Trainer and Accelerate allow them)."""
    import numpy

    core = getattr(numpy, "_core", None) or numpy.core
    return [core.multiarray._reconstruct, numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32))]


def load_weights_only(path: Path, *, numpy_arrays: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, memory-mapped where the format allows.

    ``numpy_arrays`` also lets numpy arrays through (an ``rng_state.pth`` holds numpy's RNG
    state), the same allowance transformers' Trainer makes to read that file back.

    Raises:
        InvalidInputError: the file needs full unpickling (naming the global it asks for), or
            is not a file torch.load reads.
    """
    allowed = _numpy_arrays() if numpy_arrays else []
    try:
        with torch.serialization.safe_globals(allowed):
            return _load(path)
    except pickle.UnpicklingError as exc:
        raise InvalidInputError(
            f"{path} needs full unpickling to load: it holds a {_offending_global(exc)}. ckptstore imports only what "
            "torch.load(weights_only=True) reads (tensors, dicts, lists, numbers, strings); save the state_dict "
            "alone (torch.save of model.state_dict()) and import that"
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise InvalidInputError(f"{path} is not a file torch.load reads: {str(exc).splitlines()[0][:200]}") from exc


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # noqa: TID251 - weights_only
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        # The legacy (pre-zip) format cannot be memory-mapped: read it whole.
        return torch.load(path, map_location="cpu", weights_only=True)  # noqa: TID251 - weights_only


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
#: (module, name) of every global DCP's .metadata may name, besides torch's dtypes.
_METADATA_GLOBALS = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
}
_PATHS = {cls.__name__: cls for cls in (PosixPath, WindowsPath, PurePosixPath, PureWindowsPath)}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP's metadata is made of; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "pathlib" and name in _PATHS:
            return _PATHS[name]
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise InvalidInputError(f"DCP metadata names the global {module}.{name}, which DCP never writes there")


def read_dcp_metadata(path: Path) -> Any:
    """The ``Metadata`` of a DCP checkpoint's ``.metadata`` file, read with :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata

    if path.stat().st_size > MAX_METADATA_BYTES:
        raise InvalidInputError(f"{path} is larger than {MAX_METADATA_BYTES} bytes")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except InvalidInputError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise InvalidInputError(f"{path} is not DCP metadata: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise InvalidInputError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def read_dcp_folder(directory: Path) -> dict[str, Any]:
    """Every item of the DCP checkpoint in ``directory``, as the nested state_dict it was saved from, on the CPU."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # Read first, so a refusal is raised as itself rather than inside DCP's CheckpointException.
    metadata = read_dcp_metadata(directory / ".metadata")

    class SafeReader(dcp.FileSystemReader):
        """DCP's own reader, with the metadata read by the restricted unpickler above."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    # As DCP's own dcp_to_torch_save does: an empty state_dict that the planner fills from the metadata.
    state: dict[str, Any] = {}
    _load_state_dict(
        state, storage_reader=SafeReader(str(directory)), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    return state
