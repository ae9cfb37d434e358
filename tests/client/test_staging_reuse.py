"""Staging buffers are reused from snapshot to snapshot only while they fit what they copy.

A background save's snapshot copies every tensor the digest cache does not know into a staging
buffer kept for its key. A loop saving every step asks for the same keys, shapes and dtypes,
and gets the last snapshot's buffers as they are; any change of a key, a shape or a dtype
(hypothesis draws sequences of them) gets buffers that fit, and every snapshot holds exactly
the values its tensors had when it was taken.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.client.saving.snapshot import Staging
from ckptstore.client.state import FlatState, TensorRecord

SHAPES = [(4,), (2, 2), (3,), (1, 4)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def flat_of(tensors: dict[str, torch.Tensor]) -> FlatState:
    flat = FlatState()
    for key, tensor in tensors.items():
        flat.add(TensorRecord(key, tensor, "target", trainable=True))
    return flat


change = st.one_of(
    st.tuples(st.just("values"), st.integers(0, 3)),
    st.tuples(st.just("shape"), st.integers(0, 3), st.sampled_from(SHAPES)),
    st.tuples(st.just("dtype"), st.integers(0, 3), st.sampled_from(DTYPES)),
    st.tuples(st.just("drop"), st.integers(0, 3)),
    st.tuples(st.just("add"), st.integers(0, 3)),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(change, max_size=8))
def test_every_snapshot_holds_its_tensors_values_in_buffers_that_fit(changes: list[tuple]) -> None:
    torch.manual_seed(0)
    live = {f"model/t{i}": torch.randn(4) for i in range(3)}
    staging = Staging()
    last: list[torch.Tensor] = []
    last_keys: list[str] = []
    for what in [("values", 0), *changes]:
        kind, index = what[0], what[1]
        key = f"model/t{index}"
        if kind == "values" and key in live:
            live[key].add_(1.0)  # in place: the same tensor object
        elif kind == "shape" and key in live:
            live[key].data = torch.randn(what[2]).to(live[key].dtype)
        elif kind == "dtype" and key in live:
            live[key].data = live[key].data.to(what[2])
        elif kind == "drop":
            live.pop(key, None)
        elif kind == "add":
            live.setdefault(key, torch.randn(4))
        before = {k: v.clone() for k, v in live.items()}
        snapshot = staging.snapshot(flat_of(live), None)
        copies = snapshot.tensors
        for (k, value), copy in zip(before.items(), copies, strict=True):
            assert copy is not live[k] and copy.dtype == value.dtype and copy.shape == value.shape
            assert torch.equal(copy, value), k
        unchanged = list(before) == last_keys and all(
            (c.shape, c.dtype) == (p.shape, p.dtype) for c, p in zip(copies, last, strict=True)
        )
        if unchanged:
            assert all(c is p for c, p in zip(copies, last, strict=True))  # the same buffers, reused
        for value in live.values():
            value.add_(1.0)  # the snapshot does not see later changes
        assert all(torch.equal(c, before[k]) for k, c in zip(before, copies, strict=True))
        last, last_keys = list(copies), list(before)
    assert staging.nbytes == sum(v.nbytes for v in live.values())  # no buffer of a dropped key is kept
