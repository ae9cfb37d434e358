"""Frozen tensors are hashed once per process, and any change to them is still noticed."""

from __future__ import annotations

import pytest
import torch

import client
from client import hashing
from client.hashing import DigestCache, digest_all
from service.errors import StateEncodingError
from tests.client.models import TinyNet


def frozen_model() -> torch.nn.Module:
    model = TinyNet()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def test_unchanged_frozen_tensors_are_not_hashed_again() -> None:
    model = frozen_model()
    cache = DigestCache()
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
    cache = DigestCache()
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
