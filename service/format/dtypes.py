"""The dtypes a shard may hold: safetensors names, byte widths and dtype classes; and which
shapes a tensor of each can have at all (:func:`shape_problem`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from ckptstore.service.format.bounds import INT64_MAX

DTypeClass = Literal["floating", "integer", "bool", "complex"]

#: safetensors dtype name -> (bytes per element, dtype class). Sub-byte types are left out.
DTYPES: dict[str, tuple[int, DTypeClass]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "integer"),
    "I8": (1, "integer"),
    "U16": (2, "integer"),
    "I16": (2, "integer"),
    "U32": (4, "integer"),
    "I32": (4, "integer"),
    "U64": (8, "integer"),
    "I64": (8, "integer"),
    "F8_E4M3": (1, "floating"),
    "F8_E4M3FNUZ": (1, "floating"),
    "F8_E5M2": (1, "floating"),
    "F8_E5M2FNUZ": (1, "floating"),
    "F16": (2, "floating"),
    "BF16": (2, "floating"),
    "F32": (4, "floating"),
    "F64": (8, "floating"),
    "C64": (8, "complex"),
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name (KeyError if unknown)."""
    return DTYPES[dtype][0]


def dtype_class(dtype: str) -> DTypeClass:
    """The class (floating, integer, bool, complex) of a safetensors dtype name."""
    return DTYPES[dtype][1]


def element_count(shape: Sequence[int]) -> int:
    """Number of elements of ``shape`` (1 for a scalar), exact for any size."""
    return math.prod(shape)


def byte_length(dtype: str, shape: Sequence[int]) -> int:
    """Bytes a tensor of ``dtype`` and ``shape`` occupies."""
    return itemsize(dtype) * element_count(shape)


def layout_extent(dtype: str, shape: Sequence[int]) -> int:
    """itemsize × the product of ``max(d, 1)`` over ``shape`` (non-negative integers): a bound on
    every number torch computes when it lays the tensor out contiguously.

    torch computes strides as ``stride[d] = stride[d + 1] * max(size[d + 1], 1)``, the element
    count as the product of the sizes and the byte size as itemsize × elements, each in a signed
    64-bit integer. Each of them is at most this product, zero-size tensors included: ``[0, 2**62,
    2**62]`` holds no element, yet its first stride is 2**124.
    """
    # The zero-free product first: it is most shapes, and a third of the time of the general one.
    product = math.prod(shape) if 0 not in shape else math.prod([d or 1 for d in shape])
    return itemsize(dtype) * product


def shape_problem(dtype: str, shape: Sequence[int]) -> str | None:
    """None when a tensor of ``dtype`` and ``shape`` (non-negative integers) can exist, else why
    not, for an error message that names the tensor first.

    The rule: :func:`layout_extent` is below 2**63, so the tensor's size in elements and bytes and
    each of its strides fit a signed 64-bit integer (and so does each dim).
    """
    extent = layout_extent(dtype, shape)
    if extent <= INT64_MAX:
        return None
    width = itemsize(dtype)
    shown = str(list(shape))
    shown = shown if len(shown) <= 200 else shown[:200] + "…]"
    return (
        f"shape {shown} is too large: its size or strides overflow 64-bit integers "
        f"(the product of its dimensions, a 0 counted as 1, times the {width} byte{'s' * (width > 1)} of a "
        f"{dtype} element must stay below 2**63); no tensor can have this shape, so the manifest or file "
        "that lists it was not written by ckptstore or was changed"
    )
