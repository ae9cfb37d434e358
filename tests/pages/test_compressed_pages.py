"""The pages over tensors compressed at rest: downloads and value comparisons read decoded bytes."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ckptstore.service.store import Store
from tests.pages.dom import parse
from tests.pages.kit import Raw, commit, page_client

#: Elements per tensor: 256 KiB of float32, above the size compression leaves raw.
COUNT = 1 << 16
#: The elements version 2 moves, and by how much.
MOVED = range(0, COUNT, 7)
STEP = 0.25


def floats(values: list[float]) -> Raw:
    return Raw("F32", (len(values),), struct.pack(f"<{len(values)}f", *values))


# Weights with random mantissas (a keyframe compresses them little), of which version 2 moves a
# seventh by exact steps (its difference from version 1 is mostly zeros).
WEIGHTS_1 = [float((i * 2654435761) % 4093) / 64 for i in range(COUNT)]
WEIGHTS_2 = [value + STEP if i % 7 == 0 else value for i, value in enumerate(WEIGHTS_1)]
W1, W2 = floats(WEIGHTS_1), floats(WEIGHTS_2)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run 'tuned': two versions of one 256 KiB tensor, compressed (the second as a delta of the first)."""
    folder = tmp_path_factory.mktemp("compressed") / "home"
    store = Store.open_home(folder)
    try:
        for weights in (W1, W2):
            commit(store, "tuned", {"model/w": (weights, {"trainable": True})})
        report = store.gc(compress=True, grace_seconds=0)
        assert (report.tensors_compressed, report.tensors_as_deltas) == (2, 1)
        locations = store.locate([W1.digest, W2.digest])
        assert locations[W1.digest].encoding == "grouped-zstd"
        assert locations[W2.digest].encoding == "diff-grouped-zstd" and locations[W2.digest].base == W1.digest
        assert all(location.length < location.nbytes for location in locations.values())
    finally:
        store.close()
    return folder


@pytest.fixture
def client(home: Path) -> Iterator[TestClient]:
    with page_client(home) as test_client:
        yield test_client


@pytest.mark.parametrize(("version", "weights"), [(1, W1), (2, W2)])
def test_a_compressed_tensor_downloads_as_its_raw_bytes(client: TestClient, version: int, weights: Raw) -> None:
    doc = parse(client.get(f"/runs/tuned/versions/{version}").text)
    (link,) = [a.attrs["href"] for a in doc.all("a", class_="dl")]
    downloaded = client.get(link)
    assert downloaded.status_code == 200
    assert downloaded.content == weights.data
    assert downloaded.headers["content-length"] == str(4 * COUNT)


def test_the_values_of_a_delta_compare_with_its_base(client: TestClient) -> None:
    table = parse(client.get("/runs/tuned/diff?a=1&b=2&values=1").text).one("table", id="tensors")
    rows = {row[1]: row[6:] for row in table.rows()}
    moved = len(MOVED)
    assert rows["model/w"] == [f"{moved:,} of {COUNT:,} ({100 * moved / COUNT:.1f}%)", "0.25"]
