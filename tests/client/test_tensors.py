"""Byte views of tensors: the raw little-endian bytes of every storable dtype, without a copy."""

from __future__ import annotations

import pytest
import torch

from client.tensors import TORCH_TO_NAME, byte_view


@pytest.mark.parametrize("dtype", list(TORCH_TO_NAME), ids=str)
@pytest.mark.parametrize("shape", [(), (3,), (2, 3)])
def test_byte_view_holds_the_tensors_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    source = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    tensor = source.to(dtype)
    view = byte_view(tensor)
    assert view.format == "B" and view.ndim == 1
    assert view.nbytes == tensor.numel() * tensor.element_size()
    assert bytes(view) == tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_byte_view_shares_the_tensors_memory() -> None:
    tensor = torch.zeros(2, 2)
    view = byte_view(tensor)
    tensor.fill_(1.0)
    assert bytes(view) == torch.ones(4).numpy().tobytes()


@pytest.mark.parametrize("shape", [(0,), (2, 0)])
def test_byte_view_of_an_empty_tensor_is_empty(shape: tuple[int, ...]) -> None:
    assert byte_view(torch.zeros(shape, dtype=torch.bfloat16)).nbytes == 0
    assert byte_view(torch.zeros(shape)).nbytes == 0
