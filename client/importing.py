"""Import weights (safetensors, a Hugging Face folder) and other checkpoints (:mod:`client.sources`) as a version.

The files are memory-mapped, not read into memory: each tensor is a view of the mapped file
until the normal save path hashes it and, if the store lacks it, writes it into a shard. So a
base model is seeded once and every fine-tune saved later dedups against it.

Headers are checked before anything is mapped: size caps, no duplicate names, known dtypes,
offsets in bounds, not overlapping and consistent with dtype × shape.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from client import sources
from client.api import Client
from client.results import SaveResult
from client.tensors import NAME_TO_TORCH
from service.errors import InvalidInputError
from service.format.dtypes import itemsize
from service.format.jsondoc import strict_decoder
from service.format.safetensors_header import entry_fields

SINGLE_FILE = "model.safetensors"
BIN_FILE = "pytorch_model.bin"
INDEX_FILE = "model.safetensors.index.json"
#: The reference library's own cap on a header.
MAX_HEADER_BYTES = 100 << 20
MAX_INDEX_BYTES = 100 << 20


def _decoder(what: str, floats: bool) -> json.JSONDecoder:
    return strict_decoder(InvalidInputError, what, floats=floats)


def _parse_json(text: bytes, what: str, floats: bool) -> Any:
    try:
        return _decoder(what, floats).decode(text.decode("utf-8"))
    except InvalidInputError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidInputError(f"{what} is not valid JSON: {exc}") from exc


def _entries(path: Path, header: Any, data_length: int) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """Validated ``(name, dtype, shape, begin, end)`` of every tensor in a parsed header.

    Each entry's fields follow the shard reader's rules (:func:`entry_fields`); a foreign file
    may also name tensors freely, list them in any order and leave gaps between them.
    """
    if not isinstance(header, dict):
        raise InvalidInputError(f"{path}: the safetensors header is not a JSON object")
    entries = []
    for name, value in header.items():
        if name == "__metadata__":
            continue
        subject = f"{path}: tensor {name[:80]!r}"
        dtype, shape, begin, end = entry_fields(value, subject, InvalidInputError)
        if end > data_length:
            raise InvalidInputError(
                f"{subject} spans bytes {begin}-{end}, past the {data_length} bytes of data: "
                "every tensor must lie inside the file"
            )
        entries.append((name, dtype, shape, begin, end))
    entries.sort(key=lambda e: (e[3], e[4]))  # file order, as the writer laid them out
    previous_end, previous = 0, ""
    for name, _, _, begin, end in entries:
        if begin < previous_end:
            raise InvalidInputError(f"{path}: tensors {previous[:80]!r} and {name[:80]!r} overlap")
        if end > begin:
            previous_end, previous = end, name
    return entries


def open_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file at ``path``, as views of the memory-mapped file."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise InvalidInputError(f"{path}: {size} bytes is too short for a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise InvalidInputError(f"{path}: header length {length} does not fit the file ({size} bytes)")
        header = _parse_json(handle.read(length), f"{path} header", floats=False)
    data_start = 8 + length
    entries = _entries(path, header, size - data_start)
    # A private (copy-on-write) mapping: pages come lazily from the page cache, nothing is written back.
    data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, begin, end in entries:
        offset = data_start + begin
        piece = data[offset : offset + end - begin]
        if offset % itemsize(dtype):  # misaligned for its dtype: copy the bytes out of the mapping
            piece = piece.clone()
        tensors[name] = piece.view(NAME_TO_TORCH[dtype]).reshape(shape)
    return tensors


def _index_files(directory: Path) -> dict[str, list[str]]:
    """``file -> names`` from a Hugging Face index, checking every file is a plain name inside ``directory``."""
    path = directory / INDEX_FILE
    if path.stat().st_size > MAX_INDEX_BYTES:
        raise InvalidInputError(f"{path} is larger than {MAX_INDEX_BYTES} bytes")
    index = _parse_json(path.read_bytes(), str(path), floats=True)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise InvalidInputError(f"{path} has no weight_map object of tensor name -> file name")
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if Path(file).name != file or file in ("", ".", "..") or "\\" in file:
            raise InvalidInputError(f"{path}: {file[:80]!r} is not a file name in {directory}")
        files.setdefault(file, []).append(name)
    return files


def read_source(source: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file or of a Hugging Face folder (index + shards, or
    ``model.safetensors``), memory-mapped."""
    if source.is_file():
        return open_safetensors(source)
    if not source.is_dir():
        raise InvalidInputError(f"{source} is neither a file nor a folder")
    if not (source / INDEX_FILE).is_file():
        if (source / SINGLE_FILE).is_file():
            return open_safetensors(source / SINGLE_FILE)
        if (source / BIN_FILE).is_file():
            return sources.read_pickled_file(source / BIN_FILE).model
        raise InvalidInputError(f"{source} holds neither {INDEX_FILE}, {SINGLE_FILE} nor {BIN_FILE}")
    tensors: dict[str, torch.Tensor] = {}
    for file, names in sorted(_index_files(source).items()):  # model-00001-… first
        found = open_safetensors(source / file)
        absent = [name for name in names if name not in found]
        if absent:
            raise InvalidInputError(f"{source / file} lacks {absent[0]!r}, which {INDEX_FILE} places there")
        for name, tensor in found.items():
            if name in tensors:
                raise InvalidInputError(f"tensor {name[:80]!r} appears in two files of {source}")
            tensors[name] = tensor
    return tensors


def read_checkpoint(source: Path) -> sources.Imported:
    """Everything an import stores from ``source``, whatever its format (:mod:`client.sources`)."""
    if source.is_file():
        if source.suffix in sources.PICKLED_SUFFIXES:
            return sources.read_pickled_file(source)
        return sources.Imported(open_safetensors(source))
    if (source / sources.DCP_METADATA).is_file():
        return sources.read_dcp(source)
    if (source / sources.TRAINER_STATE).is_file():
        return sources.read_trainer_folder(source, read_source(source))
    return sources.Imported(read_source(source))


def import_weights(client: Client, source: Path, run_id: str, *, tags: list[str] | tuple[str, ...] = ()) -> SaveResult:
    """Store the checkpoint at ``source`` as the next version of ``run_id``: model tensors (not
    trainable unless the source has optimizer state for them), optimizer and scheduler state,
    extras, and the step where the source records one."""
    imported = read_checkpoint(source)
    if not imported.model:
        raise InvalidInputError(f"{source} holds no tensors")
    return client.save_state_dict(
        run_id,
        imported.model,
        trainable=False,
        tags=tags,
        step=imported.step,
        extra=imported.extra or None,
        optim_state=imported.optim,
        scheduler_state=imported.scheduler,
    )
