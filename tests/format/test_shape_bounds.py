"""Which shapes a tensor can have: the manifest and shard validators accept exactly those whose
size and strides fit 64 bits, and torch can make every shape they accept.

torch lays a tensor out with ``stride[d] = stride[d + 1] * max(size[d + 1], 1)``, in int64: a
zero-size ``[0, 2**62, 2**62]`` holds nothing yet has a first stride of 2**124, which used to
pass validation and fail at load with a bare ``Stride calculation overflowed``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from ckptstore.client.tensors import NAME_TO_TORCH
from ckptstore.service.errors import InvalidManifestError, InvalidShardError
from ckptstore.service.format.dtypes import DTYPES, itemsize, layout_extent, shape_problem
from ckptstore.service.format.manifest import manifest_from_json, validate_body
from ckptstore.service.format.safetensors_header import entry_fields

LIMIT = 2**63
DIGEST = "a" * 64


def fits(dtype: str, shape: list[int]) -> bool:
    """The rule, written out apart from the code under test."""
    product = itemsize(dtype)
    for dim in shape:
        product *= dim if dim > 0 else 1
    return all(0 <= dim < LIMIT for dim in shape) and product < LIMIT


def entry(dtype: str, shape: list[int]) -> dict[str, Any]:
    return {
        "key": "extra/t",
        "dtype": dtype,
        "shape": shape,
        "dtype_class": DTYPES[dtype][1],
        "digest": DIGEST,
        "placement": "host",
        "device_type": "cpu",
    }


def manifest_accepts(dtype: str, shape: list[int]) -> bool:
    try:
        validate_body({"tensors": [entry(dtype, shape)]})
    except InvalidManifestError as exc:
        assert "extra/t: shape [" in str(exc) and "overflow 64-bit integers" in str(exc), str(exc)
        return False
    return True


def shard_entry_accepts(dtype: str, shape: list[int]) -> bool:
    """What the shard reader and ``ckptstore import`` make of a header entry of this shape."""
    end = itemsize(dtype) * math.prod(shape)
    try:
        entry_fields({"dtype": dtype, "shape": shape, "data_offsets": [0, end]}, "tensor t")
    except InvalidShardError as exc:
        assert "overflow 64-bit integers" in str(exc), str(exc)
        return False
    return True


#: Dims around the places where the rule turns: zero, one, the powers of two near 2**63, the bound.
EDGES = [0, 1, 2, 3, 2**31, 2**32, 2**60, 2**61 - 1, 2**61, 2**62 - 1, 2**62, 2**63 - 1, 2**63, 2**64]
dims = st.sampled_from(EDGES) | st.integers(min_value=0, max_value=2**64)
shapes = st.lists(dims, max_size=6)
dtypes = st.sampled_from(sorted(DTYPES))

BOUNDARY = [
    ("U8", [2**63 - 1], True),
    ("U8", [0, 2**63 - 1], True),
    ("U8", [2**63 - 1, 0], True),
    ("U8", [0, 0, 0, 2**63 - 1, 1, 1], True),
    ("U8", [2**63], False),
    ("U8", [0, 2**63], False),
    ("U8", [0, 2**62, 2], False),
    ("U8", [0, 2**62, 2**62], False),
    ("F32", [0, 2**62, 2**62], False),
    ("U16", [2**62 - 1, 0], True),
    ("U16", [2**62], False),
    ("I16", [0, 2**62], False),
    ("F32", [2**61 - 1], True),
    ("F32", [2**61], False),
    ("F32", [0, 2**61], False),
    ("F32", [2**62, 2**62, 0], False),
    ("F64", [0, 0, 2**60 - 1], True),
    ("F64", [0, 0, 2**60], False),
    ("C64", [2**30, 2**30 - 1, 0], True),
    ("C64", [2**30, 2**30, 0, 1], False),
    ("BF16", [], True),
    ("BOOL", [0], True),
]


@pytest.mark.parametrize(("dtype", "shape", "accepted"), BOUNDARY, ids=[f"{d}{s}" for d, s, _ in BOUNDARY])
def test_the_boundary_shapes(dtype: str, shape: list[int], accepted: bool) -> None:
    assert fits(dtype, shape) is accepted
    assert manifest_accepts(dtype, shape) is accepted
    assert shard_entry_accepts(dtype, shape) is accepted
    assert (shape_problem(dtype, shape) is None) is accepted


@settings(max_examples=400, deadline=None)
@given(dtype=dtypes, shape=shapes)
@example(dtype="U8", shape=[2**62])
@example(dtype="U8", shape=[2**63 - 1])
@example(dtype="U8", shape=[2**63])
@example(dtype="U8", shape=[0, 0, 2**63 - 1])
@example(dtype="U8", shape=[0, 0, 2**63])
@example(dtype="F32", shape=[0, 2**62, 2**62])
@example(dtype="I64", shape=[0, 2**60 - 1])
@example(dtype="I64", shape=[0, 2**60])
def test_validators_accept_exactly_the_shapes_whose_size_and_strides_fit(dtype: str, shape: list[int]) -> None:
    expected = fits(dtype, shape)
    assert manifest_accepts(dtype, shape) is expected
    assert shard_entry_accepts(dtype, shape) is expected


def test_the_refusal_names_the_tensor_its_shape_and_the_overflow() -> None:
    with pytest.raises(InvalidManifestError) as raised:
        validate_body({"tensors": [entry("F32", [0, 2**62, 2**62])]})
    message = str(raised.value)
    assert "extra/t" in message and str([0, 2**62, 2**62]) in message
    assert "size or strides overflow 64-bit integers" in message


def test_a_chunked_entry_is_refused_by_its_own_shape() -> None:
    chunked = entry("U8", [0, 2**62, 2**62]) | {
        "chunks": [{"offsets": [0, 0, 0], "shape": [0, 1, 1], "digest": DIGEST}]
    }
    del chunked["digest"]
    with pytest.raises(InvalidManifestError, match="overflow 64-bit integers"):
        validate_body(json.loads(json.dumps({"tensors": [chunked]})))


def test_a_stored_manifest_with_such_a_shape_is_refused_when_read() -> None:
    """A version stored before the rule fails to load with the format's error, not torch's."""
    stored = {"run_id": "r", "version": 1, "created_at": "2024-01-02T03:04:05Z", "tensors": [entry("U8", [0, 2**63])]}
    with pytest.raises(InvalidManifestError, match=r"extra/t: shape \[0, 9223372036854775808\] is too large"):
        manifest_from_json(json.dumps(stored))


def test_a_long_shape_is_cut_in_the_message() -> None:
    problem = shape_problem("U8", [2**62] * 64)
    assert problem is not None and len(problem) < 600


@settings(max_examples=200, deadline=None)
@given(
    dtype=dtypes,
    rest=st.lists(st.sampled_from([0, 1, 2, 3, 7, 2**10, 2**20, 2**30]), max_size=3),
    below=st.integers(min_value=0, max_value=1000),
    zeros_first=st.booleans(),
)
@example(dtype="U8", rest=[0], below=0, zeros_first=True)
@example(dtype="U8", rest=[0, 0], below=0, zeros_first=False)
@example(dtype="C64", rest=[0, 0], below=0, zeros_first=True)
@example(dtype="F32", rest=[2**30, 0], below=0, zeros_first=False)
def test_every_accepted_shape_near_the_bound_can_be_made_on_meta(
    dtype: str, rest: list[int], below: int, zeros_first: bool
) -> None:
    extent = layout_extent(dtype, rest)
    assume(extent < LIMIT)
    largest = (LIMIT - 1) // extent  # the largest dim that still fits beside ``rest``
    last = max(largest - below, 0)
    shape = rest + [last] if zeros_first else [last] + rest
    assert manifest_accepts(dtype, shape)
    assert not manifest_accepts(dtype, rest + [largest + 1])
    made = torch.empty(shape, dtype=NAME_TO_TORCH[dtype], device="meta")  # allocates nothing
    assert list(made.shape) == shape
    assert all(0 <= stride < LIMIT for stride in made.stride())
