"""Byte views of tensors: the raw little-endian bytes of every storable dtype, without a copy."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ckptstore.client.tensors import TORCH_TO_NAME, byte_view, host_contiguous


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


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(6.0).reshape(2, 3),
        lambda: torch.arange(6.0).reshape(2, 3).t(),
        lambda: torch.nn.Parameter(torch.arange(6.0)),
        lambda: torch.complex(torch.arange(3.0), torch.ones(3)).conj(),
        lambda: torch.complex(torch.arange(3.0), torch.ones(3)).conj().imag,
    ],
    ids=["plain", "transposed", "parameter", "conj view", "neg view"],
)
def test_host_contiguous_resolves_views(make: Callable[[], torch.Tensor]) -> None:
    tensor = make()
    host = host_contiguous(tensor, "k")
    assert type(host) is torch.Tensor and host.is_contiguous() and not host.is_conj() and not host.is_neg()
    assert not host.requires_grad and torch.equal(host, tensor.detach().resolve_conj().resolve_neg())
