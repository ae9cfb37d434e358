"""How much a tensor's values changed between two versions, read from the store without torch.

The diff page asks for it only when the user does (``&values=1``): both versions' bytes are
read and compared element by element with the standard library (``struct``), so a page compares
at most :data:`MAX_COMPARED_BYTES` of each version and says which tensors it left out.
Floating dtypes (float8 to float64, bfloat16) are decoded to Python floats; integers and bools
are compared as integers; complex tensors are not compared.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, filterfalse
from operator import ne, sub

from ckptstore.service.api.http.streaming import PIECE_BYTES
from ckptstore.service.format.dtypes import itemsize
from ckptstore.service.format.manifest import TensorEntry
from ckptstore.service.store import Store

#: Bytes of each version one page reads to compare values, at most.
MAX_COMPARED_BYTES = 32 << 20
#: Elements decoded at a time (keeps the Python floats alive at once few).
SLICE_ELEMENTS = 1 << 16
_STRUCT = {
    "BOOL": "B",
    "U8": "B",
    "I8": "b",
    "U16": "H",
    "I16": "h",
    "U32": "I",
    "I32": "i",
    "U64": "Q",
    "I64": "q",
    "F16": "e",
    "F32": "f",
    "F64": "d",
}
_BITS = {1: "B", 2: "H", 4: "I", 8: "Q"}


def _f8_table(exponent_bits: int, bias: int, kind: str) -> list[float]:
    """The 256 values of a float8 format: 'fn' (no inf, S.1111.111 is NaN), 'ieee', or 'fnuz'."""
    mantissa_bits = 7 - exponent_bits
    top = (1 << exponent_bits) - 1
    values = []
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte >> mantissa_bits) & top, byte & ((1 << mantissa_bits) - 1)
        if kind == "fnuz" and byte == 0x80:
            value = math.nan
        elif kind == "ieee" and exponent == top:
            value = math.inf if mantissa == 0 else math.nan
        elif kind == "fn" and exponent == top and mantissa == (1 << mantissa_bits) - 1:
            value = math.nan
        elif exponent == 0:
            value = mantissa / (1 << mantissa_bits) * 2.0 ** (1 - bias)
        else:
            value = (1 + mantissa / (1 << mantissa_bits)) * 2.0 ** (exponent - bias)
        values.append(sign * value)
    return values


_F8 = {
    "F8_E4M3": _f8_table(4, 7, "fn"),
    "F8_E4M3FNUZ": _f8_table(4, 8, "fnuz"),
    "F8_E5M2": _f8_table(5, 15, "ieee"),
    "F8_E5M2FNUZ": _f8_table(5, 16, "fnuz"),
}


def comparable(dtype: str) -> bool:
    """True when values of ``dtype`` can be compared here."""
    return dtype in _STRUCT or dtype in _F8 or dtype == "BF16"


def decode(dtype: str, data: bytes | memoryview) -> Sequence[float] | Sequence[int]:
    """The little-endian elements of ``data`` as Python numbers."""
    count = len(data) // itemsize(dtype)
    if dtype in _F8:
        table = _F8[dtype]
        return [table[byte] for byte in bytes(data)]
    if dtype == "BF16":  # the upper half of a float32
        widened = bytearray(4 * count)
        widened[2::4] = data[0::2]
        widened[3::4] = data[1::2]
        return struct.unpack(f"<{count}f", widened)
    return struct.unpack(f"<{count}{_STRUCT[dtype]}", data)


@dataclass(frozen=True)
class Comparison:
    """Elements compared, how many differ in their bytes, and the largest finite absolute difference."""

    elements: int
    differing: int
    max_abs: float | int | None
    unordered: int = 0  # changed elements whose difference is NaN (a NaN on one side, or inf against inf)

    @property
    def share(self) -> float:
        """Differing elements over elements."""
        return self.differing / self.elements if self.elements else 0.0


def compare_bytes(dtype: str, before: bytes | memoryview, after: bytes | memoryview) -> Comparison:
    """Compare two equally long runs of ``dtype`` elements."""
    size = itemsize(dtype)
    step = SLICE_ELEMENTS * size
    elements = len(before) // size
    differing = unordered = 0
    largest: float | int | None = None
    bits = f"<{{}}{_BITS[size]}"
    for start in range(0, len(before), step):
        old, new = before[start : start + step], after[start : start + step]
        count = len(old) // size
        changed = map(ne, struct.unpack(bits.format(count), old), struct.unpack(bits.format(count), new))
        # Only elements whose bytes differ: a NaN left as it was is no change.
        gaps = list(map(abs, compress(map(sub, decode(dtype, new), decode(dtype, old)), changed)))
        differing += len(gaps)
        ordered = list(filterfalse(math.isnan, gaps))
        unordered += len(gaps) - len(ordered)
        if ordered:
            top = max(ordered)
            largest = top if largest is None else max(largest, top)
    return Comparison(elements, differing, largest, unordered)


def _bytes_of(store: Store, digest: str) -> bytes:
    location = store.locate([digest])[digest]
    if location.encoded:  # compressed at rest: decoded (and checked) whole
        return bytes(store.read_tensor(digest))
    return b"".join(
        bytes(p) for p in store.iter_shard(location.shard_id, location.offset, location.nbytes, PIECE_BYTES)
    )


def _pieces(entry: TensorEntry) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    if entry.digest is not None:
        return [((0,) * len(entry.shape), tuple(entry.shape), entry.digest)]
    return [(tuple(c.offsets), tuple(c.shape), c.digest) for c in entry.chunks or ()]


def changed_pieces(old: TensorEntry, new: TensorEntry) -> list[tuple[str, str, int]] | None:
    """(old digest, new digest, bytes) of each piece that differs; None unless laid out alike."""
    if old.dtype != new.dtype or old.shape != new.shape:
        return None
    before, after = _pieces(old), _pieces(new)
    if [p[:2] for p in before] != [p[:2] for p in after]:
        return None
    size = itemsize(new.dtype)
    return [(a[2], b[2], size * math.prod(b[1])) for a, b in zip(before, after, strict=True) if a[2] != b[2]]


def compare_entries(store: Store, old: TensorEntry, new: TensorEntry, budget: list[int]) -> Comparison | str:
    """Compare two versions of a tensor, taking the bytes read off ``budget[0]``; a reason if not compared."""
    if not comparable(new.dtype):
        return f"values of {new.dtype} are not compared"
    pieces = changed_pieces(old, new)
    if pieces is None:
        return "dtype, shape or chunking differs: values not compared"
    needed = sum(nbytes for _, _, nbytes in pieces)
    if needed > budget[0]:
        return f"not compared: past the {MAX_COMPARED_BYTES >> 20} MiB a page reads from each version"
    budget[0] -= needed
    results = [compare_bytes(new.dtype, _bytes_of(store, a), _bytes_of(store, b)) for a, b, _ in pieces]
    return _merge(math.prod(new.shape), results)


def _merge(elements: int, results: list[Comparison]) -> Comparison:
    found = [r.max_abs for r in results if r.max_abs is not None]
    return Comparison(
        elements,
        sum(r.differing for r in results),
        max(found) if found else None,
        sum(r.unordered for r in results),
    )
