"""Frozen tensors are hashed once per process, and any change to them is still noticed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ckptstore import client
from ckptstore.client.saving import hashing
from ckptstore.client.saving.hashing import CACHE_MIN_BYTES, DigestCache, digest_all
from ckptstore.service.errors import StateEncodingError
from tests.client.models import TinyNet


def frozen_model() -> torch.nn.Module:
    model = TinyNet()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_write_to_any_stretch_over_a_32nd_of_a_tensor_changes_its_sample(data: st.DataObject) -> None:
    count = data.draw(st.integers(1, 100_000), label="elements")
    run = hashing.SAMPLE_ELEMENTS // hashing.SAMPLE_RUNS
    spacing = max(1, count // run // hashing.SAMPLE_RUNS) * run  # between the starts of two runs
    length = data.draw(st.integers(min(count, spacing + run), count), label="length")
    start = data.draw(st.integers(0, count - length), label="start")
    tensor = torch.arange(count, dtype=torch.float32)
    before = hashing.sample(tensor)
    assert len(before) >= min(count, hashing.SAMPLE_ELEMENTS) * 4
    tensor[start : start + length] += 0.5
    assert hashing.sample(tensor) != before


def test_unchanged_frozen_tensors_are_not_hashed_again() -> None:
    model = frozen_model()
    cache = DigestCache(min_bytes=0)
    pairs = list(model.state_dict(keep_vars=True).items())
    first = digest_all(pairs, cache)
    assert cache.hits == 0
    second = digest_all(pairs, cache)
    assert second == first
    assert cache.hits == len(pairs)


def test_in_place_changes_are_noticed() -> None:
    model = frozen_model()
    cache = DigestCache()
    pairs = list(model.state_dict(keep_vars=True).items())
    first = digest_all(pairs, cache)
    with torch.no_grad():
        model.body[0].weight.add_(1.0)
    second = digest_all(pairs, cache)
    changed = [key for (key, _), a, b in zip(pairs, first, second, strict=True) if a != b]
    assert changed == ["body.0.weight"]


def test_trainable_tensors_are_never_cached() -> None:
    model = TinyNet()
    cache = DigestCache()
    pairs = [(k, v) for k, v in model.state_dict(keep_vars=True).items() if v.requires_grad]
    digest_all(pairs, cache)
    digest_all(pairs, cache)
    assert cache.hits == 0


def test_replaced_tensor_is_hashed_afresh() -> None:
    model = frozen_model()
    cache = DigestCache()
    digest_all(list(model.state_dict(keep_vars=True).items()), cache)
    model.norm.weight = torch.nn.Parameter(torch.full((16,), 3.0), requires_grad=False)
    pairs = [("norm.weight", model.norm.weight)]
    (digest,) = digest_all(pairs, cache)
    assert cache.hits == 0
    assert digest == digest_all(pairs, None)[0]


def test_a_save_after_an_in_place_edit_stores_the_new_bytes(ckpt: client.Client) -> None:
    model = frozen_model()
    ckpt.save("run", model)
    with torch.no_grad():
        model.norm.weight.mul_(2.0)
    result = ckpt.save("run", model)
    assert result.bytes_new == model.norm.weight.numel() * 4
    loaded = ckpt.load("run").state_dict
    assert loaded is not None and torch.equal(loaded["norm.weight"], model.norm.weight)


def test_small_and_large_tensors_hash_alike_on_any_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "INLINE_BYTES", 64)  # a few tensors go to the pool, the rest stay inline
    generator = torch.Generator().manual_seed(0)
    tied = torch.randn(40, generator=generator)
    tensors = [torch.randn(n, generator=generator) for n in (3, 100, 1, 50, 0, 17, 64)]
    pairs = [(f"t{i}", t) for i, t in enumerate(tensors)] + [("tied", tied), ("again", tied), ("T", tensors[1].t())]
    expected = [hashing.digest_of(tensor, key) for key, tensor in pairs]
    assert digest_all(pairs, None, threads=1) == expected
    assert digest_all(pairs, None, threads=2) == expected
    assert digest_all(pairs, DigestCache(), threads=2) == expected


def test_an_unstorable_small_tensor_fails_while_large_ones_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "INLINE_BYTES", 64)
    pairs = [
        ("big0", torch.zeros(100)),
        ("big1", torch.ones(100)),
        ("bad", torch.zeros(2).to_sparse()),
    ]
    with pytest.raises(StateEncodingError, match="bad"):
        digest_all(pairs, None, threads=2)


def test_a_tensor_whose_data_is_swapped_is_hashed_afresh() -> None:
    model = frozen_model()
    cache = DigestCache()
    pairs = [("norm.weight", model.norm.weight)]
    (first,) = digest_all(pairs, cache)
    model.norm.weight.data = torch.full((16,), 5.0)  # the same object, other storage
    (second,) = digest_all(pairs, cache)
    assert cache.hits == 0
    assert second != first and second == digest_all(pairs, None)[0]


def test_a_changed_tensor_is_remembered_with_its_new_digest() -> None:
    tensor = torch.zeros(8)
    cache = DigestCache(min_bytes=0)
    (first,) = digest_all([("t", tensor)], cache)
    tensor.add_(1.0)
    (second,) = digest_all([("t", tensor)], cache)
    assert cache.hits == 0 and second != first
    assert digest_all([("t", tensor)], cache) == [second]
    assert cache.hits == 1
    tensor.add_(1.0)
    assert digest_all([("t", tensor)], cache) == digest_all([("t", tensor)], None)
    assert cache.hits == 1


def test_known_digests_are_used_as_given() -> None:
    given = "a" * 64
    pairs = [("a", torch.zeros(2)), ("b", torch.ones(2))]
    assert digest_all(pairs, None, known=[given, None]) == [given, digest_all(pairs[1:], None)[0]]


def test_small_tensors_are_always_hashed() -> None:
    cache = DigestCache()
    small, large = torch.zeros(CACHE_MIN_BYTES // 4 - 1), torch.zeros(CACHE_MIN_BYTES // 4)
    pairs = [("small", small), ("large", large)]
    digest_all(pairs, cache)
    digest_all(pairs, cache)
    assert cache.hits == 1


def test_only_tensors_flagged_cacheable_are_cached() -> None:
    cache = DigestCache(min_bytes=0)
    pairs = [("model", torch.zeros(4)), ("optim", torch.ones(4))]
    digest_all(pairs, cache, cacheable=[True, False])
    assert digest_all(pairs, cache, cacheable=[True, False]) == digest_all(pairs, None)
    assert cache.hits == 1


class Frozen(nn.Module):
    """A frozen weight, a plain buffer and a wide BatchNorm, each above the cache's minimum size."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 256).requires_grad_(False)
        self.register_buffer("table", torch.arange(CACHE_MIN_BYTES // 2, dtype=torch.float32))
        self.norm = nn.BatchNorm1d(CACHE_MIN_BYTES // 2).requires_grad_(False)


def change_without_moving_the_version(model: Frozen, how: str) -> str:
    """Change one tensor in place the way ``how`` names; returns its name."""
    if how == "data":  # an EMA update through .data
        model.linear.weight.data.mul_(0.5)
        return "linear.weight"
    if how == "numpy":
        model.table.numpy()[::7] += 1.0
        return "table"
    model.norm.train()  # BatchNorm's running statistics
    model.norm(torch.randn(4, CACHE_MIN_BYTES // 2, generator=torch.Generator().manual_seed(1)))
    return "norm.running_mean"


@pytest.mark.parametrize("how", ["data", "numpy", "batchnorm"])
def test_a_change_that_leaves_the_version_counter_alone_is_still_saved(tmp_path: Path, how: str) -> None:
    torch.manual_seed(0)
    model = Frozen()
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model)
        ckpt.save("run", model)
        assert ckpt.digest_cache is not None and ckpt.digest_cache.hits > 0  # the frozen tensors are cached
        versions = {name: t._version for name, t in model.state_dict().items()}
        name = change_without_moving_the_version(model, how)
        changed = model.state_dict()[name]
        assert changed._version == versions[name]
        third = ckpt.save("run", model)
        assert third.bytes_new >= changed.numel() * 4
        loaded = ckpt.load("run").state_dict
        assert loaded is not None
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded[name], tensor), name


def test_a_fused_optimizer_state_is_saved_after_every_step(tmp_path: Path) -> None:
    # AdamW(fused=True) moves only the step counts' version counters.
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def step() -> None:
        optim.zero_grad()
        model(torch.randn(8, 256)).square().mean().backward()
        optim.step()

    step()
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model, optim)
        moments = optim.state[model.weight]["exp_avg"]
        before = moments._version
        step()
        assert moments._version == before
        ckpt.save("run", model, optim)
        fresh = nn.Linear(256, 256)
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2, fused=True)
        ckpt.load("run", model=fresh, optim=fresh_optim)
        assert torch.equal(fresh.weight, model.weight)
        assert torch.equal(fresh_optim.state[fresh.weight]["exp_avg"], moments)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(
        [
            torch.float32,
            torch.bfloat16,
            torch.float16,
            torch.int64,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.float8_e5m2,
            torch.float64,
        ]
    ),  # fmt: skip
    st.integers(0, 5000),
    st.integers(0, 7),
)
def test_the_sample_read_from_a_tensors_address_is_its_sample(dtype: torch.dtype, count: int, offset: int) -> None:
    base = torch.randint(0, 100, (count + offset,)).to(dtype)
    tensor = base[offset:]  # a view at an offset into its storage
    reader = hashing.sample_reader(tensor)
    assert (reader.tobytes() if reader is not None else b"") == (hashing.sample(tensor) if count else b"")
    if count >= hashing.SAMPLE_ELEMENTS:
        raw = base.view(torch.uint8) if dtype.itemsize == 1 else base.view(torch.int16)
        raw[-1] = ~raw[-1]  # through a byte view: the reader must follow the memory, not a copy
        assert reader is not None and reader.tobytes() == hashing.sample(tensor)


def test_a_cached_tensor_changed_in_place_is_seen_through_its_reader() -> None:
    cache = DigestCache(min_bytes=0)
    tensor = torch.zeros(64, 64)
    digest_all([("w", tensor)], cache)
    assert cache.get(tensor) is not None
    tensor.data[:, :] = 1.0  # .data: the version counter does not move
    assert cache.get(tensor) is None
