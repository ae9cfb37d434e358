"""Loads read straight into their destinations, in bounded pieces, hashed as they arrive."""

from __future__ import annotations

import random
import threading
from contextlib import closing
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import ckptstore.client.loading.reader as reader_module
from ckptstore import client
from ckptstore.client.loading.reader import TensorReader
from tests.client.conftest import Backend
from tests.client.models import TinyNet
from tests.client.test_integrity import rewrite, trainable_shard


class Wide(nn.Module):
    """One tensor far bigger than a read unit beside small ones, with odd sizes."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.small = nn.Parameter(torch.randn(3, generator=generator))
        self.big = nn.Parameter(torch.randn(4099, generator=generator))
        self.steps = nn.Buffer(torch.arange(7, dtype=torch.int64) + seed)
        self.low = nn.Parameter(torch.randn(33, generator=generator).to(torch.float16))


@pytest.fixture
def small_units(monkeypatch: pytest.MonkeyPatch) -> int:
    """Reads of 1000 bytes: ``Wide.big`` spans 17 of them and a read covers several tensors."""
    monkeypatch.setattr(reader_module, "UNIT_BYTES", 1000)
    return 1000


def read_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("ckptstore-read")]


def assert_same_values(left: nn.Module, right: nn.Module) -> None:
    ours, theirs = left.state_dict(), right.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_parameters_are_filled_in_place(ckpt: client.Client) -> None:
    ckpt.save("run", TinyNet(seed=0))
    model = TinyNet(seed=1)
    before = {name: (tensor, tensor.data_ptr()) for name, tensor in model.state_dict(keep_vars=True).items()}
    assert not torch.equal(model.body[0].weight, TinyNet(seed=0).body[0].weight)
    ckpt.load("run", model=model)
    after = model.state_dict(keep_vars=True)
    for name, (tensor, pointer) in before.items():
        assert after[name] is tensor and tensor.data_ptr() == pointer, name
    assert_same_values(model, TinyNet(seed=0))
    assert model.head.weight is model.embed.weight  # the tie survives


def test_a_tensor_spanning_many_reads_round_trips(ckpt: client.Client, small_units: int) -> None:
    ckpt.save("run", Wide(seed=0))
    model = Wide(seed=1)
    assert not torch.equal(model.big, Wide(seed=0).big)
    result = ckpt.load("run", model=model)
    assert_same_values(model, Wide(seed=0))
    assert result.bytes_read == sum(t.numel() * t.element_size() for t in Wide().state_dict().values())
    loaded = ckpt.load("run").state_dict
    assert loaded is not None
    for name, tensor in Wide(seed=0).state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_tied_weights_are_read_once_and_never_aliased(ckpt: client.Client) -> None:
    ckpt.save("run", TinyNet())
    loaded = ckpt.load("run").state_dict
    assert loaded is not None
    assert torch.equal(loaded["head.weight"], loaded["embed.weight"])
    assert loaded["head.weight"].data_ptr() != loaded["embed.weight"].data_ptr()


def test_keys_sharing_a_digest_get_their_own_destinations(tmp_path: Path) -> None:
    with client.Client(home=tmp_path / "store") as ckpt:
        ckpt.save_state_dict("run", {"a": torch.ones(5), "b": torch.ones(5), "c": torch.zeros(5)})
        reader = TensorReader(ckpt.transport, ckpt.transport.manifest("run"))
        first, second = torch.zeros(5), torch.zeros(5)
        got = dict(reader.read_many(["model/a", "model/b", "model/c"], into={"model/a": first, "model/b": second}))
    assert got["model/a"] is first and got["model/b"] is second
    assert torch.equal(first, torch.ones(5)) and torch.equal(second, torch.ones(5))
    assert torch.equal(got["model/c"], torch.zeros(5))
    assert reader.bytes_read == 2 * 5 * 4  # the shared digest is read once


def test_a_destination_shared_by_two_stored_tensors_gets_the_later_one(tmp_path: Path) -> None:
    """Two names tied in the model but stored apart: the read of the second never races the first's hash."""
    with client.Client(home=tmp_path / "store") as ckpt:
        ckpt.save_state_dict("run", {"a": torch.full((300,), 1.0), "b": torch.full((300,), 2.0)})
        reader = TensorReader(ckpt.transport, ckpt.transport.manifest("run"))
        shared = torch.zeros(300)
        keys = sorted(reader.entries)
        order = [key for key, _ in reader.read_many(keys, into={key: shared for key in keys})]
        last = reader.entries[order[-1]]
    assert torch.equal(shared, torch.full((300,), 1.0 if last.key.endswith("a") else 2.0))


def test_partly_overlapping_destinations_are_filled_in_storage_order(tmp_path: Path) -> None:
    with client.Client(home=tmp_path / "store") as ckpt:
        ckpt.save_state_dict("run", {"a": torch.full((1000,), 1.0), "b": torch.full((1000,), 2.0)})
        reader = TensorReader(ckpt.transport, ckpt.transport.manifest("run"))
        memory = torch.zeros(1500)
        into = {"model/a": memory[:1000], "model/b": memory[500:]}
        order = [key for key, _ in reader.read_many(["model/a", "model/b"], into=into)]
    later = 1.0 if order[-1] == "model/a" else 2.0
    assert torch.equal(into[order[-1]], torch.full((1000,), later))


def test_a_wrong_destination_is_refused(tmp_path: Path) -> None:
    with client.Client(home=tmp_path / "store") as ckpt:
        ckpt.save_state_dict("run", {"w": torch.ones(4, 4)})
        reader = TensorReader(ckpt.transport, ckpt.transport.manifest("run"))
        (key,) = reader.entries
        for wrong in (torch.zeros(4, 4, dtype=torch.float64), torch.zeros(16), torch.zeros(4, 4).t()):
            with pytest.raises(client.InvalidInputError, match=key):
                list(reader.read_many([key], into={key: wrong}))


def test_a_corrupt_byte_in_a_big_tensor_names_it_and_stops_reading(
    backend: Backend, tmp_path: Path, small_units: int
) -> None:
    backend.client.save("run", Wide(seed=0))
    manifest = backend.client.transport.manifest("run")
    digest = next(e.digest for e in manifest.tensors if e.key == "model/big")
    assert digest is not None
    where = backend.client.transport.locate([digest])[digest]

    def flip(data: bytearray) -> bytes:
        data[where.offset + random.Random(1).randrange(where.nbytes)] ^= 0x10
        return bytes(data)

    rewrite(backend.blobs, trainable_shard(backend.blobs), tmp_path / "corrupt", flip)
    model = Wide(seed=1)
    with pytest.raises(client.IntegrityError, match=rf"model/big: bytes read from shard {where.shard_id} at offset"):
        backend.client.load("run", model=model)
    assert read_threads() == []


def test_an_abandoned_read_stops_its_thread(ckpt: client.Client, small_units: int) -> None:
    ckpt.save("run", Wide())
    reader = TensorReader(ckpt.transport, ckpt.transport.manifest("run"))
    with closing(reader.read_many(sorted(reader.entries))) as stream:
        next(stream)
        assert len(read_threads()) == 1
    assert read_threads() == []


def test_a_missing_shard_mid_load_stops_the_thread(backend: Backend) -> None:
    backend.client.save("run", Wide())
    backend.blobs.delete(trainable_shard(backend.blobs))
    with pytest.raises(client.NotFoundError):
        backend.client.load("run", model=Wide(seed=1))
    assert read_threads() == []


def test_a_cast_or_non_contiguous_target_is_copied_into(ckpt: client.Client) -> None:
    ckpt.save("run", Wide(seed=0))
    model = Wide(seed=1)
    model.low.data = model.low.data.float()  # stored F16, held as F32: read fresh, then cast
    strided = torch.zeros(4099 * 2)[::2]
    model.big.data = strided
    result = ckpt.load("run", model=model)
    assert model.big.data_ptr() == strided.data_ptr()
    assert torch.equal(model.big, Wide(seed=0).big)
    assert torch.equal(model.low, Wide(seed=0).low.float())
    assert result.casts == ["model/low: float16 -> float32"]


def test_a_frozen_tensor_loaded_in_place_is_hashed_again_on_the_next_save(tmp_path: Path) -> None:
    with client.Client(home=tmp_path / "store") as ckpt:
        model = Wide(seed=0).requires_grad_(False)
        ckpt.save("run", model)
        ckpt.save("other", Wide(seed=1))
        ckpt.load("other", model=model)
        ckpt.save("run", model)
        loaded = ckpt.load("run").state_dict
    assert loaded is not None
    assert torch.equal(loaded["big"], Wide(seed=1).big)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), max_size=12))
def test_partly_overlapping_spans_are_those_meeting_a_different_span(raw: list[tuple[int, int]]) -> None:
    spans = [(start, start + length) for start, length in raw]
    expected = {
        span for span in spans for other in spans if other != span and span[0] < other[1] and other[0] < span[1]
    }
    assert reader_module._partly_overlapping(spans) == expected
    shared = any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1 :])
    assert reader_module._apart(spans) is not shared  # equal spans share their bytes too


@st.composite
def shared_layouts(draw: st.DrawFn) -> tuple[list[int], dict[int, int | None]]:
    """Which stored value each of several keys holds (keys may share one), and which memory slot,
    if any, each key is read into (keys may share a slot)."""
    count = draw(st.integers(1, 8))
    values = draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    slots = draw(st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=count, max_size=count))
    return values, dict(enumerate(slots))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=shared_layouts())
def test_keys_sharing_digests_and_destinations_each_get_their_stored_value(
    tmp_path_factory: pytest.TempPathFactory, layout: tuple[list[int], dict[int, int | None]]
) -> None:
    """Equal digests read once, destinations shared or not, given to the first key or a later one:
    every key yields its own stored value, into its destination when that memory is its alone."""
    values, slots = layout
    stored = {f"k{i}": torch.full((64,), float(value)) for i, value in enumerate(values)}
    with client.Client(home=tmp_path_factory.mktemp("store")) as ckpt:
        ckpt.save_state_dict("run", stored)
        reader = TensorReader(ckpt.transport, ckpt.transport.manifest("run"))
        memory = [torch.full((64,), -1.0) for _ in range(4)]
        into = {f"model/k{i}": memory[slot] for i, slot in slots.items() if slot is not None}
        keys = [f"model/k{i}" for i in range(len(values))]
        batches = list(reader.read_batches(keys, into=into))
        again = TensorReader(ckpt.transport, ckpt.transport.manifest("run"))
        flat = [key for key, _ in again.read_many(keys, into=into)]
    got = [pair for batch in batches for pair in batch]
    assert [key for key, _ in got] == flat and sorted(flat) == sorted(keys)
    sharing = {slot: sum(1 for s in slots.values() if s == slot) for slot in set(slots.values())}
    for key, tensor in got:
        index = int(key.removeprefix("model/k"))
        slot = slots[index]
        if slot is not None:
            assert tensor is memory[slot], key
        if slot is None or sharing[slot] == 1:
            assert torch.equal(tensor, torch.full((64,), float(values[index]))), key
    owners = [key for key, tensor in got if slots[int(key.removeprefix("model/k"))] is None]
    pointers = [tensor.data_ptr() for key, tensor in got if key in owners]
    assert len(set(pointers)) == len(pointers)  # fresh tensors never alias one another
