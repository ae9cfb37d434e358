"""Tensor digests: the hashed preamble is frozen, and only 64 lowercase hex passes as a digest."""

from __future__ import annotations

import re
import struct

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptstore.service.format.digest import (
    ALGORITHM,
    DIGEST_PATTERN,
    JOIN_BYTES,
    TensorHasher,
    all_digests,
    is_digest,
    shard_id,
    tensor_digest,
    tensor_preamble,
)
from ckptstore.service.format.dtypes import DTYPES

DATA = struct.pack("<2f", 1.0, 2.0)
#: Computed once from the code and pasted here: changing it silently would orphan every stored tensor.
GOLDEN_F32_2 = "913a5c26aff6b879d874666f3d0e66c7b88d5706b370aba59559947b495c904c"
GOLDEN_F32_SCALAR = "bcd355015a1412a0b8d38cca72d914eacb1904a8095b5943d0db5810732ce8fa"


def test_algorithm_is_blake3() -> None:
    assert ALGORITHM == "blake3"


def test_golden_digest_of_a_small_tensor() -> None:
    expected = blake3.blake3(b"F32[2]\n" + DATA).hexdigest()
    assert tensor_digest("F32", [2], DATA) == expected
    assert expected == GOLDEN_F32_2


def test_golden_digest_of_a_scalar() -> None:
    data = struct.pack("<f", 1.0)
    assert tensor_digest("F32", [], data) == blake3.blake3(b"F32[]\n" + data).hexdigest() == GOLDEN_F32_SCALAR


@pytest.mark.parametrize(
    ("dtype", "shape", "preamble"),
    [
        ("F32", [2], b"F32[2]\n"),
        ("F32", [], b"F32[]\n"),
        ("BF16", [2, 3, 4], b"BF16[2,3,4]\n"),
        ("I64", (0, 7), b"I64[0,7]\n"),
        ("U8", [2**63 - 1], b"U8[9223372036854775807]\n"),
    ],
)
def test_preamble_spells_dtype_and_shape(dtype: str, shape: list[int], preamble: bytes) -> None:
    assert tensor_preamble(dtype, shape) == preamble


def test_digest_accepts_any_buffer_type() -> None:
    expected = tensor_digest("F32", [2], DATA)
    assert tensor_digest("F32", [2], bytearray(DATA)) == expected
    assert tensor_digest("F32", [2], memoryview(DATA)) == expected
    assert tensor_digest("F32", (2,), DATA) == expected


@pytest.mark.parametrize("split", range(len(DATA) + 1))
def test_incremental_hasher_equals_one_shot(split: int) -> None:
    hasher = TensorHasher("F32", [2])
    hasher.update(DATA[:split])
    hasher.update(memoryview(DATA)[split:])
    assert hasher.hexdigest() == GOLDEN_F32_2


@pytest.mark.parametrize("first", [0, 1, 1000, JOIN_BYTES, JOIN_BYTES + 1, 3 * JOIN_BYTES])
@pytest.mark.parametrize("parallel", [True, False])
def test_hasher_equals_plain_blake3_whatever_the_first_piece(first: int, parallel: bool) -> None:
    # A small first piece is hashed joined to the preamble, a large one after it: same digest.
    data = bytes(range(256)) * (4 * JOIN_BYTES // 256) + b"tail"
    shape = [len(data)]
    expected = blake3.blake3(tensor_preamble("U8", shape) + data).hexdigest()
    hasher = TensorHasher("U8", shape, parallel=parallel)
    hasher.update(memoryview(data)[:first])
    hasher.update(memoryview(data)[first:])
    assert hasher.hexdigest() == expected
    assert tensor_digest("U8", shape, data) == expected


def test_hasher_fed_nothing_digests_the_preamble() -> None:
    assert TensorHasher("F32", [0]).hexdigest() == blake3.blake3(b"F32[0]\n").hexdigest()
    assert tensor_digest("F32", [0], b"") == blake3.blake3(b"F32[0]\n").hexdigest()


def test_hasher_takes_typed_memoryviews() -> None:
    typed = memoryview(DATA).cast("f")
    hasher = TensorHasher("F32", [2])
    hasher.update(typed)
    assert hasher.hexdigest() == GOLDEN_F32_2


def test_same_bytes_with_other_shape_or_dtype_give_other_digests() -> None:
    variants = [
        ("F32", [2]),
        ("F32", [1, 2]),
        ("F32", [2, 1]),
        ("I32", [2]),
        ("U32", [2]),
        ("F16", [4]),
        ("BF16", [4]),
        ("U8", [8]),
        ("I64", [1]),
        ("F64", []),
        ("C64", [1]),
    ]
    digests = {tensor_digest(dtype, shape, DATA) for dtype, shape in variants}
    assert len(digests) == len(variants)
    assert all(is_digest(d) for d in digests)


@given(
    st.sampled_from(sorted(DTYPES)),
    st.lists(st.integers(0, 10**6), max_size=5),
    st.sampled_from(sorted(DTYPES)),
    st.lists(st.integers(0, 10**6), max_size=5),
    st.binary(max_size=64),
)
def test_distinct_descriptions_never_share_a_digest(
    dtype_a: str, shape_a: list[int], dtype_b: str, shape_b: list[int], data: bytes
) -> None:
    same = (dtype_a, shape_a) == (dtype_b, shape_b)
    assert (tensor_digest(dtype_a, shape_a, data) == tensor_digest(dtype_b, shape_b, data)) == same


def test_shard_id_is_blake3_of_the_header_bytes() -> None:
    header = struct.pack("<Q", 2) + b"{}"
    assert shard_id(header) == blake3.blake3(header).hexdigest()
    assert shard_id(memoryview(header)) == shard_id(header)
    assert shard_id(header) != shard_id(header + b" ")


@pytest.mark.parametrize(
    "value",
    [GOLDEN_F32_2, "0" * 64, "f" * 64, "0123456789abcdef" * 4],
)
def test_is_digest_accepts_64_lowercase_hex(value: str) -> None:
    assert is_digest(value)


@pytest.mark.parametrize(
    "value",
    [
        GOLDEN_F32_2.upper(),
        "A" + GOLDEN_F32_2[1:],
        GOLDEN_F32_2[:63],
        GOLDEN_F32_2 + "0",
        "sha256:" + GOLDEN_F32_2,
        "blake3:" + GOLDEN_F32_2,
        "sha256:" + GOLDEN_F32_2[:57],
        "",
        " " * 64,
        " " + GOLDEN_F32_2[1:],
        GOLDEN_F32_2[:63] + "\n",
        GOLDEN_F32_2 + "\n",
        GOLDEN_F32_2[:63] + "\x00",
        "%00" + GOLDEN_F32_2[3:],
        "g" * 64,
        "٣" * 64,  # ARABIC-INDIC DIGIT THREE: a digit to str.isdigit, not to us
        "３" * 64,  # fullwidth digit
        "ａ" * 64,  # fullwidth letter a
        "../" + GOLDEN_F32_2[3:],
        None,
        0,
        int(GOLDEN_F32_2, 16),
        GOLDEN_F32_2.encode(),
        bytearray(GOLDEN_F32_2.encode()),
        [GOLDEN_F32_2],
    ],
)
def test_is_digest_rejects_everything_else(value: object) -> None:
    assert not is_digest(value)
    # Checked in bulk, one bad value among good ones fails the whole list, wherever it is.
    assert not all_digests([GOLDEN_F32_2, value, "0" * 64])
    assert not all_digests([value])


_DIGESTISH = st.one_of(
    st.binary(min_size=32, max_size=32).map(bytes.hex),
    st.text(alphabet="0123456789abcdefA \n", min_size=63, max_size=65),
    st.text(max_size=130),
    st.sampled_from([None, 0, b"0" * 64, GOLDEN_F32_2 + "\n" + GOLDEN_F32_2[:63]]),
)


@given(st.lists(_DIGESTISH, max_size=8))
def test_all_digests_agrees_with_checking_each(values: list[object]) -> None:
    assert all_digests(values) == all(is_digest(v) for v in values)


def test_two_digests_in_one_string_are_not_two_digests() -> None:
    """The bulk check joins values with newlines: a value holding a newline must not pass as two."""
    assert not all_digests([GOLDEN_F32_2 + "\n" + GOLDEN_F32_2])
    assert not all_digests([GOLDEN_F32_2[:32], GOLDEN_F32_2[32:]])


@given(st.binary(min_size=32, max_size=32))
def test_any_32_byte_hex_is_a_digest(raw: bytes) -> None:
    assert is_digest(raw.hex())
    assert not is_digest(raw.hex().upper()) or raw.hex() == raw.hex().upper()


@given(st.one_of(st.text(max_size=70), st.text(alphabet="0123456789abcdefABCDEF \n٣", min_size=62, max_size=66)))
def test_is_digest_matches_the_published_pattern_exactly(text: str) -> None:
    assert is_digest(text) == (re.fullmatch(r"[0-9a-f]{64}", text) is not None)
    assert re.fullmatch(r"[0-9a-f]{64}", text) is None or re.match(DIGEST_PATTERN, text) is not None
