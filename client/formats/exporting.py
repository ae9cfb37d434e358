"""Export a version in the Hugging Face layout: plain safetensors files under state_dict names.

``model.safetensors``, or ``model-00001-of-0000N.safetensors`` files plus
``model.safetensors.index.json`` when the model is larger than the shard limit, loadable by
``safetensors.torch.load_file`` and by ``transformers``' ``from_pretrained``: ``config.json`` and
``generation_config.json`` are written from the version's ``extra["model_config"]`` and
``extra["generation_config"]`` where it holds them (``client.save`` and the Trainer plug-in record
a transformers model's, and an import of a ``save_pretrained`` or Trainer folder keeps the
folder's: :mod:`client.formats.hf.model_configs`), and never invented. With the
optimizer: ``optimizer.safetensors`` (tensors under their manifest keys less ``optim/``) and
``optimizer.json`` (the state tree).

Tensors are read through :class:`TensorReader` (every byte verified) and written straight to
their place in the file, one read span at a time, so memory stays near the largest tensor.
Each file is written as ``.<name>.<uuid>.incomplete`` and renamed when complete.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ckptstore.client import jsonstate
from ckptstore.client.formats.hf.model_configs import CONFIG_FILES
from ckptstore.client.loading import selection
from ckptstore.client.loading.reader import TensorReader
from ckptstore.client.store_protocol import Transport
from ckptstore.client.tensors import byte_view, host_contiguous
from ckptstore.service.errors import InvalidInputError, StateMismatchError
from ckptstore.service.format.manifest import TENSOR_REF, Manifest, TensorEntry
from ckptstore.service.format.safetensors_header import encode_header, layout_order

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_STATE_FILE = "optimizer.json"
SHARD_NAME = re.compile(r"^model-[0-9]{5}-of-[0-9]{5}\.safetensors$")
#: What transformers expects in ``__metadata__`` of a PyTorch safetensors file.
FILE_METADATA = {"format": "pt"}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@dataclass
class ExportResult:
    """What an export wrote."""

    run_id: str
    version: int
    directory: Path
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0


def shard_file_name(index: int, count: int) -> str:
    """``model-00001-of-00003.safetensors`` (1-based), Hugging Face's shard naming."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plan_files(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Group item indices (in order) into files of at most ``max_bytes``.

    A file closes when the next item would push it past the limit; an item larger than the
    limit gets a file of its own. Empty tensors are kept (unlike store shards, an exported
    file must hold every name).
    """
    files: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index, nbytes in enumerate(sizes):
        if current and current_bytes + nbytes > max_bytes:
            files.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += nbytes
    if current or not files:
        files.append(current)
    return files


def write_safetensors(
    path: Path, items: list[tuple[str, TensorEntry]], reader: TensorReader, metadata: dict[str, str] | None = None
) -> int:
    """Write ``(name, entry)`` items as a safetensors file at ``path``, atomically; returns its size.

    The layout (:func:`~service.format.safetensors_header.layout_order` of the items sorted by
    name, as the safetensors library writes) is fixed from the manifest before any byte is
    read; each tensor then goes to its offset as the reader yields it, in storage order.
    """
    for name, _ in items:
        if name == "__metadata__":
            raise InvalidInputError("a tensor named '__metadata__' cannot be written to a safetensors file")
    by_name = sorted(items, key=lambda item: item[0])
    layout = [by_name[index] for index in layout_order([entry.dtype for _, entry in by_name])]
    header, placed = encode_header([(name, e.dtype, list(e.shape)) for name, e in layout], metadata)
    offsets = {entry.key: len(header) + slot.begin for (_, entry), slot in zip(layout, placed, strict=True)}
    total = len(header) + (placed[-1].end if placed else 0)
    with written_atomically(path) as handle:
        handle.write(header)
        handle.truncate(total)
        with closing(reader.read_many([entry.key for _, entry in layout])) as stream:
            for key, tensor in stream:
                handle.seek(offsets[key])
                handle.write(byte_view(host_contiguous(tensor, key)))
    return total


@contextmanager
def written_atomically(path: Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: ``.<name>.<uuid>.incomplete``, flushed, synced and
    renamed into place when the block ends, removed if it raises (``path`` is never half-written)."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.incomplete")
    try:
        with open(temporary, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place."""
    with written_atomically(path) as handle:
        handle.write(text.encode("utf-8"))


def model_entries(manifest: Manifest, patterns: Sequence[str] | None = None) -> list[tuple[str, TensorEntry]]:
    """``(state_dict name, entry)`` of the model tensors of a version ``patterns`` select (default
    every one), in manifest order."""
    entries = {e.key: e for e in manifest.tensors}
    selected = selection.selected_model_keys(manifest, selection.check_patterns(patterns))
    return [(name, entries[key]) for name, key in selected.items()]


def stored_json(manifest: Manifest, key: str) -> Any:
    """The JSON value version ``manifest`` holds as ``extra[key]`` (None when it holds none).

    Raises:
        StateMismatchError: the value refers to a tensor (a config is JSON only).
    """
    extra = manifest.state.get("extra")
    if not isinstance(extra, dict) or key not in extra:
        return None

    def no_tensors(ref: str) -> Any:
        raise StateMismatchError(f"version {manifest.version}'s extra[{key!r}] refers to tensor {ref!r}, not JSON")

    return jsonstate.decode(extra[key], no_tensors)


def _strip_refs(value: Any, prefix: str) -> Any:
    """The JSON tree with tensor references renamed to their names in the exported file."""
    if isinstance(value, dict):
        if set(value) == {TENSOR_REF} and isinstance(value[TENSOR_REF], str):
            return {TENSOR_REF: value[TENSOR_REF].removeprefix(prefix)}
        return {k: _strip_refs(v, prefix) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip_refs(v, prefix) for v in value]
    return value


def _remove_stale(directory: Path, keep: set[str]) -> None:
    """Remove model files an earlier export left that this one did not write (as transformers does)."""
    for path in directory.iterdir():
        if path.name in keep or not path.is_file():
            continue
        if path.name in (SINGLE_FILE, INDEX_FILE) or SHARD_NAME.match(path.name):
            path.unlink()


def export_version(
    transport: Transport,
    run_id: str,
    ref: int | str,
    directory: Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    optimizer: bool = False,
    on_bytes: Callable[[int], object] | None = None,
    on_total: Callable[[int], object] | None = None,
    keys: Sequence[str] | None = None,
) -> ExportResult:
    """Write version ``ref`` of ``run_id`` to ``directory`` in the Hugging Face layout, with
    ``config.json`` and ``generation_config.json`` when the version holds ``extra["model_config"]``
    and ``extra["generation_config"]``.

    ``keys`` (glob patterns over state_dict names, as :meth:`Client.load` takes them) writes
    only the model tensors they select, e.g. ``["*lora_*"]``.
    """
    started = time.perf_counter()
    manifest = transport.manifest(run_id, ref)
    model = model_entries(manifest, keys)
    if keys is not None and optimizer:
        raise InvalidInputError("--keys selects model tensors; export the optimizer without --keys")
    optim = [(e.key.removeprefix("optim/"), e) for e in manifest.tensors if e.key.startswith("optim/")]
    if optimizer and "optim" not in manifest.state:
        raise StateMismatchError(
            f"version {manifest.version} of run {run_id!r} holds no optimizer state; export without --optimizer"
        )
    written = model + (optim if optimizer else [])
    if on_total is not None:
        on_total(sum(entry.nbytes for _, entry in written))
    directory.mkdir(parents=True, exist_ok=True)
    reader = TensorReader(transport, manifest, on_bytes=on_bytes)
    result = ExportResult(run_id=manifest.run_id, version=manifest.version, directory=directory)
    groups = plan_files([entry.nbytes for _, entry in model], max_shard_bytes)
    if len(groups) == 1:
        write_safetensors(directory / SINGLE_FILE, model, reader, FILE_METADATA)
        result.files.append(SINGLE_FILE)
    else:
        weight_map: dict[str, str] = {}
        for number, group in enumerate(groups, start=1):
            name = shard_file_name(number, len(groups))
            items = [model[i] for i in group]
            write_safetensors(directory / name, items, reader, FILE_METADATA)
            weight_map.update((tensor_name, name) for tensor_name, _ in items)
            result.files.append(name)
        index = {"metadata": {"total_size": sum(e.nbytes for _, e in model)}, "weight_map": weight_map}
        write_text_atomically(directory / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
        result.files.append(INDEX_FILE)
    _remove_stale(directory, set(result.files))
    for name, key in CONFIG_FILES.items():  # config.json and generation_config.json, as the version holds them
        config = stored_json(manifest, key)
        if isinstance(config, dict):
            write_text_atomically(directory / name, json.dumps(config, indent=2, sort_keys=True) + "\n")
            result.files.append(name)
    if optimizer:
        write_safetensors(directory / OPTIMIZER_FILE, optim, reader, FILE_METADATA)
        state = _strip_refs(manifest.state["optim"], "optim/")
        write_text_atomically(directory / OPTIMIZER_STATE_FILE, json.dumps(state, indent=2) + "\n")
        result.files += [OPTIMIZER_FILE, OPTIMIZER_STATE_FILE]
    result.tensors = len(written)
    result.bytes = sum(entry.nbytes for _, entry in written)
    result.seconds = time.perf_counter() - started
    return result
