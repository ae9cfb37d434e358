"""The bytes of many tensors taken at once: small ones gathered into one buffer per dtype, every
one exactly its tensor's values in row-major order, whatever its layout, and a copy for those
gathered (what the store hashes cannot change under it)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.client.saving.gather import GATHER_MAX_BYTES, byte_views
from tests.client.layouts import Storage, reference_bytes, storages


def _items(tensors: list[torch.Tensor]) -> list[tuple[str, torch.Tensor, int]]:
    return [(f"t{i}", t, t.numel() * t.element_size()) for i, t in enumerate(tensors)]


@settings(max_examples=150, deadline=None)
@given(drawn=st.lists(storages(), min_size=1, max_size=6), trainable=st.booleans())
def test_every_view_holds_its_tensors_values_in_order(drawn: list[Storage], trainable: bool) -> None:
    # Several dtypes and layouts interleaved, views sharing storage, 0-dim and empty tensors.
    tensors = [view for storage in drawn for view in storage.views()]
    if trainable:
        tensors = [
            torch.nn.Parameter(t) if t.is_floating_point() and t.is_contiguous() and not t.is_neg() else t
            for t in tensors
        ]
    views = byte_views(_items(tensors))
    assert [bytes(v) for v in views] == [reference_bytes(t) for t in tensors]


def test_large_tensors_are_viewed_in_place_and_small_ones_copied() -> None:
    small = torch.arange(16, dtype=torch.float32)
    other = torch.arange(16, dtype=torch.float32) * 2
    large = torch.zeros(GATHER_MAX_BYTES // 4 + 1, dtype=torch.float32)
    views = byte_views(_items([small, large, other]))
    small[:] = -1  # the gathered copy keeps the values as they were
    large[0] = 7.0  # the large view shows the tensor's own memory
    assert bytes(views[0]) == torch.arange(16, dtype=torch.float32).numpy().tobytes()
    assert bytes(views[2]) == (torch.arange(16, dtype=torch.float32) * 2).numpy().tobytes()
    assert bytes(views[1][:4]) == torch.tensor([7.0]).numpy().tobytes()


def test_sizes_on_either_side_of_the_limit_keep_their_order() -> None:
    sizes = [GATHER_MAX_BYTES - 2, GATHER_MAX_BYTES, GATHER_MAX_BYTES + 2, 2, GATHER_MAX_BYTES]
    tensors = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    tensors.append(torch.randn(3, dtype=torch.float64))
    views = byte_views(_items(tensors))
    assert [bytes(v) for v in views] == [reference_bytes(t) for t in tensors]


def test_a_tensor_alone_of_its_dtype_is_copied_too() -> None:
    # What the store hashes before writing must be the save's own copy, even for a group of one.
    alone = torch.nn.Parameter(torch.arange(8, dtype=torch.float64))
    conj = torch.complex(torch.arange(4.0), torch.ones(4)).conj()
    views = byte_views(_items([alone, conj, torch.zeros(2, dtype=torch.int8)]))
    with torch.no_grad():
        alone.zero_()
    assert bytes(views[0]) == torch.arange(8, dtype=torch.float64).numpy().tobytes()
    assert bytes(views[1]) == reference_bytes(conj)
