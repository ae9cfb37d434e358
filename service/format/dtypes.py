"""The dtypes a shard may hold: safetensors names, byte widths and dtype classes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

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
