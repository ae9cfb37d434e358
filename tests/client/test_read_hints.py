"""Read hints for loads of encoded tensors: each payload a load decodes (a delta's keyframe too)
is announced once, a bounded window ahead of its decoding, neighbours merged; a real load of a
compressed fine-tune hints every payload it reads and loads bit for bit.
"""

from __future__ import annotations

import hashlib
import threading
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore import client
from ckptstore.client.loading import decoding
from ckptstore.client.loading.read_hints import ReadHints, merged
from ckptstore.client.loading.reader import TensorReader
from ckptstore.client.store_protocol import Transport
from ckptstore.service.format.records import TensorLocation
from ckptstore.service.store import Store
from tests.client.models import tensors_equal
from tests.service.compression_kit import FineTune, make_model

spans = st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 3_000)), max_size=30)


@given(spans, st.integers(0, 2_000))
def test_merged_spans_are_sorted_apart_by_the_gap_and_cover_exactly_their_inputs(
    given_spans: list[tuple[int, int]], gap: int
) -> None:
    joined = merged(given_spans, gap)
    assert joined == sorted(joined)
    assert all(b[0] - (a[0] + a[1]) >= gap for a, b in zip(joined, joined[1:], strict=False))
    for offset, length in given_spans:  # every input lies inside one output span
        assert any(start <= offset and offset + length <= start + size for start, size in joined)
    starts = {offset for offset, _ in given_spans}
    ends = {offset + length for offset, length in given_spans}
    # Each output span runs from an input's start to an input's end: nothing outside is asked for
    # but the gaps (shorter than ``gap``) between inputs.
    assert all(start in starts and start + size in ends for start, size in joined)


def _digest(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


@st.composite
def located_chains(draw: st.DrawFn) -> tuple[dict[str, TensorLocation], list[str]]:
    """Tensors in decoding order, some raw, some encoded, some deltas on a keyframe of their own."""
    ends = {_digest(-s): 0 for s in range(draw(st.integers(1, 3)))}  # where each shard's bytes end so far

    def place(length: int) -> tuple[str, int]:
        """A shard and an offset for ``length`` bytes after what it holds (payloads never overlap)."""
        shard = draw(st.sampled_from(sorted(ends)))
        offset = ends[shard] + draw(st.integers(0, 3_000))
        ends[shard] = offset + length
        return shard, offset

    locations: dict[str, TensorLocation] = {}
    order = []
    for number in range(draw(st.integers(0, 40))):
        digest, nbytes = _digest(number), draw(st.integers(1, 5_000))
        kind = draw(st.sampled_from(["raw", "encoded", "delta"]))
        base = None
        if kind == "delta":  # its keyframe, stored whole, somewhere in any shard
            base = _digest(10_000 + number)
            locations[base] = _location(base, *place(nbytes), nbytes)
        stored = draw(st.integers(1, nbytes)) if kind != "raw" else None
        locations[digest] = _location(digest, *place(stored or nbytes), nbytes, stored, base)
        order.append(digest)
    return locations, order


def _location(
    digest: str, shard: str, offset: int, nbytes: int, stored: int | None = None, base: str | None = None
) -> TensorLocation:
    encoding = "raw" if stored is None else ("diff-grouped-zstd" if base else "grouped-zstd")
    return TensorLocation(digest, shard, offset, nbytes, "U8", [nbytes], encoding, stored, base)


@settings(max_examples=60, deadline=None)
@given(located_chains(), st.integers(0, 20_000))
def test_every_payload_is_hinted_before_its_tensor_is_decoded_and_never_far_ahead(
    chains: tuple[dict[str, TensorLocation], list[str]], window: int
) -> None:
    locations, order = chains
    asked: dict[str, list[tuple[int, int]]] = defaultdict(list)
    lock = threading.Lock()

    def will_read(shard_id: str, given_spans: Sequence[tuple[int, int]]) -> None:
        with lock:
            asked[shard_id] += given_spans

    def payloads(digest: str) -> list[TensorLocation]:
        location = locations[digest]
        return [location] + ([locations[location.base]] if location.base else [])

    hints = ReadHints(will_read, locations, order, ahead_bytes=window)
    largest = max((sum(p.length for p in payloads(d)) for d in order), default=0)
    try:
        for number in range(len(order)):
            hints.reach(number)
            assert hints.hinted > number  # its own payloads, at least
            ahead = sum(p.length for d in order[number : hints.hinted] for p in payloads(d))
            assert ahead <= window + largest  # never more than the window and one tensor beyond
            if hints.hinted < len(order):
                assert ahead >= window // 2  # and at least half the window while there is more
    finally:
        hints.close()
    for digest in order:  # every payload read, keyframes included, was asked for
        for payload in payloads(digest):
            assert any(
                start <= payload.offset and payload.offset + payload.length <= start + size
                for start, size in asked[payload.shard_id]
            ), digest


class Recorder:
    """A transport that records the payloads read one at a time and the spans hinted."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self.reads: list[tuple[str, int, int]] = []
        self.hints: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def read_into(self, shard_id: str, offset: int, buffer: memoryview) -> None:
        with self._lock:
            self.reads.append((shard_id, offset, buffer.nbytes))
        self._transport.read_into(shard_id, offset, buffer)

    def will_read(self, shard_id: str, spans: Sequence[tuple[int, int]]) -> None:
        with self._lock:
            self.hints += [(shard_id, offset, length) for offset, length in spans]
        self._transport.will_read(shard_id, spans)


def test_a_load_of_a_compressed_fine_tune_hints_every_payload_it_reads(tmp_path: Path) -> None:
    tune = FineTune(torch.bfloat16)
    with client.Client(home=tmp_path) as ckpt:
        tune.save_versions(ckpt, "run", 3)
        ckpt.gc(compress=True, grace_seconds=0)
        recorder = Recorder(ckpt.transport)
        reader = TensorReader(recorder, ckpt.transport.manifest("run", 3))  # type: ignore[arg-type]
        loaded = dict(reader.read_many(reader.entries))
    expected = tune.saved[("run", 3)]
    assert all(tensors_equal(loaded[f"model/{key}"], value) for key, value in expected.model.items())
    encoded = {(loc.shard_id, loc.offset, loc.length) for loc in reader.locations.values() if loc.encoded}
    payload_reads = [read for read in recorder.reads if read in encoded or read[2] > 4096]
    assert len(payload_reads) >= 9  # the weights' deltas and their keyframes, and the moments
    for shard_id, offset, length in payload_reads:
        assert any(
            hinted == shard_id and start <= offset and offset + length <= start + size
            for hinted, start, size in recorder.hints
        ), (offset, length)
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("ckptstore-read-hints")]


def test_hints_a_store_cannot_act_on_change_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blob store takes hints for blobs it lacks, spans past a blob's end or before its start
    without a word; the load that follows reads what is there."""
    tune = FineTune(torch.float32)
    with client.Client(home=tmp_path) as ckpt:
        tune.save(ckpt, "run")
        ckpt.gc(compress=True, grace_seconds=0)
        store = ckpt.transport
        assert isinstance(store, Store)
        shard = next(iter(store.blobs.list_ids()))
        store.blobs.will_read("0" * 64, [(0, 10)])
        store.blobs.will_read(shard, [(-5, 10), (0, -1), (10**12, 10), (0, 10**12)])
        monkeypatch.setattr(decoding, "decode_threads", lambda: 1)
        model = make_model(torch.float32, seed=3)
        ckpt.load("run", 1, model=model)
    assert all(tensors_equal(value, tune.saved[("run", 1)].model[key]) for key, value in model.state_dict().items())
