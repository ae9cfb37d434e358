"""Hypothesis strategies for tensors of every storable dtype in every layout, and their bytes.

A drawn :class:`Storage` is one block of random bytes of one dtype with one to three views
over it: any shape (0-dim, zero-size, size-1 dims), any dim order (transposed, channels_last),
slicing steps and a storage offset, stride 0 (expanded), arbitrary strides on size-1 dims, and
a conjugate or negative bit where the dtype has one. :func:`reference_bytes` gives the bytes a
view must come back with, worked out with torch alone (no ckptstore code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from ckptstore.client.tensors import TORCH_TO_NAME

#: Every dtype the format stores.
STORABLE_DTYPES: list[torch.dtype] = list(TORCH_TO_NAME)
#: dtypes with a negative-bit view (torch._neg_view); complex64 also has a conjugate one.
_NEGATABLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64}
_NEGATABLE |= {torch.int8, torch.int16, torch.int32, torch.int64}


@dataclass(frozen=True)
class ViewSpec:
    """How one view lies over its storage."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    bit: str  # "", "conj" or "neg"

    def extent(self) -> int:
        """Elements of storage the view reaches (offset included)."""
        if 0 in self.shape:
            return self.offset
        return self.offset + 1 + sum((size - 1) * stride for size, stride in zip(self.shape, self.stride, strict=True))

    def describe(self) -> str:
        """A short label, for failure messages."""
        bit = f" {self.bit}" if self.bit else ""
        return f"shape={self.shape} stride={self.stride} offset={self.offset}{bit}"


@dataclass
class Storage:
    """One dtype's bytes and the views drawn over them."""

    dtype: torch.dtype
    base: torch.Tensor  # 1-d, unit stride: owns the memory every view shares
    specs: list[ViewSpec]

    def views(self) -> list[torch.Tensor]:
        """Fresh view objects over ``base`` (the same storage every time)."""
        return [_view(self.base, spec) for spec in self.specs]


def _view(base: torch.Tensor, spec: ViewSpec) -> torch.Tensor:
    view = base.as_strided(spec.shape, spec.stride, spec.offset)
    if spec.bit == "conj":
        return view.conj()
    if spec.bit == "neg":
        return torch._neg_view(view)
    return view


@st.composite
def view_specs(draw: st.DrawFn, dtype: torch.dtype) -> ViewSpec:
    """One view: shape, dim order, steps, expanded dims, odd size-1 strides, offset, bit."""
    shape = tuple(draw(st.lists(st.sampled_from([0, 1, 1, 2, 3, 5]), min_size=0, max_size=4)))
    rank = len(shape)
    if rank == 4 and draw(st.booleans()):
        order = [0, 2, 3, 1]  # channels_last: C innermost
    else:
        order = draw(st.permutations(range(rank)))
    steps = draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    expanded = draw(st.lists(st.booleans(), min_size=rank, max_size=rank))
    odd = draw(st.lists(st.integers(0, 40), min_size=rank, max_size=rank))
    stride = [0] * rank
    running = 1
    for dim in reversed(order):
        stride[dim] = running * steps[dim]
        running = stride[dim] * max(shape[dim], 1)
    for dim in range(rank):
        if shape[dim] == 1:
            stride[dim] = odd[dim]
        elif expanded[dim] and draw(st.integers(0, 3)) == 0:
            stride[dim] = 0
    bits = [""]
    if dtype in _NEGATABLE:
        bits.append("neg")
    if dtype == torch.complex64:
        bits.append("conj")
    return ViewSpec(shape, tuple(stride), draw(st.integers(0, 6)), draw(st.sampled_from(bits)))


def random_base(data: bytes, dtype: torch.dtype, count: int) -> torch.Tensor:
    """``count`` elements of ``dtype`` made of ``data`` (bool bytes kept to 0 and 1)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = bytearray(data[: count * size].ljust(count * size, b"\x5a"))
    if dtype == torch.bool:
        raw = bytearray(b & 1 for b in raw)
    return torch.frombuffer(raw, dtype=torch.uint8).clone().view(dtype)


@st.composite
def storages(draw: st.DrawFn, dtypes: list[torch.dtype] | None = None) -> Storage:
    """A block of random bytes of one dtype with one to three views over it."""
    dtype = draw(st.sampled_from(dtypes or STORABLE_DTYPES))
    specs = draw(st.lists(view_specs(dtype), min_size=1, max_size=3))
    count = max(1, *(spec.extent() for spec in specs))
    size = torch.empty((), dtype=dtype).element_size()
    data = draw(st.binary(min_size=count * size, max_size=count * size))
    return Storage(dtype, random_base(data, dtype, count), specs)


def reference_bytes(tensor: torch.Tensor) -> bytes:
    """The row-major bytes of ``tensor``'s values, worked out with torch alone."""
    values = tensor.detach().resolve_conj().resolve_neg()
    dense = torch.empty(values.shape, dtype=values.dtype).copy_(values).reshape(-1)
    return bytes(dense.view(torch.uint8).tolist()) if dense.numel() else b""


def assert_same_tensor(loaded: object, expected: torch.Tensor, where: str) -> None:
    """``loaded`` is a tensor of ``expected``'s dtype and shape holding exactly its bytes."""
    assert isinstance(loaded, torch.Tensor), f"{where}: loaded a {type(loaded).__name__}"
    assert loaded.dtype == expected.dtype, f"{where}: dtype {loaded.dtype}, saved {expected.dtype}"
    assert loaded.shape == expected.shape, f"{where}: shape {tuple(loaded.shape)}, saved {tuple(expected.shape)}"
    assert reference_bytes(loaded) == reference_bytes(expected), f"{where}: bytes differ"


def differing_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh tensor shaped like ``tensor`` (same strides where they do not overlap) whose
    every byte differs from ``tensor``'s values: a load destination that must be overwritten."""
    values = tensor.detach().resolve_conj().resolve_neg()
    flipped = bytearray(b ^ (1 if values.dtype == torch.bool else 0xA5) for b in reference_bytes(values))
    source = (
        torch.frombuffer(flipped, dtype=torch.uint8).view(values.dtype).reshape(values.shape)
        if flipped
        else torch.empty(values.shape, dtype=values.dtype)
    )
    return torch.empty_like(values).copy_(source)
