"""The checks of a DCP ``.metadata``'s layout before any data is read (:mod:`client.formats.dcp.cover`):
chunks that cover a tensor exactly once, whatever their layout and however many dimensions, checked
against counting every element; items that read disjoint bytes, checked against comparing every pair;
and both in a real folder, with each tensor charged to the import's budget before it is made."""

from __future__ import annotations

import itertools
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.client.formats import budget
from ckptstore.client.formats.dcp.cover import check_cover, check_regions
from ckptstore.client.formats.dcp.folder import read_dcp_folder
from ckptstore.service.errors import InvalidInputError
from tests.cli import hostile_dcp_reuse as hostile
from tests.cli import hostile_pickles as hp
from tests.cli.import_kit import dcp_folder, metadata_of, point, storage_key

Box = tuple[tuple[int, ...], tuple[int, ...]]
Layout = tuple[tuple[int, ...], list[Box]]


def brute_force(size: tuple[int, ...], boxes: list[Box]) -> str:
    """What is wrong with ``boxes`` as a cover of ``size``, by counting every element."""
    if any(any(o + s > d for o, s, d in zip(off, sz, size, strict=True)) for off, sz in boxes):
        return "outside"
    count = np.zeros(size, dtype=np.int64)
    for off, sz in boxes:
        count[tuple(slice(o, o + s) for o, s in zip(off, sz, strict=True))] += 1
    if (count > 1).any():
        return "overlap"
    if count.size and (count == 0).any():
        return "uncovered"
    return "ok"


def agrees(size: tuple[int, ...], boxes: list[Box]) -> str:
    """Assert that :func:`check_cover` accepts exactly what :func:`brute_force` finds valid, and names
    what it finds wrong; the verdict."""
    expected = brute_force(size, boxes)
    if expected == "ok":
        check_cover(size, boxes, "t")
    else:
        with pytest.raises(InvalidInputError, match=expected):
            check_cover(size, boxes, "t")
    return expected


@st.composite
def guillotine(draw: st.DrawFn, max_dims: int = 6, max_side: int = 5, max_cuts: int = 12) -> Layout:
    """An exact tiling that need not be a grid: the tensor's box, split again and again at a random box,
    dimension and point."""
    size = tuple(draw(st.lists(st.integers(1, max_side), min_size=1, max_size=max_dims)))
    boxes: list[Box] = [((0,) * len(size), size)]
    for _ in range(draw(st.integers(0, max_cuts))):
        offsets, sizes = boxes.pop(draw(st.integers(0, len(boxes) - 1)))
        dim = draw(st.integers(0, len(size) - 1))
        if sizes[dim] < 2:
            boxes.append((offsets, sizes))
            continue
        at = draw(st.integers(1, sizes[dim] - 1))
        low = sizes[:dim] + (at,) + sizes[dim + 1 :]
        high_offsets = offsets[:dim] + (offsets[dim] + at,) + offsets[dim + 1 :]
        high = sizes[:dim] + (sizes[dim] - at,) + sizes[dim + 1 :]
        boxes += [(offsets, low), (high_offsets, high)]
    return size, draw(st.permutations(boxes))


def pinwheel(extra: int) -> Layout:
    """The 3x3 tiling no straight cut splits (four 2x1 arms around a 1x1 centre), times ``extra`` along a third
    dimension cut in two."""
    arms = [((0, 0), (2, 1)), ((2, 0), (1, 2)), ((1, 2), (2, 1)), ((0, 1), (1, 2)), ((1, 1), (1, 1))]
    depth = [(0, 1), (1, extra)]
    return (3, 3, 1 + extra), [(o + (a,), s + (n,)) for (o, s), (a, n) in itertools.product(arms, depth)]


@st.composite
def damaged(draw: st.DrawFn) -> Layout:
    """A tiling with one chunk shifted, duplicated, removed, grown or shrunk (each kept inside the tensor)."""
    size, boxes = draw(guillotine() | st.sampled_from([pinwheel(1), pinwheel(2)]))
    boxes = list(boxes)
    i = draw(st.integers(0, len(boxes) - 1))
    offsets, sizes = boxes[i]
    dim = draw(st.integers(0, len(size) - 1))
    how = draw(st.sampled_from(["shift", "duplicate", "remove", "grow", "shrink"]))
    if how == "duplicate":
        boxes.append(boxes[i])
    elif how == "remove":
        del boxes[i]
    else:
        step = draw(st.sampled_from([-2, -1, 1, 2]))
        changed = list(offsets if how == "shift" else sizes)
        changed[dim] = max(0, changed[dim] + step)
        boxes[i] = (tuple(changed), sizes) if how == "shift" else (offsets, tuple(changed))
    return size, boxes


@st.composite
def anything(draw: st.DrawFn) -> Layout:
    """Random boxes in up to 4 dimensions, some empty, some past the edge."""
    size = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=4)))
    boxes = []
    for _ in range(draw(st.integers(0, 8))):
        offsets = tuple(draw(st.integers(0, d)) for d in size)
        sizes = tuple(draw(st.integers(0, d + 1)) for d in size)
        boxes.append((offsets, sizes))
    return size, boxes


@settings(max_examples=400, deadline=None)
@given(layout=guillotine())
def test_every_tiling_is_accepted_grid_or_not(layout: Layout) -> None:
    assert agrees(*layout) == "ok"


@pytest.mark.parametrize("extra", [1, 3])
def test_a_tiling_no_straight_cut_splits_is_accepted(extra: int) -> None:
    assert agrees(*pinwheel(extra)) == "ok"


@settings(max_examples=600, deadline=None)
@given(layout=damaged() | anything())
def test_chunks_are_refused_exactly_when_counting_finds_them_wrong(layout: Layout) -> None:
    agrees(*layout)


def test_moving_a_chunk_onto_its_neighbour_keeps_the_count_and_is_still_an_overlap() -> None:
    size, boxes = pinwheel(2)
    boxes[-1] = ((1, 1, 0), boxes[-1][1])  # the centre's upper half, onto its lower half
    assert sum(int(np.prod(s)) for _, s in boxes) == int(np.prod(size))
    assert agrees(size, boxes) == "overlap"


def grid(size: tuple[int, ...], cuts: int) -> list[Box]:
    """``size`` cut ``cuts`` times on every dimension, at evenly spread points."""
    spans = []
    for d in size:
        edges = sorted({0, d, *(d * (i + 1) // (cuts + 1) for i in range(cuts))})
        spans.append([(a, b - a) for a, b in itertools.pairwise(edges)])
    return [(tuple(a for a, _ in combo), tuple(n for _, n in combo)) for combo in itertools.product(*spans)]


@pytest.mark.parametrize(("size", "cuts"), [((1 << 20,) * 4, 15), ((64,) * 8, 3), ((2,) * 16, 1)])
def test_65536_chunks_in_many_dimensions_are_checked_in_well_under_seconds(size: tuple[int, ...], cuts: int) -> None:
    boxes = grid(size, cuts)
    assert len(boxes) == 1 << 16
    started = time.monotonic()
    check_cover(size, boxes, "t")
    last_offsets, last_sizes = boxes[-1]
    boxes[-1] = ((*last_offsets[:-1], last_offsets[-1] - 1), last_sizes)  # onto its neighbour: the count holds
    with pytest.raises(InvalidInputError, match="overlap"):
        check_cover(size, boxes, "t")
    assert time.monotonic() - started < 10  # a pairwise sweep takes minutes; this takes about a second


Region = tuple[str, int, int, int]


def conflicts(a: Region, b: Region) -> bool:
    """Two regions of one file that share a byte, or start at the same byte."""
    return a[0] == b[0] and (a[1] == b[1] or (a[1] < b[1] + b[2] and b[1] < a[1] + a[2]))


@st.composite
def regions(draw: st.DrawFn) -> list[Region]:
    """Items of up to two files: some laid end to end, some anywhere (empty ones too)."""
    found: list[Region] = []
    at = {"a": 0, "b": 0}
    for item in range(draw(st.integers(0, 12))):
        file = draw(st.sampled_from(["a", "b"]))
        length = draw(st.integers(0, 6))
        offset = at[file] if draw(st.booleans()) else draw(st.integers(0, 40))
        at[file] = max(at[file], offset + length)
        found.append((file, offset, length, item))
    return draw(st.permutations(found))


@settings(max_examples=600, deadline=None)
@given(layout=regions())
def test_items_are_refused_exactly_when_two_read_the_same_bytes(layout: list[Region]) -> None:
    expected = any(conflicts(a, b) for a, b in itertools.combinations(layout, 2))
    if expected:
        with pytest.raises(InvalidInputError, match="reuse"):
            check_regions(layout, lambda item: f"item {item}", "m")
    else:
        check_regions(layout, lambda item: f"item {item}", "m")


def write_chunked(folder: Path, size: tuple[int, ...], boxes: list[Box], regions: list[int] | None = None) -> Any:
    """A DCP folder of tensor ``w`` (float32 ``size``, values 0, 1, 2, …) stored in ``boxes``, each chunk its own
    item; ``regions[i]`` makes chunk ``i`` read chunk ``regions[i]``'s item instead. The tensor."""
    import pickle  # noqa: TID251 - writing the metadata this test makes

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    whole = torch.arange(int(np.prod(size)), dtype=torch.float32).reshape(size)
    blobs, places = b"", []
    for offsets, sizes in boxes:
        piece = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].clone()
        blob = hp.torch_saved_bytes(piece)
        places.append((len(blobs), len(blob)))
        blobs += blob
    regions = regions or list(range(len(boxes)))
    storage = {
        MetadataIndex("w", torch.Size(offsets), i): _StorageInfo("__0_0.distcp", *places[regions[i]])
        for i, (offsets, _) in enumerate(boxes)
    }
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(blobs)
    metadata = Metadata(
        {"w": hostile.tensor_entry(size, [(torch.Size(o), torch.Size(s)) for o, s in boxes])}, storage_data=storage
    )
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))  # noqa: TID251 - the file under test
    return whole


def test_a_tensor_in_chunks_no_straight_cut_splits_reads_back_bitwise(tmp_path: Path) -> None:
    size, boxes = pinwheel(2)
    whole = write_chunked(tmp_path / "ckpt", size, boxes)
    assert torch.equal(read_dcp_folder(tmp_path / "ckpt")["w"], whole)


def test_two_chunks_reading_one_item_are_refused_before_any_read(tmp_path: Path) -> None:
    write_chunked(tmp_path / "ckpt", (4, 2), [((0, 0), (2, 2)), ((2, 0), (2, 2))], regions=[0, 0])
    with pytest.raises(InvalidInputError, match=r"\.metadata: chunk \[2, 0\] of tensor 'w' .* reuse"):
        read_dcp_folder(tmp_path / "ckpt")


def test_a_byte_entry_reading_a_tensor_chunk_is_refused(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder = dcp_folder(tmp_path / "ckpt", extra={"note": "hello"})
    with metadata_of(folder) as metadata:
        info = metadata.storage_data[storage_key(metadata, "model.w")]
        point(metadata, "extra.note", offset=info.offset + 8, length=info.length)
    with pytest.raises(InvalidInputError, match="'extra.note'.*overlap.*'model.w'|'model.w'.*overlap.*'extra.note'"):
        read_dcp_folder(folder)


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (lambda work: hostile.chunks_reuse_one_item(work, count=8, numel=4), "reuse"),
        (lambda work: hostile.byte_entries_reuse_one_item(work, count=3, numbers=10), "reuse"),
        (hostile.metadata_layout_bomb, "layout"),
        (lambda work: hostile.chunks_many_dims_overlap(work, dims=6), "overlap"),
    ],
    ids=["chunks-reuse", "byte-entries-reuse", "layout-bomb", "many-dims-overlap"],
)
def test_the_hostile_folders_small_are_refused_quickly(tmp_path: Path, build: Any, says: str) -> None:
    folder = build(tmp_path)
    started = time.monotonic()
    with pytest.raises(InvalidInputError, match=says) as refused:
        read_dcp_folder(folder)
    assert ".metadata" in str(refused.value) and time.monotonic() - started < 5


def test_a_tensor_put_together_from_chunks_is_charged_before_it_is_made(tmp_path: Path) -> None:
    numel = 1 << 19  # 2 MiB of float32, past the 1 MiB a source this small may make with a tiny multiple
    write_chunked(tmp_path / "ckpt", (numel,), [((0,), (numel // 2,)), ((numel // 2,), (numel // 2,))])
    with (
        budget.budgeted(tmp_path / "ckpt", 1e-6),
        pytest.raises(InvalidInputError, match=r"\.metadata: tensor 'w'.*limit"),
    ):
        read_dcp_folder(tmp_path / "ckpt")
    with budget.budgeted(tmp_path / "ckpt") as allowed:
        assert read_dcp_folder(tmp_path / "ckpt")["w"].numel() == numel
    assert allowed.made >= numel * 4
