"""DCP folders read by ckptstore's own reader: exact chunk cover, confined paths, and mutated
metadata that either reads back the same state or is refused with ``InvalidInputError``."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle  # noqa: TID251 - rewriting the metadata this test wrote itself; never a user's file
import shutil
import tempfile
from pathlib import Path, PosixPath
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ckptstore.client.formats.dcp.folder import check_cover, read_dcp_folder
from ckptstore.service.errors import InvalidInputError

Box = tuple[tuple[int, ...], tuple[int, ...]]


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


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    size = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    boxes = []
    for _ in range(draw(st.integers(0, 6))):
        offsets = tuple(draw(st.integers(0, max(d, 0))) for d in size)
        sizes = tuple(draw(st.integers(0, d + 1)) for d in size)
        boxes.append((offsets, sizes))
    return size, boxes


@st.composite
def tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """An exact grid tiling of a random shape, cut at random points on each dimension."""
    size = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    cuts = [sorted({0, d, *draw(st.lists(st.integers(1, d), max_size=2))}) for d in size]
    boxes: list[Box] = [((), ())]
    for edges in cuts:
        spans = [(a, b - a) for a, b in zip(edges, edges[1:], strict=False)]
        boxes = [(off + (a,), sz + (n,)) for off, sz in boxes for a, n in spans]
    return size, draw(st.permutations(boxes))


@settings(max_examples=500, deadline=None)
@given(layout=layouts() | tilings())
def test_chunks_are_accepted_exactly_when_they_cover_the_tensor_once(layout: tuple[Any, list[Box]]) -> None:
    size, boxes = layout
    expected = brute_force(size, boxes)
    if expected == "ok":
        check_cover(size, boxes, "t")
    else:
        with pytest.raises(InvalidInputError, match=expected):
            check_cover(size, boxes, "t")


@settings(max_examples=100, deadline=None)
@given(layout=tilings(), drop=st.integers(0, 100))
def test_a_tiling_missing_one_chunk_is_uncovered(layout: tuple[Any, list[Box]], drop: int) -> None:
    size, boxes = layout
    check_cover(size, boxes, "t")
    del boxes[drop % len(boxes)]
    with pytest.raises(InvalidInputError, match="uncovered"):
        check_cover(size, boxes, "t")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A real DCP folder: tensors of several dtypes, a 0-dim one, nested names and byte items."""
    torch.manual_seed(0)
    state = {
        "model": {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.int64), "s": torch.tensor(2.5)},
        "optim": {"state": {"w": {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]},
        "extra": {"note": "hi", "l": [1, 2]},
    }
    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    dcp.save(copy.deepcopy(state), checkpoint_id=folder, no_dist=True)
    return folder, state


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_a_real_dcp_folder_reads_back_bitwise(saved: tuple[Path, dict[str, Any]]) -> None:
    folder, state = saved
    assert equal(read_dcp_folder(folder), state)


HOSTILE_PATHS = [
    "../outside.distcp", "/etc/passwd", "/dev/zero", "sub/../../x", "", ".", "..", "a\x00b", "..\\x",
    PosixPath("/etc/passwd"), 7, None, b"__0_0.distcp",
]  # fmt: skip


def rewrite(source: Path, target: Path, mutate: Any) -> None:
    """A copy of the folder ``source`` whose metadata ``mutate`` changed (in place)."""
    shutil.copytree(source, target)
    metadata = pickle.loads((source / ".metadata").read_bytes())  # noqa: S301 - this test's own file
    mutate(metadata)
    (target / ".metadata").write_bytes(pickle.dumps(metadata))


@st.composite
def mutations(draw: st.DrawFn) -> Any:
    """One change to a metadata object: a field replaced by something hostile or merely different."""
    what = draw(st.sampled_from(["path", "offset", "length", "size", "chunk", "dtype", "planner", "drop"]))
    pick = draw(st.integers(0, 1000))
    number = draw(st.sampled_from([-1, 0, 1, 7, 2**31, 2**63 - 1, 2**64, "1", 1.5, None]))
    path = draw(st.sampled_from(HOSTILE_PATHS))
    planner_path = draw(st.sampled_from(["deep", (0, "x"), ("model", -1), "x", ()]))

    def mutate(metadata: Any) -> None:
        infos = list(metadata.storage_data.items())
        key, info = infos[pick % len(infos)]
        tensors = [k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")]
        fqn = tensors[pick % len(tensors)]
        entry = metadata.state_dict_metadata[fqn]
        if what == "path":
            metadata.storage_data[key] = _StorageInfo(path, info.offset, info.length)
        elif what in ("offset", "length"):
            metadata.storage_data[key] = dataclasses.replace(info, **{what: number})
        elif what == "size":
            entry.size = torch.Size([2**31]) if pick % 2 else torch.Size([*entry.size, 2])
        elif what == "chunk":
            chunk = entry.chunks[0]
            if pick % 3 == 0:
                entry.chunks = []
            elif pick % 3 == 1:
                entry.chunks = [chunk, chunk]
            else:
                chunk.sizes = torch.Size([s + 1 for s in chunk.sizes])
        elif what == "dtype":
            entry.properties.dtype = torch.float16
        elif what == "planner":
            metadata.planner_data[fqn] = (fqn,) * 100_000 if planner_path == "deep" else planner_path
        else:
            del metadata.storage_data[key]

    return what, mutate


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=mutations())
def test_mutated_metadata_reads_the_same_state_or_is_refused(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, mutation: tuple[str, Any]
) -> None:
    folder, state = saved
    what, mutate = mutation
    (tmp_path / "outside.distcp").write_bytes(b"secret")
    target = Path(tempfile.mkdtemp(dir=tmp_path)) / "ckpt"
    rewrite(folder, target, mutate)
    try:
        got = read_dcp_folder(target)
    except InvalidInputError:
        return
    if what not in ("offset", "length"):  # a region moved onto another whole item reads that item's bytes
        assert equal(got, state)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_data_files_must_be_regular_files_inside_the_folder(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, kind: str
) -> None:
    folder, _ = saved
    target = tmp_path / "ckpt"
    shutil.copytree(folder, target)
    data = target / "__0_0.distcp"
    outside = tmp_path / "outside.distcp"
    shutil.move(data, outside)
    if kind == "symlink":
        data.symlink_to(outside)
    else:
        os.mkfifo(data)
    with pytest.raises(InvalidInputError, match="link that points outside|not a regular file"):
        read_dcp_folder(target)
