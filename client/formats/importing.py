"""Import weights (safetensors, a Hugging Face folder) and other checkpoints (:mod:`.sources`) as a version.

The files are memory-mapped, not read into memory: each tensor is a view of the mapped file
until the normal save path hashes it and, if the store lacks it, writes it into a shard. So a
base model is seeded once and every fine-tune saved later dedups against it.

Headers are checked before any tensor is made: size caps (the header's bytes, and the objects,
arrays and values its structural bytes allow, before the JSON is parsed), no duplicate names,
known dtypes, offsets in bounds, not overlapping and consistent with dtype × shape. Every file a
folder names is resolved inside the folder and must be a regular file (:mod:`client.formats.confined`).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import torch

from ckptstore.client.api import Client
from ckptstore.client.formats import budget, confined, dcp_layouts, sources, wrapped_names
from ckptstore.client.formats.accelerate.folder import is_accelerate_folder, read_accelerate_folder
from ckptstore.client.formats.hf import model_configs, peft_folder
from ckptstore.client.formats.json_text import check_structure, parse_json
from ckptstore.client.results import SaveResult
from ckptstore.client.state import is_positional
from ckptstore.client.tensors import NAME_TO_TORCH
from ckptstore.service.errors import InvalidInputError
from ckptstore.service.format.dtypes import itemsize
from ckptstore.service.format.safetensors_header import entry_fields

SINGLE_FILE = "model.safetensors"
BIN_FILE = "pytorch_model.bin"
INDEX_FILE = "model.safetensors.index.json"
#: The reference library's own cap on a header.
MAX_HEADER_BYTES = 100 << 20
MAX_INDEX_BYTES = 100 << 20
#: Most tensors one safetensors file may hold: its header may hold this many objects (one per
#: tensor, counted by their braces before parsing, however the keys are spelled), and two more.
MAX_FILE_TENSORS = 1 << 18
#: Most values a header may hold (every number, string, list and object, by the commas and brackets
#: that separate them): 16 a tensor at the most tensors, a shape of up to 10 dimensions each.
MAX_HEADER_VALUES = 16 * MAX_FILE_TENSORS
#: Why a folder's file or subfolder the import did not read is in the report.
UNREAD_FILE = "not read: no part of this format's checkpoint (tokenizers, training_args.bin and notes are not stored)"
UNREAD_FOLDER = "not read: a folder inside the source"


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
    mapped = confined.map_file(path)
    size = len(mapped) if mapped is not None else 0
    if mapped is None or size < 8:
        raise InvalidInputError(f"{path}: {size} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", mapped[:8])
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise InvalidInputError(f"{path}: header length {length} does not fit the file ({size} bytes)")
    text = mapped[8 : 8 + length]
    check_structure(
        text,
        f"{path}: the safetensors header",
        objects=MAX_FILE_TENSORS + 2,  # the header itself and its __metadata__
        arrays=2 * MAX_FILE_TENSORS,  # a shape and data_offsets a tensor
        values=MAX_HEADER_VALUES,
        unit=" (one per tensor)",
    )
    header = parse_json(text, f"{path} header", floats=False)
    data_start = 8 + length
    entries = _entries(path, header, size - data_start)
    # A private (copy-on-write) mapping: pages come lazily from the page cache, nothing is written back.
    data = torch.frombuffer(mapped, dtype=torch.uint8)
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
    index = parse_json(confined.read_small(path, MAX_INDEX_BYTES), str(path), floats=True)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise InvalidInputError(f"{path} has no weight_map object of tensor name -> file name")
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if Path(file).name != file or file in ("", ".", ".."):
            raise InvalidInputError(f"{path}: {file[:80]!r} points outside {directory}: name a file in the folder")
        confined.inside(directory, file, named_in=str(path))
        files.setdefault(file, []).append(name)
    return files


def read_source(source: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file or of a Hugging Face folder (index + shards, or
    ``model.safetensors``), memory-mapped."""
    if not source.is_dir():
        return open_safetensors(source)
    if not sources.exists(source / INDEX_FILE):
        if sources.exists(source / SINGLE_FILE):
            return open_safetensors(source / SINGLE_FILE)
        if sources.exists(source / BIN_FILE):
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


def read_checkpoint(
    source: Path, *, expand_limit: int = 0, max_expansion: float = budget.DEFAULT_MAX_EXPANSION
) -> sources.Imported:
    """Everything an import stores from ``source``, whatever its format (:mod:`client.formats.sources`).

    ``source`` itself is the user's choice and may be a link; every file it names is confined
    to it. ``expand_limit`` lets expanded (stride-0) tensors of ``.pt`` files through up to
    that many bytes each. Every tensor read is checked against its bytes (:func:`sources.check_tensors`),
    and the whole import may make at most ``max_expansion`` times the source's bytes
    (:mod:`client.formats.budget`). Names lose the parts torch.compile and DDP add
    (:mod:`client.formats.wrapped_names`), except in a checkpoint stored whole (Lightning's).
    """
    source = source.resolve()
    with budget.budgeted(source, max_expansion) as allowed:
        imported = _read_checkpoint(source, expand_limit)
    if imported.tree is None:  # stored under canonical names, as client.save stores a wrapped model's
        rename = wrapped_names.canonical_rule(imported.model)
        imported.model = wrapped_names.canonical_model(imported.model, rename, str(source))
        if imported.optim is not None:
            imported.optim = wrapped_names.canonical_optimizer(imported.optim, rename, str(source))
    stored = sources.tensor_bytes(imported)
    if stored > allowed.limit:
        raise InvalidInputError(
            f"{source}: its tensors come to {stored} bytes from a source of {allowed.source}, past the limit of "
            f"{allowed.multiple:g}x its size ({allowed.limit} bytes): a checkpoint makes about its own size, so "
            "this one reuses its bytes; if it is genuine, raise the limit with --max-expansion"
        )
    return imported


def _read_checkpoint(source: Path, expand_limit: int) -> sources.Imported:
    if not source.is_dir():
        if source.suffix in sources.PICKLED_SUFFIXES:
            imported = sources.read_pickled_file(source, expand_limit=expand_limit)
        else:
            imported = sources.Imported(open_safetensors(source))
    else:
        with confined.recording() as opened, confined.reading(source, confined.cache_repo(source)):
            imported = _read_folder(source, expand_limit)
        for entry in sorted(source.iterdir()):
            if entry not in opened and entry.name not in imported.left_out:
                imported.left_out[entry.name] = UNREAD_FILE if entry.is_file() else UNREAD_FOLDER
    for part, value in (("optimizer", imported.optim), ("scheduler", imported.scheduler), ("extra", imported.extra)):
        sources.check_tensors(value, f"{source} ({part})")
    return imported


def _read_folder(source: Path, expand_limit: int) -> sources.Imported:
    if sources.exists(source / sources.DCP_METADATA):
        return dcp_layouts.read_dcp(source)
    if sources.exists(source / sources.TRAINER_STATE):
        if sources.exists(source / peft_folder.ADAPTER_CONFIG):
            raise InvalidInputError(
                f"{source} is a Trainer checkpoint of a PEFT model: its optimizer.pt is indexed over the "
                "adapter's parameters in the model's order, which its files do not record; import its "
                f"{peft_folder.ADAPTER_CONFIG} and adapter weights as a PEFT folder of their own, or train "
                "with CkptstoreCallback, whose versions resume"
            )
        return sources.read_trainer_folder(source, read_source(source), expand_limit=expand_limit)
    if sources.exists(source / peft_folder.ADAPTER_CONFIG):
        return peft_folder.read_peft_folder(source, open_safetensors)
    if is_accelerate_folder(source):
        return read_accelerate_folder(source, read_source(source), expand_limit=expand_limit)
    # A save_pretrained folder: its config.json and generation_config.json kept for export.
    return sources.Imported(read_source(source), extra=model_configs.read_configs(source))


def import_weights(
    client: Client,
    source: Path,
    run_id: str,
    *,
    tags: list[str] | tuple[str, ...] = (),
    expand_limit: int = 0,
    max_expansion: float = budget.DEFAULT_MAX_EXPANSION,
) -> SaveResult:
    """Store the checkpoint at ``source`` as the next version of ``run_id``: model tensors (not
    trainable unless the source has optimizer state for them), optimizer and scheduler state,
    extras, and the step where the source records one.

    Everything is read and checked before anything is stored: a refused source stores nothing.

    ``max_expansion``: the most bytes the import may make, as a multiple of the source's
    (:mod:`client.formats.budget`).

    Raises:
        InvalidInputError: the source, or a file it names, is refused (the message names the
            file and what is wrong).
    """
    imported = read_checkpoint(source, expand_limit=expand_limit, max_expansion=max_expansion)
    return save_imported(client, imported, source, run_id, tags=tags)


def save_imported(
    client: Client, imported: sources.Imported, source: Path, run_id: str, *, tags: list[str] | tuple[str, ...] = ()
) -> SaveResult:
    """Store what :func:`read_checkpoint` read from ``source`` as the next version of ``run_id``."""
    if not imported.model:
        raise InvalidInputError(f"{source} holds no tensors")
    if imported.tree is not None:  # stored as the trainer's plug-in stores its checkpoints
        rest = {key: value for key, value in imported.tree.items() if key != imported.weights_key}
        return client.save_state_dict(
            run_id,
            imported.tree[imported.weights_key],
            trainable=True,
            tags=tags,
            step=imported.step,
            metrics=imported.metrics or None,
            extra=rest,
        )
    # Optimizer state by position does not say which weights it trains: all are stored as trainable.
    positional = imported.optim is not None and is_positional(imported.optim["param_groups"])
    return client.save_state_dict(
        run_id,
        imported.model,
        trainable=positional,
        tags=tags,
        step=imported.step,
        metrics=imported.metrics or None,
        extra=imported.extra or None,
        optim_state=imported.optim,
        scheduler_state=imported.scheduler,
    )
