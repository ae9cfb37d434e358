"""A tensor of a size no stored tensor has cannot be stored yet: an embedded save hands it to the
store unhashed (hashed once, as it is written) instead of hashing it first to ask about it.
Equal tensors still end up stored once, and tensors of sizes the store holds are hashed first."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import ckptstore.client.api  # noqa: F401  (binds client.api for the name below)
from ckptstore import client
from ckptstore.client.saving import saver as saving
from ckptstore.client.saving import upload as uploading
from ckptstore.service.errors import InvalidInputError
from ckptstore.service.format.bounds import INT64_MAX, MAX_SIZES_PER_QUERY
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.store import Store
from tests.client.shard_files import stored_digests
from tests.client.upload_gate import SmallShardFirst

ROWS = 128  # a 128 x 128 fp32 tensor is 64 KiB: the smallest that may go unhashed


class Spy:
    """Records the keys a save hashes on the client and those it hands to the store unhashed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hashed: list[str] = []
        self.unhashed: list[str] = []
        real_digest_all, real_add = saving.digest_all, uploading.ShardUploader.add_unhashed

        def digest_all(tensors: list[tuple[str, torch.Tensor]], cache: Any, **kwargs: Any) -> list[str]:
            known = kwargs.get("known") or [None] * len(tensors)
            self.hashed += [key for (key, _), digest in zip(tensors, known, strict=True) if digest is None]
            return real_digest_all(tensors, cache, **kwargs)

        def add_unhashed(uploader: Any, index: int, key: str, tensor: torch.Tensor, nbytes: int, **kw: Any) -> None:
            self.unhashed.append(key)
            real_add(uploader, index, key, tensor, nbytes, **kw)

        monkeypatch.setattr(saving, "digest_all", digest_all)
        monkeypatch.setattr(uploading.ShardUploader, "add_unhashed", add_unhashed)


def embedded_store(ckpt: client.Client) -> Store:
    assert isinstance(ckpt.transport, Store)
    return ckpt.transport


class Buffers(nn.Module):
    """Tensors given by name, as buffers."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)


def test_a_first_save_into_an_empty_store_hashes_each_tensor_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 128))  # weights 256 and 128 KiB, small biases
    spy = Spy(monkeypatch)
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model)
        assert sorted(spy.unhashed) == ["model/0.bias", "model/0.weight", "model/1.bias", "model/1.weight"]
        assert spy.hashed == []
        fresh = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 128))
        ckpt.load("run", model=fresh)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_equal_tensors_of_a_new_size_are_still_stored_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    tensors = {
        "zeros_a": torch.zeros(ROWS, ROWS),
        "zeros_b": torch.zeros(ROWS, ROWS),
        "ones_a": torch.ones(ROWS, ROWS),
        "ones_b": torch.ones(ROWS, ROWS),
        "noise": torch.randn(ROWS, ROWS),
    }
    spy = Spy(monkeypatch)
    with client.Client(home=tmp_path, shard_bytes=64 << 10) as ckpt:  # one tensor a shard
        result = ckpt.save("run", Buffers(tensors))
        assert spy.unhashed == ["model/noise"]  # the only one whose sample no other tensor shares
        digests = stored_digests(embedded_store(ckpt).blobs)
        assert len(digests) == len(set(digests)) == 3
        assert result.bytes_new == 3 * ROWS * ROWS * 4


def test_equal_small_tensors_of_a_new_size_go_unhashed_and_are_stored_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small tensors are not told apart by samples: the store writes equal ones once, since
    they all go in one shard."""
    torch.manual_seed(0)
    tensors = {f"zeros_{n}": torch.zeros(64) for n in range(3)} | {f"noise_{n}": torch.randn(64) for n in range(3)}
    spy = Spy(monkeypatch)
    with client.Client(home=tmp_path, shard_bytes=6 * 64 * 4) as ckpt:  # all of them fit one shard
        result = ckpt.save("run", Buffers(tensors))
        assert sorted(spy.unhashed) == sorted(f"model/{name}" for name in tensors) and spy.hashed == []
        digests = stored_digests(embedded_store(ckpt).blobs)
        assert len(digests) == len(set(digests)) == 4
        assert result.bytes_new == 4 * 64 * 4
        loaded = ckpt.load("run").state_dict
    assert loaded is not None and all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())


def test_small_tensors_of_one_size_in_frozen_and_trainable_kinds_are_hashed_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frozen and trainable tensors never share a shard, so equal ones of the two kinds could
    only be told apart by hashing: a size held by both kinds makes both kinds' small tensors
    hashed first (all of a kind's small tensors go one way, so they share one shard)."""
    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False), nn.Linear(4, 1, bias=False))
    model[0].weight.requires_grad_(False)
    with torch.no_grad():
        model[0].weight.zero_()
        model[1].weight.zero_()  # trainable, equal to the frozen one
    spy = Spy(monkeypatch)
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model)
        assert sorted(spy.hashed) == ["model/0.weight", "model/1.weight", "model/2.weight"]
        assert spy.unhashed == []
        digests = stored_digests(embedded_store(ckpt).blobs)
        assert len(digests) == len(set(digests)) == 2


def test_more_small_tensors_than_a_shard_holds_are_hashed_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(saving, "MAX_TENSORS_PER_SHARD", 4)
    tensors = {f"t{n}": torch.full((8,), float(n % 3)) for n in range(5)}  # five of one kind, three distinct
    spy = Spy(monkeypatch)
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", Buffers(tensors))
        assert spy.unhashed == [] and len(spy.hashed) == 5
        digests = stored_digests(embedded_store(ckpt).blobs)
        assert len(digests) == len(set(digests)) == 3


@pytest.mark.parametrize("why", ["more bytes than a shard", "a tied weight", "a size the store holds"])
def test_a_kind_whose_small_tensors_cannot_all_go_unhashed_is_hashed_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """Small tensors of a kind go one way or the other all together: a save does not split them
    between a shard the store hashes and one the client hashed."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 8))  # small weights and biases, one kind
    shard_bytes = 64 << 20
    if why == "more bytes than a shard":
        shard_bytes = 64
    elif why == "a tied weight":
        model.append(nn.Linear(4, 4))
        model[2].weight = model[0].weight
    spy = Spy(monkeypatch)
    with client.Client(home=tmp_path, shard_bytes=shard_bytes) as ckpt:
        if why == "a size the store holds":
            ckpt.save("other", Buffers({"same_size_as_a_bias": torch.zeros(8)}))
            spy.hashed.clear()
            spy.unhashed.clear()
        result = ckpt.save("run", model)
        assert spy.unhashed == [] and sorted(set(spy.hashed)) == sorted(f"model/{k}" for k in model.state_dict())
        assert result.tensors_total == len(model.state_dict())


def test_tensors_of_sizes_the_store_holds_are_hashed_first_and_not_stored_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    base = torch.randn(ROWS, ROWS)
    with client.Client(home=tmp_path) as first:
        first.save("a", Buffers({"base": base}))
    spy = Spy(monkeypatch)
    with client.Client(home=tmp_path) as second:  # a new process: nothing cached
        result = second.save("b", Buffers({"base": base.clone(), "head": torch.randn(2 * ROWS, ROWS)}))
        assert spy.hashed == ["model/base"] and spy.unhashed == ["model/head"]
        assert result.bytes_new == 2 * ROWS * ROWS * 4  # the head only
        digests = stored_digests(embedded_store(second).blobs)
        assert len(digests) == len(set(digests)) == 2


def test_a_client_asks_about_the_sizes_its_last_version_holds_no_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(ROWS, ROWS), nn.Linear(ROWS, 2 * ROWS))
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model)
        asked: list[set[int]] = []
        real = Store.sizes_held
        monkeypatch.setattr(Store, "sizes_held", lambda store, sizes: asked.append(set(sizes)) or real(store, sizes))
        spy = Spy(monkeypatch)
        with torch.no_grad():
            model[0].weight.add_(1)  # changed in place: written unhashed, as the ledger tells
        grown = ckpt.save("run", model, extra={"noise": torch.randn(3 * ROWS, ROWS)})
        assert asked == [{3 * ROWS * ROWS * 4}]  # the new size alone
        assert spy.unhashed == ["model/0.weight", "extra/noise"]
        assert sorted(spy.hashed) == ["model/0.bias", "model/1.bias", "model/1.weight"]  # unchanged: asked about
        assert grown.bytes_new == 4 * ROWS * ROWS * 4
        fresh = nn.Sequential(nn.Linear(ROWS, ROWS), nn.Linear(ROWS, 2 * ROWS))
        ckpt.load("run", model=fresh)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_sizes_a_sweep_took_since_the_last_version_are_stored_again(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(ROWS, ROWS))
    with client.Client(home=tmp_path) as ckpt, client.Client(home=tmp_path) as other:
        ckpt.save("run", model)
        other.delete("run", 1)  # another client deletes the version and sweeps its tensors
        other.gc(grace_seconds=0)
        assert embedded_store(ckpt).sizes_held([ROWS * ROWS * 4]) == set()
        replaced = nn.Sequential(nn.Linear(ROWS, ROWS))  # new tensors: the ledger knows nothing of them
        result = ckpt.save("run", replaced)
        assert result.bytes_new == sum(t.numel() * 4 for t in replaced.state_dict().values())
        fresh = nn.Sequential(nn.Linear(ROWS, ROWS))
        ckpt.load("run", model=fresh)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in replaced.state_dict().items())


def test_over_http_a_tensor_of_a_new_size_goes_unhashed_and_the_server_hashes_it(
    http_client: client.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy(monkeypatch)
    noise = torch.randn(ROWS, ROWS)
    http_client.save("run", Buffers({"noise": noise}))
    assert spy.hashed == [] and spy.unhashed == ["model/noise"]
    assert http_client.transport.missing([tensor_digest("F32", (ROWS, ROWS), noise.numpy().tobytes())]) == []
    loaded = Buffers({"noise": torch.zeros(ROWS, ROWS)})
    http_client.load("run", model=loaded)
    assert torch.equal(loaded.noise, noise)


def test_over_http_to_a_server_taking_no_unhashed_tensors_every_tensor_is_hashed_first(
    http_client: client.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    http_client.transport.takes_unhashed = False  # type: ignore[misc]  (a server that predates them)
    spy = Spy(monkeypatch)
    http_client.save("run", Buffers({"noise": torch.randn(ROWS, ROWS)}))
    assert spy.hashed == ["model/noise"] and spy.unhashed == []


def test_sizes_held_answers_for_the_sizes_stored(tmp_path: Path) -> None:
    with client.Client(home=tmp_path) as ckpt:
        store = embedded_store(ckpt)
        assert store.sizes_held([4, 65536]) == set()
        ckpt.save("run", Buffers({"a": torch.randn(ROWS, ROWS), "b": torch.randn(3)}))
        assert store.sizes_held([12, 65536, 5, 65536]) == {12, 65536}


NOT_SIZES = [[0], [-1], [INT64_MAX + 1], [True], ["5"], [1.0], list(range(1, MAX_SIZES_PER_QUERY + 2))]


@pytest.mark.parametrize("sizes", NOT_SIZES)
def test_sizes_held_refuses_what_is_not_a_size(tmp_path: Path, sizes: list[Any]) -> None:
    with client.Client(home=tmp_path) as ckpt, pytest.raises(InvalidInputError):
        embedded_store(ckpt).sizes_held(sizes)


@pytest.fixture
def http_client(tmp_path: Path) -> Iterator[client.Client]:
    from ckptstore.service.api.app import create_app
    from ckptstore.service.settings import Settings
    from tests.servers import running_server

    settings = Settings(home=tmp_path / "server")
    store = Store.open_home(settings.home_path)
    try:
        with running_server(create_app(store, settings)) as url, client.Client(url) as ckpt:
            yield ckpt
    finally:
        store.close()


KINDS = st.sampled_from(["zeros", "ones", "noise", "noise_copy"])
SPECS = st.tuples(st.sampled_from([ROWS, 2 * ROWS]), KINDS, st.sampled_from([torch.float32, torch.int32]))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(SPECS, max_size=7),
    st.sampled_from([64 << 10, 1 << 20]),
)
def test_a_first_save_stores_each_distinct_tensor_once_and_loads_exactly(
    specs: list[tuple[int, str, torch.dtype]], shard_bytes: int
) -> None:
    """Whatever mix of equal and distinct tensors, sizes and dtypes (equal sizes, other dtypes),
    and however they fall into shards: no digest is stored twice and every tensor loads back."""
    torch.manual_seed(len(specs))
    shared = torch.randn(2 * ROWS, ROWS)
    tensors = {}
    for number, (rows, kind, dtype) in enumerate(specs):
        if kind == "zeros":
            tensor = torch.zeros(rows, ROWS)
        elif kind == "ones":
            tensor = torch.ones(rows, ROWS)
        elif kind == "noise":
            tensor = torch.randn(rows, ROWS)
        else:
            tensor = shared[:rows].clone()
        tensors[f"t{number}"] = tensor.to(dtype) if dtype != torch.float32 else tensor
    with tempfile.TemporaryDirectory() as home, client.Client(home=home, shard_bytes=shard_bytes) as ckpt:
        ckpt.save("run", Buffers(tensors))
        digests = stored_digests(embedded_store(ckpt).blobs)
        assert len(digests) == len(set(digests))
        loaded = ckpt.load("run").state_dict
        assert loaded is not None
        assert set(loaded) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(loaded[name], tensor), name


ACTIONS = st.sampled_from(["keep", "add_in_place", "replace", "replace_with_equal"])
#: 8 rows: 4 KiB, below the digest cache's size, so a background save stages it at every save.
LATER_SPECS = st.tuples(st.sampled_from([8, ROWS]), KINDS, st.sampled_from([torch.float32, torch.int32]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(LATER_SPECS, ACTIONS), min_size=1, max_size=6), st.booleans())
def test_later_saves_send_only_what_changed_and_every_version_loads_exactly(
    specs: list[tuple[tuple[int, str, torch.dtype], str]], blocking: bool
) -> None:
    """Saved, saved again unchanged, then with tensors kept, changed in place, replaced, or
    replaced by an equal new tensor, and saved a third time (every save blocking or not: the
    ledger follows the live tensors, not a background save's staging buffers, and knows the
    sizes the last version holds): no save sends a byte of a tensor that did not change, and
    every version loads exactly."""
    torch.manual_seed(len(specs))
    first = {}
    for number, ((rows, kind, dtype), _) in enumerate(specs):
        tensor = {"zeros": torch.zeros, "ones": torch.ones}.get(kind, torch.randn)(rows, ROWS)
        first[f"t{number}"] = tensor.to(dtype)
    model = Buffers({name: tensor.clone() for name, tensor in first.items()})

    def save(ckpt: client.Client) -> client.SaveResult:
        handle = ckpt.save("run", model, blocking=blocking)
        return handle if isinstance(handle, client.SaveResult) else handle.result()

    with tempfile.TemporaryDirectory() as home, client.Client(home=home) as ckpt:
        save(ckpt)
        assert save(ckpt).bytes_new == 0
        changed_bytes = 0
        for number, (_, action) in enumerate(specs):
            name = f"t{number}"
            live = getattr(model, name)
            if action == "add_in_place":
                live.add_(1)
            elif action == "replace":
                setattr(model, name, torch.randn(live.shape).to(live.dtype))
            elif action == "replace_with_equal":
                setattr(model, name, live.clone())
            if action in ("add_in_place", "replace"):
                changed_bytes += live.numel() * live.element_size()
        second = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        assert save(ckpt).bytes_new <= changed_bytes
        for version, expected in ((1, first), (2, first), (3, second)):
            loaded = ckpt.load("run", version).state_dict
            assert loaded is not None and set(loaded) == set(expected)
            for name, tensor in expected.items():
                assert torch.equal(loaded[name], tensor), (version, name)


def test_the_small_tensors_shard_goes_beside_the_large_ones_not_after_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one upload in flight, a large tensors' shard here waits until the store has taken the
    small tensors' shard. Sent after the large ones, in a turn of its own, it never would be."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))  # 256 KiB weights, 1 KiB biases
    gate = SmallShardFirst(Store.put_tensors, saving.UNSEEN_MIN_BYTES)
    monkeypatch.setattr(Store, "put_tensors", gate)
    monkeypatch.setattr(client.api, "UPLOADS_IN_FLIGHT", 1)
    with client.Client(home=tmp_path, shard_bytes=256 << 10) as ckpt:  # a shard for each weight
        result = ckpt.save("run", model)
        loaded = ckpt.load("run").state_dict
    assert sorted(gate.sent) == ["large", "large", "small"] and result.shards == 3
    assert loaded is not None and all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
