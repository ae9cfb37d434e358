"""DCP folders whose chunks or byte entries reuse stored items, whose metadata makes work before it is bounded,
or whose chunk layout makes the overlap check slow.

Each case is refused in its own process within :data:`~tests.cli.hostile_case.WITHIN_S` seconds and
:data:`~tests.cli.hostile_case.MAX_RSS_MIB` MiB peak RSS (``isolated=True, within_s=WITHIN_S,
max_rss_mib=MAX_RSS_MIB``).

- ``dcp-chunks-reuse-one-item``: 16,384 chunks that all read one 64 KiB item cover a 1 GiB tensor
  exactly once: a 1.2 MB folder that was read as 1 GiB;
- ``dcp-byte-entries-reuse-one-item``: 40 byte entries that all read one pickled list of a million
  numbers, each entry unpickling it again (seconds and tens of MiB apiece);
- ``dcp-metadata-layout-bomb``: a tensor's layout given as a reference bomb (``x = [x, x]`` forty
  times), which the layout's constructor formatted while the pickle was still being read;
- ``dcp-chunks-many-dims-overlap``: 16,384 chunks cut along 14 dimensions, valid but for the last
  one, moved half onto its neighbour: a sweep of pairs took minutes to find it.
"""

from __future__ import annotations

import pickle  # noqa: TID251 - making the hostile files under test
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from tests.cli import hostile_pickles as hp
from tests.cli.hostile_case import MAX_RSS_MIB, OVERLAP, WITHIN_S, Case, Says

DATA = "__0_0.distcp"
#: The tensor of each case, as DCP names ``state_dict["model"]["w"]``.
WEIGHT = "model.w"
REUSE: Says = ("reuse", "overlap")
LAYOUT: Says = ("layout", "not a")


def _folder(work: Path, data: bytes, metadata: Metadata) -> Path:
    folder = work / "ckpt"
    folder.mkdir()
    (folder / DATA).write_bytes(data)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))  # noqa: TID251 - the hostile file under test
    return folder


def _metadata(entries: dict[str, Any], storage: dict[MetadataIndex, _StorageInfo]) -> Metadata:
    """DCP's metadata of ``entries``, each placed at the key path its dotted name spells, as ``dcp.save`` does."""
    planner = {fqn: tuple(fqn.split(".")) for fqn in entries}
    return Metadata(entries, planner_data=planner, storage_data=storage)


def tensor_entry(size: tuple[int, ...], chunks: list[tuple[torch.Size, torch.Size]]) -> TensorStorageMetadata:
    """A float32 tensor's entry; ``chunks`` as ``torch.Size`` objects, which the pickle writes once however
    often they appear (a chunk's offsets are its storage key's too), keeping the metadata small."""
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(offsets, sizes) for offsets, sizes in chunks],
    )


def _key(fqn: str, offsets: torch.Size, index: int) -> MetadataIndex:
    """The storage key of chunk ``index`` of ``fqn``, holding ``offsets`` itself (DCP would copy it)."""
    key = MetadataIndex(fqn, None, index)
    object.__setattr__(key, "offset", offsets)
    return key


def chunks_reuse_one_item(work: Path, count: int = 1 << 14, numel: int = 1 << 14) -> Path:
    """Tensor ``w`` of ``count * numel`` float32s, its ``count`` chunks all read from one item of ``numel``."""
    blob = hp.torch_saved_bytes(torch.arange(numel, dtype=torch.float32))
    sizes, item = torch.Size([numel]), _StorageInfo(DATA, 0, len(blob))
    chunks = [(torch.Size([i * numel]), sizes) for i in range(count)]
    storage = {_key(WEIGHT, offsets, i): item for i, (offsets, _) in enumerate(chunks)}
    return _folder(work, blob, _metadata({WEIGHT: tensor_entry((count * numel,), chunks)}, storage))


def byte_entries_reuse_one_item(work: Path, count: int = 40, numbers: int = 1 << 20) -> Path:
    """``count`` byte entries ``l0``, ``l1``, … all read from one torch.save'd list of ``numbers`` distinct ints."""
    blob = hp.torch_saved_bytes(list(range(1 << 16, (1 << 16) + numbers)))
    names = [f"extra.l{i}" for i in range(count)]
    storage = {MetadataIndex(name): _StorageInfo(DATA, 0, len(blob)) for name in names}
    return _folder(work, blob, _metadata(dict.fromkeys(names, BytesStorageMetadata()), storage))


class _LayoutBomb:
    """Pickles as ``torch.serialization._get_layout(x)``, ``x`` a list holding itself twice forty levels deep
    (``pickle`` memoizes each level, so a few hundred bytes)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        bomb: list[Any] = []
        for _ in range(40):
            bomb = [bomb, bomb]
        return torch.serialization._get_layout, (bomb,)


def metadata_layout_bomb(work: Path) -> Path:
    """A valid one-chunk tensor whose ``TensorProperties.layout`` is :class:`_LayoutBomb`."""
    blob = hp.torch_saved_bytes(torch.zeros(4))
    entry = tensor_entry((4,), [(torch.Size([0]), torch.Size([4]))])
    entry.properties.layout = _LayoutBomb()  # type: ignore[assignment]
    storage = {MetadataIndex(WEIGHT, torch.Size([0]), 0): _StorageInfo(DATA, 0, len(blob))}
    return _folder(work, blob, _metadata({WEIGHT: entry}, storage))


def chunks_many_dims_overlap(work: Path, dims: int = 14) -> Path:
    """Tensor ``model.w`` of shape ``(2,) * (dims - 1) + (4,)`` in ``2**dims`` chunks of ``(1,) * (dims - 1) + (2,)``,
    each with its own stored item; the last chunk moved one step down on the last dimension, half onto its
    neighbour (so one element is stored twice, the last one not at all, and no two chunks start at one place)."""
    shape, sizes = (2,) * (dims - 1) + (4,), torch.Size((1,) * (dims - 1) + (2,))
    blob = hp.torch_saved_bytes(torch.zeros(sizes))
    corners = [
        (*((i >> (dims - 2 - d)) & 1 for d in range(dims - 1)), last) for i in range(1 << (dims - 1)) for last in (0, 2)
    ]
    corners[-1] = (*corners[-1][:-1], 1)
    chunks = [(torch.Size(corner), sizes) for corner in corners]
    storage = {
        _key(WEIGHT, offsets, i): _StorageInfo(DATA, i * len(blob), len(blob)) for i, (offsets, _) in enumerate(chunks)
    }
    metadata = _metadata({WEIGHT: tensor_entry(shape, chunks)}, storage)
    return _folder(work, blob * len(chunks), metadata)


def _bounded(id: str, build: Any, says: Says) -> Case:
    return Case(id, build, ".metadata", says, isolated=True, within_s=WITHIN_S, max_rss_mib=MAX_RSS_MIB)


CASES: list[Case] = [
    _bounded("dcp-chunks-reuse-one-item", chunks_reuse_one_item, REUSE),
    _bounded("dcp-byte-entries-reuse-one-item", byte_entries_reuse_one_item, REUSE),
    _bounded("dcp-metadata-layout-bomb", metadata_layout_bomb, LAYOUT),
    _bounded("dcp-chunks-many-dims-overlap", chunks_many_dims_overlap, OVERLAP),
]
