"""The hostile import corpus: checkpoints ``ckptstore import`` must refuse, and what it must say.

Each case is a builder that writes its files under a fresh work folder and returns the source to
import, plus a row of :data:`CASES`: the file the error must name and the words it must hold. Most
cases are one mutation of a valid checkpoint made by the real library (:mod:`tests.cli.import_kit`,
whose ``BASES`` must still import), so a refusal is about the hostile part alone.

A code-execution payload creates ``work / MARKER``; it must never exist after an import. The
source and every file it names stay inside ``work``.

Nothing in a work folder's path may hold an expected word: the test compares the error line with
the work folder's own path removed, and the files outside the source live in ``elsewhere``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import random
import shutil
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.cli import hostile_pickles as hp
from tests.cli import hostile_reuse
from tests.cli.hostile_case import (
    COMPRESSED,
    LIMIT,
    LINK,
    MARKER,
    NOT_A,
    NOT_A_MODEL,
    NOT_REGULAR,
    OUTSIDE,
    OVERFLOW,
    OVERLAP,
    PAST_END,
    REMOTE_CODE,
    UNCOVERED,
    Case,
    global_named,
    tensor_bytes,
)
from tests.cli.hostile_case import elsewhere as _elsewhere
from tests.cli.hostile_case import marker as _marker
from tests.cli.import_kit import dcp_folder, metadata_of, model_state, point, storage_key, trainer_folder


def dcp_byte_entry_evil(work: Path) -> Path:
    """A non-tensor entry is a torch.save'd blob inside the ``.distcp``, which DCP unpickles in full."""
    return dcp_folder(work / "ckpt", extra={"note": hp.Evil(_marker(work)), "epoch": 3})


def dcp_tensor_record_evil(work: Path) -> Path:
    """A tensor's record, in a second ``.distcp``, is a torch.save archive of a call to os.system."""
    folder = dcp_folder(work / "ckpt")
    blob = hp.torch_saved_bytes({"w": hp.Evil(_marker(work))})
    (folder / "__1_0.distcp").write_bytes(blob)
    with metadata_of(folder) as metadata:
        point(metadata, "model.w", relative_path="__1_0.distcp", offset=0, length=len(blob))
    return folder


def _dcp_mutation(mutate: Callable[[Path, Any], object], extra: dict[str, Any] | None = None) -> Callable[[Path], Path]:
    def build(work: Path) -> Path:
        folder = dcp_folder(work / "ckpt", extra=extra)
        with metadata_of(folder) as metadata:
            mutate(work, metadata)
        return folder

    return build


def _secret(work: Path) -> Path:
    """A copy of the checkpoint's own ``.distcp`` outside its folder: a read through it would succeed."""
    secret = _elsewhere(work) / "secret.pt"
    shutil.copyfile(work / "ckpt" / "__0_0.distcp", secret)
    return secret


def _to_secret(relative_path: Callable[[Path], object]) -> Callable[[Path, Any], None]:
    """``model.w``'s chunk read from ``relative_path(secret)``, where secret is :func:`_secret`."""

    def mutate(work: Path, metadata: Any) -> None:
        point(metadata, "model.w", relative_path=relative_path(_secret(work)))

    return mutate


class _WindowsPathOf:
    """Pickles as ``pathlib.WindowsPath(path)``, a class that cannot be built on Linux."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return pathlib.WindowsPath, (self.path,)


def _evil_note(work: Path, metadata: Any) -> None:
    blob = hp.torch_saved_bytes(hp.Evil(_marker(work)))
    (_elsewhere(work) / "note.pt").write_bytes(blob)
    point(metadata, "extra.note", relative_path="../elsewhere/note.pt", offset=0, length=len(blob))


def _append(folder: Path, tensor: torch.Tensor) -> tuple[int, int]:
    """Append a torch.save'd ``tensor`` to ``__0_0.distcp``, as DCP writes one chunk: (offset, length)."""
    blob = hp.torch_saved_bytes(tensor)
    path = folder / "__0_0.distcp"
    offset = path.stat().st_size
    with open(path, "ab") as handle:
        handle.write(blob)
    return offset, len(blob)


def _second_chunk(at: int, length: int) -> Callable[[Path, Any], None]:
    """``model.w`` (16 elements) gets a second chunk of ``length`` elements at ``at``, with real bytes behind it."""

    def mutate(work: Path, metadata: Any) -> None:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

        offset, size = _append(work / "ckpt", torch.arange(length, dtype=torch.float32))
        info = metadata.storage_data[storage_key(metadata, "model.w")]
        chunk = ChunkStorageMetadata(offsets=torch.Size([at]), sizes=torch.Size([length]))
        metadata.state_dict_metadata["model.w"].chunks.append(chunk)
        key = MetadataIndex("model.w", torch.Size([at]), index=1)
        metadata.storage_data[key] = dataclasses.replace(info, offset=offset, length=size)

    return mutate


def _claim(size: list[int]) -> Callable[[Path, Any], None]:
    def mutate(work: Path, metadata: Any) -> None:
        metadata.state_dict_metadata["model.w"].size = torch.Size(size)

    return mutate


def fifo_model_safetensors(work: Path) -> Path:
    folder = work / "ckpt"
    folder.mkdir()
    os.mkfifo(folder / "model.safetensors")
    return folder


def fifo_rng_state(work: Path) -> Path:
    trainer_folder(work / "ckpt")
    os.mkfifo(work / "ckpt" / "rng_state_7.pth")
    return work / "ckpt"


def fifo_distcp(work: Path) -> Path:
    folder = dcp_folder(work / "ckpt")
    (folder / "__0_0.distcp").unlink()
    os.mkfifo(folder / "__0_0.distcp")
    return folder


def symlink_model_safetensors(work: Path) -> Path:
    outside = _elsewhere(work) / "real.safetensors"
    save_file(model_state(), outside)
    (work / "ckpt").mkdir()
    (work / "ckpt" / "model.safetensors").symlink_to(outside)
    return work / "ckpt"


def symlink_rng_state(work: Path) -> Path:
    trainer_folder(work / "ckpt")
    shutil.copyfile(work / "ckpt" / "rng_state.pth", _elsewhere(work) / "rng.pth")
    (work / "ckpt" / "rng_state_9.pth").symlink_to(work / "elsewhere" / "rng.pth")
    return work / "ckpt"


def _config(change: Callable[[Path, dict[str, Any]], None]) -> Callable[[Path], Path]:
    """A Trainer folder whose ``config.json`` is changed by ``change(folder, config)``."""

    def build(work: Path) -> Path:
        folder = work / "ckpt"
        trainer_folder(folder)
        config = json.loads((folder / "config.json").read_text())
        change(folder, config)
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    return build


def _remote_code(folder: Path, config: dict[str, Any]) -> None:
    marker = folder.parent / MARKER
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    del config["model_type"]
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}


def _architecture(name: str) -> Callable[[Path, dict[str, Any]], None]:
    def change(folder: Path, config: dict[str, Any]) -> None:
        config["architectures"] = [name]

    return change


def _trainer_file(name: str, write: Callable[[Path, Path], object]) -> Callable[[Path], Path]:
    """A Trainer folder whose file ``name`` is rewritten by ``write(path, work)``."""

    def build(work: Path) -> Path:
        trainer_folder(work / "ckpt")
        write(work / "ckpt" / name, work)
        return work / "ckpt"

    return build


def _unknown_state_index(work: Path) -> Path:
    def renumber(state: dict[str, Any]) -> dict[str, Any]:
        state["state"][999] = state["state"].pop(0)
        return state

    trainer_folder(work / "ckpt", optimizer=renumber)
    return work / "ckpt"


def _truncated(path: Path, work: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _pt_with(value: Callable[[Path], Any], name: str = "weights.pt", legacy: bool = False) -> Callable[[Path], Path]:
    def build(work: Path) -> Path:
        return hp.torch_saved(value(work), work / name, legacy=legacy)

    return build


def _in_archive(data_pkl: Callable[[Path], bytes], name: str = "weights.pt") -> Callable[[Path], Path]:
    def build(work: Path) -> Path:
        return hp.torch_archive(work / name, data_pkl(work))

    return build


def _safetensors(header: dict[str, Any], data: bytes = b"") -> Callable[[Path], Path]:
    def build(work: Path) -> Path:
        text = json.dumps(header).encode()
        (work / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data)
        return work / "model.safetensors"

    return build


def million_entries(work: Path) -> Path:
    """A safetensors file whose header lists 1,000,000 one-element tensors (~66 MB of JSON)."""
    count = 1_000_000
    entries = b",".join(
        b'"layer.%d":{"dtype":"F32","shape":[1],"data_offsets":[%d,%d]}' % (i, 4 * i, 4 * i + 4) for i in range(count)
    )
    header = b"{" + entries + b"}"
    path = work / "model.safetensors"
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.write(bytes(4 * count))
    return path


def _with_state(extra: Callable[[Path], dict[str, Any]]) -> Callable[[Path], Any]:
    return lambda work: {"state_dict": model_state(), **extra(work)}


def _bin_folder_evil(work: Path) -> Path:
    (work / "ckpt").mkdir()
    hp.torch_saved({**model_state(), "config": hp.Evil(_marker(work))}, work / "ckpt" / "pytorch_model.bin")
    return work / "ckpt"


def _torchscript(work: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), work / "weights.pt")
    return work / "weights.pt"


def _random_bytes(path: Path, work: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(4096))


def _overwrite(data: Callable[[], bytes]) -> Callable[[Path, Path], None]:
    def write(path: Path, work: Path) -> None:
        hp.torch_archive(path, data())

    return write


#: A slice of a .distcp named by the .metadata: either file may be the one the error names.
SLICED = (".metadata", "__0_0.distcp")


def _hostile(payload: str, protocol: int, work: Path) -> bytes:
    return hp.hostile_pickle(payload, _marker(work), protocol)


def _extension(protocol: int, work: Path) -> bytes:
    return hp.extension_pickle(_marker(work), protocol)


def _pickle_cases() -> list[Case]:
    """The same hostile ``data.pkl`` at every protocol, by global and by copyreg extension code."""
    cases = [
        Case(
            f"pt-archive-{payload.lower()}-p{protocol}",
            _in_archive(functools.partial(_hostile, payload, protocol)),
            "weights.pt",
            global_named(payload),
        )
        for payload in hp.PAYLOADS
        for protocol in hp.PROTOCOLS
    ]
    cases += [
        Case(
            f"pt-archive-ext1-p{protocol}",
            _in_archive(functools.partial(_extension, protocol)),
            "weights.pt",
            (("extension", "global"),),
            extension=True,
        )
        for protocol in hp.PROTOCOLS
        if protocol >= 2
    ]
    return cases


CASES: list[Case] = [
    # Code in pickles: DCP byte entries and records, torch.save files of every kind.
    Case("dcp-byte-entry-evil", dcp_byte_entry_evil, "__0_0.distcp", global_named("system")),
    Case("dcp-tensor-record-evil", dcp_tensor_record_evil, "__1_0.distcp", global_named("system")),
    Case(
        "dcp-metadata-global",
        _dcp_mutation(lambda work, m: m.planner_data.__setitem__("model.w", hp.Evil(_marker(work)))),
        ".metadata",
        global_named("system"),
    ),
    Case(
        "pt-state-dict-and-evil",
        _pt_with(_with_state(lambda work: {"config": hp.Evil(_marker(work))})),
        "weights.pt",
        global_named("system"),
    ),
    *_pickle_cases(),
    Case(
        "pt-legacy-evil",
        _pt_with(_with_state(lambda work: {"config": hp.Evil(_marker(work))}), legacy=True),
        "weights.pt",
        global_named("system"),
    ),
    Case(
        "pt-raw-pickle",
        lambda work: _write(work / "weights.pt", hp.hostile_pickle("system", _marker(work), 2)),
        "weights.pt",
        (("global", "not a"),),
    ),
    Case("pt-torchscript", _torchscript, "weights.pt", (("torchscript", "not a", "global"),)),
    Case(
        "ckpt-evil",
        _pt_with(_with_state(lambda work: {"hyper_parameters": hp.Evil(_marker(work))}), name="last.ckpt"),
        "last.ckpt",
        global_named("system"),
    ),
    Case("bin-folder-evil", _bin_folder_evil, "pytorch_model.bin", global_named("system")),
    Case(
        "trainer-rng-state-evil",
        _trainer_file("rng_state.pth", lambda path, work: hp.torch_saved({"cpu": hp.Evil(_marker(work))}, path)),
        "rng_state.pth",
        global_named("system"),
    ),
    Case(
        "pt-archive-truncated-pickle",
        _in_archive(lambda work: hp.tensor_pickle({"w": (4,)})[:-6]),
        "weights.pt",
        NOT_A,
    ),
    # Paths a DCP .metadata names.
    Case(
        "dcp-path-parent",
        _dcp_mutation(_to_secret(lambda secret: "../elsewhere/secret.pt")),
        ".metadata",
        OUTSIDE,
    ),
    Case(
        "dcp-path-absolute",
        _dcp_mutation(_to_secret(str)),
        ".metadata",
        OUTSIDE,
    ),
    Case(
        "dcp-path-posixpath",
        _dcp_mutation(_to_secret(pathlib.PosixPath)),
        ".metadata",
        (("outside", "global"),),
    ),
    Case(
        "dcp-path-windowspath",
        _dcp_mutation(lambda work, m: point(m, "model.w", relative_path=_WindowsPathOf("C:\\elsewhere\\secret.pt"))),
        ".metadata",
        (("outside", "global"),),
    ),
    Case(
        "dcp-byte-entry-escaping-evil",
        _dcp_mutation(_evil_note, extra={"note": "hello"}),
        ".metadata",
        OUTSIDE,
    ),
    Case(
        "dcp-dev-zero",
        _dcp_mutation(
            lambda work, m: point(m, "extra.note", relative_path="/dev/zero", offset=0, length=2 << 30),
            extra={"note": "hello"},
        ),
        ".metadata",
        (("regular file", "outside"),),
        isolated=True,
    ),
    Case("dcp-offset-negative", _dcp_mutation(lambda work, m: point(m, "model.w", offset=-8)), SLICED, PAST_END),
    Case(
        "dcp-offset-past-end",
        _dcp_mutation(lambda work, m: point(m, "model.w", offset=1 << 20)),
        SLICED,
        PAST_END,
    ),
    Case(
        "dcp-length-past-end",
        _dcp_mutation(lambda work, m: point(m, "model.w", length=1 << 20)),
        SLICED,
        PAST_END,
    ),
    Case(
        "dcp-storage-int",
        _dcp_mutation(lambda work, m: m.storage_data.__setitem__(storage_key(m, "model.w"), 7)),
        ".metadata",
        NOT_A,
    ),
    # What a DCP .metadata claims about a tensor.
    Case("dcp-size-claim-2g", _dcp_mutation(_claim([2**31])), ".metadata", (("bytes", "uncovered"),), isolated=True),
    Case("dcp-size-claim-256g", _dcp_mutation(_claim([2**38])), ".metadata", (("bytes", "uncovered"),), isolated=True),
    Case(
        "dcp-chunks-empty",
        _dcp_mutation(lambda work, m: setattr(m.state_dict_metadata["model.w"], "chunks", [])),
        ".metadata",
        UNCOVERED,
    ),
    Case("dcp-chunks-overlap", _dcp_mutation(_second_chunk(at=8, length=8)), ".metadata", OVERLAP),
    Case(
        "dcp-chunk-out-of-range",
        _dcp_mutation(_second_chunk(at=12, length=8)),
        ".metadata",
        (("past the end", "outside"),),
    ),
    Case(
        "dcp-planner-path-deep",
        _dcp_mutation(lambda work, m: m.planner_data.__setitem__("model.w", ("model",) + ("x",) * 99_999)),
        ".metadata",
        LIMIT,
        isolated=True,
    ),
    # Files that are not regular files inside the folder.
    Case("hf-symlink-out", symlink_model_safetensors, "model.safetensors", LINK),
    Case("trainer-rng-symlink-out", symlink_rng_state, "rng_state_9.pth", LINK),
    Case("hf-fifo", fifo_model_safetensors, "model.safetensors", NOT_REGULAR, isolated=True),
    Case("trainer-rng-fifo", fifo_rng_state, "rng_state_7.pth", NOT_REGULAR, isolated=True),
    Case("dcp-distcp-fifo", fifo_distcp, "__0_0.distcp", NOT_REGULAR, isolated=True),
    # A Trainer folder's config and state files.
    Case("trainer-auto-map", _config(_remote_code), "config.json", REMOTE_CODE, isolated=True, answer=b"y\n"),
    *[
        Case(f"trainer-architecture-{name.lower()}", _config(_architecture(name)), "config.json", NOT_A_MODEL)
        for name in ("pipeline", "Trainer", "set_seed", "os")
    ],
    Case(
        "trainer-optimizer-groups-not-dicts",
        _trainer_file("optimizer.pt", lambda path, work: hp.torch_saved({"state": {}, "param_groups": [1, 2]}, path)),
        "optimizer.pt",
        (("not a", "not an"),),  # "not an optimizer state_dict"
    ),
    Case("trainer-optimizer-unknown-index", _unknown_state_index, "optimizer.pt", ("999",)),
    Case("trainer-optimizer-truncated", _trainer_file("optimizer.pt", _truncated), "optimizer.pt", NOT_A),
    Case("trainer-optimizer-random-bytes", _trainer_file("optimizer.pt", _random_bytes), "optimizer.pt", NOT_A),
    Case(
        "trainer-scheduler-dag-bomb",
        _trainer_file("scheduler.pt", _overwrite(hp.dag_bomb)),
        "scheduler.pt",
        LIMIT,
        isolated=True,
    ),
    Case(
        "trainer-scheduler-deep",
        _trainer_file("scheduler.pt", _overwrite(hp.deep_nesting)),
        "scheduler.pt",
        LIMIT,
        isolated=True,
    ),
    # Bombs in plain files.
    Case(
        "pt-stride-zero",
        _pt_with(lambda work: {"decoder.expanded": torch.ones(1).expand(2**31)}),
        "weights.pt",
        tensor_bytes("decoder.expanded"),
        isolated=True,
    ),
    Case("safetensors-million-entries", million_entries, "model.safetensors", LIMIT, isolated=True, within_s=60),
    Case("pt-zip-bomb", lambda work: hp.zip_bomb(work / "weights.pt", "w"), "weights.pt", COMPRESSED, isolated=True),
    # Shapes that validate but cannot load.
    Case(
        "safetensors-shape-2e62",
        _safetensors({"w": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}}),
        "model.safetensors",
        OVERFLOW,
    ),
    Case(
        "safetensors-shape-2e63",
        _safetensors({"w": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}),
        "model.safetensors",
        OVERFLOW,
    ),
]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


CASES += hostile_reuse.CASES
BY_ID = {case.id: case for case in CASES}
assert len(BY_ID) == len(CASES), "case ids must be unique"
