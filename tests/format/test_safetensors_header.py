"""The strict shard header reader: golden bytes, safetensors files, and a hand-built hostile corpus.

Hostile files are spelled out with ``struct.pack`` and JSON text, each differing from a valid
shard in one way, so a case can only pass by the rule it is meant to exercise.
"""

from __future__ import annotations

import io
import json
import struct
import zipfile
from pathlib import Path

import blake3
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.service.errors import IntegrityError, InvalidShardError
from ckptstore.service.format.digest import is_digest, tensor_digest
from ckptstore.service.format.dtypes import DTYPES, byte_length, itemsize
from ckptstore.service.format.safetensors_header import (
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_METADATA_CHARS,
    MAX_METADATA_ENTRIES,
    HeaderEntry,
    encode_header,
    header_bytes,
    header_size,
    laid_out_entries,
    layout_order,
    parse_header,
    read_header,
)
from ckptstore.service.intake.ingest import verify_shard_file

# Two real tensors; every hostile case below is this shard with one thing changed.
DATA_A = struct.pack("<2f", 1.0, 2.0)  # F32 [2]
DATA_B = struct.pack("<q", 7)  # I64 [1]
DATA = DATA_A + DATA_B
DA = tensor_digest("F32", [2], DATA_A)
DB = tensor_digest("I64", [1], DATA_B)


def entry(name: str, dtype: str = '"F32"', shape: str = "[2]", offsets: str = "[0,8]", extra: str = "") -> str:
    """One member of the header object, every field given as raw JSON text."""
    return f'{json.dumps(name)}:{{"dtype":{dtype},"shape":{shape},"data_offsets":{offsets}{extra}}}'


def obj(*members: str) -> str:
    return "{" + ",".join(members) + "}"


def frame(header: str | bytes, data: bytes = b"", *, pad: bool = True) -> bytes:
    """A file: 8-byte little-endian length, the header (space padded like real writers), the data."""
    raw = header.encode("utf-8") if isinstance(header, str) else header
    if pad:
        raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


A = entry(DA)
B = entry(DB, '"I64"', "[1]", "[8,16]")
VALID_TEXT = obj(A, B)
VALID = frame(VALID_TEXT, DATA)


def read(data: bytes, **kwargs: int):
    return read_header(io.BytesIO(data), len(data), **kwargs)


def header_part(data: bytes) -> bytes:
    """The first 8 + N bytes (or all of them when N points past the end)."""
    (length,) = struct.unpack("<Q", data[:8])
    return data[: 8 + length] if 8 + length <= len(data) else data


# --------------------------------------------------------------------------- valid shards


def test_the_baseline_shard_is_valid() -> None:
    header = read(VALID)
    assert [(e.digest, e.dtype, e.shape, e.begin, e.end) for e in header.entries] == [
        (DA, "F32", (2,), 0, 8),
        (DB, "I64", (1,), 8, 16),
    ]
    assert header.metadata == {}
    assert header.data_start == len(header_part(VALID)) == len(VALID) - 16
    assert header.data_start % 8 == 0
    assert header.data_length == 16
    assert header.file_size == len(VALID)
    assert header.shard_id == blake3.blake3(header_part(VALID)).hexdigest()
    assert [e.nbytes for e in header.entries] == [8, 8]
    assert parse_header(header_part(VALID)) == header


def test_unpadded_header_and_scalar_and_metadata_anywhere_are_valid() -> None:
    scalar = struct.pack("<d", 0.5)
    name = tensor_digest("F64", [], scalar)
    text = obj(entry(name, '"F64"', "[]", "[0,8]"), '"__metadata__":{"format":"pt","": ""}')
    header = read(frame(text, scalar, pad=False))
    assert header.entries == (HeaderEntry(name, "F64", (), 0, 8),)
    assert header.metadata == {"format": "pt", "": ""}


def test_encode_header_golden_bytes() -> None:
    header, entries = encode_header([("a" * 64, "F32", [2]), ("b" * 64, "I64", [1, 1])], {"k": "v"})
    assert header == (
        b"\x08\x01\x00\x00\x00\x00\x00\x00"
        b'{"__metadata__":{"k":"v"},'
        b'"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa":'
        b'{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb":'
        b'{"dtype":"I64","shape":[1,1],"data_offsets":[8,16]}}'
        b"   "
    )
    assert len(header) == 272 and len(header) % 8 == 0
    assert entries == [
        HeaderEntry("a" * 64, "F32", (2,), 0, 8),
        HeaderEntry("b" * 64, "I64", (1, 1), 8, 16),
    ]


def test_encode_header_golden_bytes_without_metadata() -> None:
    header, _ = encode_header([("c" * 64, "U8", [3])])
    assert header == (
        b"x\x00\x00\x00\x00\x00\x00\x00"
        b'{"cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc":'
        b'{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}    '
    )


@given(
    st.lists(
        st.tuples(
            st.binary(min_size=32, max_size=32),
            st.sampled_from(["U8", "F16", "F32", "I64", "C64"]),
            st.lists(st.integers(1, 5), max_size=3),
        ),
        min_size=1,
        max_size=8,
        unique_by=lambda t: t[0],
    ),
    st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3),
)
def test_encode_then_parse_round_trips(tensors: list[tuple[bytes, str, list[int]]], metadata: dict[str, str]) -> None:
    items = [(raw.hex(), dtype, shape) for raw, dtype, shape in tensors]
    header_bytes, entries = encode_header(items, metadata)
    assert len(header_bytes) % 8 == 0
    parsed = parse_header(header_bytes)
    assert list(parsed.entries) == entries
    assert parsed.metadata == metadata
    data_length = entries[-1].end
    assert read(header_bytes + bytes(data_length)).entries == parsed.entries


def test_layout_order_puts_wider_dtypes_first_keeping_the_given_order_among_equals() -> None:
    dtypes = ["U8", "F32", "F64", "BF16", "I32", "BOOL", "C64", "F16"]
    assert layout_order(dtypes) == [2, 6, 1, 4, 3, 7, 0, 5]
    assert layout_order([]) == []
    # Laid out in the order given instead, a byte-wide tensor of odd length misaligns the next.
    _, entries = encode_header([("a" * 64, "U8", [3]), ("b" * 64, "F32", [1])])
    assert entries[1].begin % 4 != 0


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["BOOL", "U8", "F16", "BF16", "F32", "I64", "C64"]), st.integers(1, 9)),
        min_size=1,
        max_size=12,
    ),
    st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3),
)
def test_tensors_in_layout_order_each_start_at_a_multiple_of_their_element_size(
    tensors: list[tuple[str, int]], metadata: dict[str, str]
) -> None:
    laid_out = [tensors[index] for index in layout_order([dtype for dtype, _ in tensors])]
    header, entries = encode_header([(f"{i:064x}", dtype, [n]) for i, (dtype, n) in enumerate(laid_out)], metadata)
    assert all((len(header) + e.begin) % itemsize(e.dtype) == 0 for e in entries)


def test_header_cap_is_inclusive() -> None:
    length = len(header_part(VALID)) - 8
    assert read(VALID, max_header_bytes=length).entries
    with pytest.raises(InvalidShardError, match="limit"):
        read(VALID, max_header_bytes=length - 1)
    with pytest.raises(InvalidShardError, match="limit"):
        parse_header(header_part(VALID), max_header_bytes=length - 1)


# --------------------------------------------------------------------------- safetensors files

NP_TENSORS = [
    np.arange(6, dtype="<f4").reshape(2, 3),
    np.arange(5, dtype="<i8"),
    np.array([True, False, True]),
    np.arange(3, dtype="<f2"),
    np.array(2.5, dtype="<f8"),
]
NP_DTYPES = {"float32": "F32", "int64": "I64", "bool": "BOOL", "float16": "F16", "float64": "F64"}


def digest_named(arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {tensor_digest(NP_DTYPES[str(a.dtype)], a.shape, a.tobytes()): a for a in arrays}


def test_safetensors_numpy_file_is_accepted(tmp_path: Path) -> None:
    named = digest_named(NP_TENSORS)
    path = tmp_path / "np.safetensors"
    safetensors.numpy.save_file(named, str(path), metadata={"format": "np"})
    header = verify_shard_file(path)
    assert {e.digest: (e.dtype, e.shape) for e in header.entries} == {
        name: (NP_DTYPES[str(a.dtype)], a.shape) for name, a in named.items()
    }
    assert header.metadata == {"format": "np"}
    # safetensors lays tensors out by dtype width then name, and writes the header in offset order.
    assert [e.begin for e in header.entries] == sorted(e.begin for e in header.entries)


def test_safetensors_torch_file_is_accepted(tmp_path: Path) -> None:
    tensors = {
        name: torch.from_numpy(a.copy()) for name, a in digest_named(NP_TENSORS).items() if a.dtype != np.float16
    }
    bf16 = torch.arange(4, dtype=torch.bfloat16)
    tensors[tensor_digest("BF16", [4], bf16.view(torch.int16).numpy().tobytes())] = bf16
    path = tmp_path / "torch.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    header = verify_shard_file(path)
    assert {e.digest for e in header.entries} == set(tensors)
    assert header.metadata == {}


def test_our_encoding_is_read_by_safetensors() -> None:
    named = digest_named(NP_TENSORS)
    header, entries = encode_header([(name, NP_DTYPES[str(a.dtype)], a.shape) for name, a in named.items()])
    blob = header + b"".join(a.tobytes() for a in named.values())
    assert read(blob).entries == tuple(entries)
    loaded = safetensors.numpy.load(blob)
    assert set(loaded) == set(named)
    for name, array in named.items():
        assert loaded[name].dtype == array.dtype
        np.testing.assert_array_equal(loaded[name], array)


# --------------------------------------------------------------------------- hostile corpus

U8_OVERFLOW = "[4194305,4194305,211106198978564]"  # product is 4 modulo 2**64
DEEP = 100_000


def _zip_bytes() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    return buffer.getvalue()


def case(id_: str, data: bytes, match: str, *, header_rule: bool = True):
    """``header_rule``: the first 8 + N bytes alone already break a rule (not only the file size)."""
    return pytest.param(data, match, header_rule, id=id_)


HOSTILE = [
    # length prefix
    case("empty-file", b"", "at least 8"),
    case("file-shorter-than-8", b"\x02\x00\x00{}", "at least 8"),
    case("N=0", struct.pack("<Q", 0) + DATA, "at least 2"),
    case("N=1", struct.pack("<Q", 1) + b"{" + DATA, "at least 2"),
    case("N-past-end-of-file", struct.pack("<Q", 1000) + VALID[8:], "announces"),
    case("N-one-past-end", struct.pack("<Q", len(VALID) - 7) + VALID[8:], "announces"),
    case("N=2**64-1", struct.pack("<Q", 2**64 - 1) + VALID[8:], "limit"),
    case("N-above-default-cap", struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{", "limit"),
    case("N-ends-inside-string", frame(VALID_TEXT[: VALID_TEXT.index('"F32"') + 2], pad=False) + b'2"}}', "JSON"),
    case("N-ends-inside-number", frame(VALID_TEXT[: VALID_TEXT.index("[8,16]") + 2], pad=False) + b"6]}}", "JSON"),
    # header text
    case("not-utf8", frame(b'{"__metadata__":{"k":"\xff\xfe"},' + VALID_TEXT[1:].encode(), DATA), "UTF-8"),
    case("bom", frame(b"\xef\xbb\xbf" + VALID_TEXT.encode(), DATA), "must start with"),
    case("leading-space", frame(" " + VALID_TEXT, DATA), "must start with"),
    case("leading-newline", frame("\n" + VALID_TEXT, DATA), "must start with"),
    case("utf16-le", frame(VALID_TEXT.encode("utf-16-le"), DATA), "JSON"),
    case("utf16-bom", frame(VALID_TEXT.encode("utf-16"), DATA), "must start with"),
    case("top-level-array", frame(f"[{VALID_TEXT}]", DATA), "must start with"),
    case("top-level-string", frame('"x"', DATA), "must start with"),
    case("raw-control-char", frame(obj('"__metadata__":{"k":"a\nb"}', A, B), DATA), "JSON"),
    case("NaN-in-shape", frame(obj(entry(DA, shape="[NaN]"), B), DATA), "NaN"),
    case("Infinity-in-offsets", frame(obj(entry(DA, offsets="[0,Infinity]"), B), DATA), "Infinity"),
    case("-Infinity-in-offsets", frame(obj(entry(DA, offsets="[-Infinity,8]"), B), DATA), "Infinity"),
    case("1e400-in-offsets", frame(obj(entry(DA, offsets="[0,1e400]"), B), DATA), "1e400"),
    case("float-in-shape", frame(obj(entry(DA, shape="[2.0]"), B), DATA), "only integers"),
    case("exponent-int-in-offsets", frame(obj(entry(DA, offsets="[0,8e0]"), B), DATA), "only integers"),
    case("negative-dim", frame(obj(entry(DA, shape="[-2]"), B), DATA), "invalid shape"),
    case("negative-dims-cancel", frame(obj(entry(DA, shape="[-1,-2]"), B), DATA), "invalid shape"),
    case("negative-offset", frame(obj(entry(DA, offsets="[-8,0]"), B), DATA), "invalid data_offsets"),
    case("bool-in-shape", frame(obj(entry(DA, shape="[true,2]"), B), DATA), "invalid shape"),
    case("bool-in-offsets", frame(obj(entry(DA, offsets="[false,8]"), B), DATA), "invalid data_offsets"),
    case("null-shape", frame(obj(entry(DA, shape="null"), B), DATA), "invalid shape"),
    case("string-dim", frame(obj(entry(DA, shape='["2"]'), B), DATA), "invalid shape"),
    case(
        "too-many-dims",
        frame(obj(entry(DA, shape=json.dumps([1] * (MAX_DIMS - 1) + [2, 1])), B), DATA),
        "invalid shape",
    ),
    case("huge-integer", frame(obj(entry(DA, offsets="[0," + "9" * 5000 + "]"), B), DATA), "too long"),
    # structure
    case("empty-object", frame("{}"), "no tensors"),
    case("empty-object-with-data", frame("{}", DATA), "no tensors"),
    case("metadata-only", frame('{"__metadata__":{"a":"b"}}'), "no tensors"),
    case("duplicate-tensor-name", frame(obj(A, entry(DA, offsets="[8,16]")), DATA_A * 2), "twice"),
    case("duplicate-metadata", frame(obj('"__metadata__":{}', A, B, '"__metadata__":{"x":"y"}'), DATA), "twice"),
    case("duplicate-key-inside-entry", frame(obj(entry(DA, extra=',"dtype":"F32"'), B), DATA), "twice"),
    case("metadata-int-value", frame(obj('"__metadata__":{"k":1}', A, B), DATA), "not a string"),
    case("metadata-null-value", frame(obj('"__metadata__":{"k":null}', A, B), DATA), "not a string"),
    case("metadata-list-value", frame(obj('"__metadata__":{"k":["v"]}', A, B), DATA), "not a string"),
    case("metadata-object-value", frame(obj('"__metadata__":{"k":{"a":"b"}}', A, B), DATA), "not a string"),
    case("metadata-not-object", frame(obj('"__metadata__":"x"', A, B), DATA), "must be an object"),
    case(
        "metadata-too-many",
        frame(obj('"__metadata__":' + json.dumps({str(i): "" for i in range(MAX_METADATA_ENTRIES + 1)}), A, B), DATA),
        "limit",
    ),
    case(
        "metadata-too-long",
        frame(obj('"__metadata__":' + json.dumps({"k": "v" * MAX_METADATA_CHARS}), A, B), DATA),
        "too long",
    ),
    case("unknown-tensor-field", frame(obj(entry(DA, extra=',"offset":0'), B), DATA), "exactly dtype"),
    case(
        "missing-dtype", frame(obj(f'{json.dumps(DA)}:{{"shape":[2],"data_offsets":[0,8]}}', B), DATA), "exactly dtype"
    ),
    case(
        "missing-shape",
        frame(obj(f'{json.dumps(DA)}:{{"dtype":"F32","data_offsets":[0,8]}}', B), DATA),
        "exactly dtype",
    ),
    case("missing-offsets", frame(obj(f'{json.dumps(DA)}:{{"dtype":"F32","shape":[2]}}', B), DATA), "exactly dtype"),
    case("entry-not-object", frame(obj(f"{json.dumps(DA)}:[0,8]", B), DATA), "exactly dtype"),
    case("offsets-one-element", frame(obj(entry(DA, offsets="[8]"), B), DATA), "invalid data_offsets"),
    case("offsets-three-elements", frame(obj(entry(DA, offsets="[0,8,16]"), B), DATA), "invalid data_offsets"),
    case("offsets-object", frame(obj(entry(DA, offsets='{"0":8}'), B), DATA), "invalid data_offsets"),
    case("unknown-dtype", frame(obj(entry(DA, dtype='"F128"'), B), DATA), "unknown dtype"),
    case("lowercase-dtype", frame(obj(entry(DA, dtype='"f32"'), B), DATA), "unknown dtype"),
    case("torch-dtype-name", frame(obj(entry(DA, dtype='"float32"'), B), DATA), "unknown dtype"),
    case("sub-byte-dtype", frame(obj(entry(DA, dtype='"F4"', shape="[16]"), B), DATA), "unknown dtype"),
    case("dtype-not-string", frame(obj(entry(DA, dtype="4"), B), DATA), "unknown dtype"),
    # offsets
    case("overlapping", frame(obj(A, entry(DB, '"I64"', "[1]", "[4,12]")), DATA[:12]), "expected 8"),
    case("hole", frame(obj(A, entry(DB, '"I64"', "[1]", "[12,20]")), DATA_A + b"\0" * 4 + DATA_B), "expected 8"),
    case("end-before-begin", frame(obj(entry(DA, offsets="[8,0]"), B), DATA), "ends before it begins"),
    case(
        "not-starting-at-0",
        frame(obj(entry(DA, offsets="[4,12]"), entry(DB, '"I64"', "[1]", "[12,20]")), b"\0" * 4 + DATA),
        "expected 0",
    ),
    case("unsorted-entries", frame(obj(B, A), DATA), "expected 0"),
    case("same-range-twice", frame(obj(A, entry(DB, '"I64"', "[1]", "[0,8]")), DATA_A), "expected 8"),
    case("zero-size-tensor-sharing-offset", frame(obj(A, entry("0" * 64, '"F32"', "[0]", "[8,8]"), B), DATA), "empty"),
    case("zero-size-tensor-alone", frame(obj(entry(DA, shape="[2,0]", offsets="[0,0]"))), "empty"),
    case("past-the-end", VALID[:-1], "too few", header_rule=False),
    case("data-missing", header_part(VALID), "too few", header_rule=False),
    case("trailing-byte", VALID + b"\0", "trailing", header_rule=False),
    case("polyglot-html-appended", VALID + b"<html><script>alert(1)</script></html>", "trailing", header_rule=False),
    # shape arithmetic
    case("shape-product-overflow", frame(obj(entry(DA, '"U8"', U8_OVERFLOW, "[0,4]")), b"\0" * 4), "overflow 64-bit"),
    case("shape-product-overflow-f32", frame(obj(entry(DA, '"F32"', U8_OVERFLOW, "[0,16]")), b"\0" * 16), "overflow"),
    case("shape-far-larger-than-range", frame(obj(entry(DA, shape="[1000000]"), B), DATA), "needs"),
    case("shape-smaller-than-range", frame(obj(entry(DA, shape="[1]"), B), DATA), "needs"),
    # names
    case("name-traversal", frame(obj(entry("../../etc/passwd"), B), DATA), "not a tensor digest"),
    case("name-nul", frame(obj(entry(DA[:63] + "\0"), B), DATA), "not a tensor digest"),
    case("name-crlf", frame(obj(entry(DA[:62] + "\r\n"), B), DATA), "not a tensor digest"),
    case("name-trailing-newline", frame(obj(entry(DA + "\n"), B), DATA), "not a tensor digest"),
    case("name-rtl-override", frame(obj(entry(DA[:63] + "\u202e"), B), DATA), "not a tensor digest"),
    case("name-script", frame(obj(entry("<script>alert(1)</script>"), B), DATA), "not a tensor digest"),
    case("name-img", frame(obj(entry('"><img src=x onerror=alert(1)>'), B), DATA), "not a tensor digest"),
    case("name-uppercase-hex", frame(obj(entry(DA.upper()), B), DATA), "not a tensor digest"),
    case("name-63-hex", frame(obj(entry(DA[:63]), B), DATA), "not a tensor digest"),
    case("name-sha256-prefix", frame(obj(entry("sha256:" + DA), B), DATA), "not a tensor digest"),
    case("name-empty", frame(obj(entry(""), B), DATA), "not a tensor digest"),
    case("name-1MB", frame(obj(entry("a" * (1 << 20)), B), DATA), "not a tensor digest"),
    # trailing text and nesting
    case("text-after-object", frame(VALID_TEXT + "x", DATA), "text after"),
    case("second-object", frame(VALID_TEXT + "{}", DATA), "text after"),
    case("newline-after-object", frame(VALID_TEXT + "\n", DATA), "text after"),
    case("tab-after-object", frame(VALID_TEXT + "\t", DATA), "text after"),
    case("nul-after-object", frame(VALID_TEXT + "\0", DATA), "text after"),
    case("deep-arrays", frame('{"__metadata__":' + "[" * DEEP + "]" * DEEP + "}"), "nests too deeply"),
    case("deep-objects", frame('{"__metadata__":' + '{"a":' * DEEP + "1" + "}" * DEEP + "}"), "nests too deeply"),
    case("deep-unclosed", frame('{"a":' + "[" * DEEP), "nests too deeply|JSON"),
    # other file types
    case("zip-archive", _zip_bytes(), "limit"),
    case(
        "raw-pickle", b"\x80\x04\x95\x15\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94\x8c\x04eval\x94\x93.", "limit"
    ),
    case("npy", b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }" + DATA_A, "limit"),
    case("html", b"<!DOCTYPE html><html><body>hi</body></html>", "limit"),
    case("svg", b'<svg xmlns="http://www.w3.org/2000/svg" onload="alert(1)"/>', "limit"),
]


@pytest.mark.parametrize(("data", "match", "header_rule"), HOSTILE)
def test_read_header_rejects_hostile_file(data: bytes, match: str, header_rule: bool) -> None:
    with pytest.raises(InvalidShardError, match=match):
        read(data)


@pytest.mark.parametrize(("data", "match", "header_rule"), HOSTILE)
def test_parse_header_rejects_hostile_header(data: bytes, match: str, header_rule: bool) -> None:
    header = header_part(data) if len(data) >= 8 else data
    if header_rule:
        with pytest.raises(InvalidShardError, match=match):
            parse_header(header)
    else:  # only the file size is wrong: the header on its own is fine
        assert parse_header(header).file_size != len(data)


def test_errors_are_checkpoint_errors_with_a_code() -> None:
    with pytest.raises(InvalidShardError) as info:
        read(b"")
    assert isinstance(info.value, ValueError)
    assert info.value.code == "invalid_shard"
    assert info.value.http_status == 400


def test_error_message_does_not_echo_a_huge_name() -> None:
    with pytest.raises(InvalidShardError) as info:
        read(frame(obj(entry("<" * (1 << 20)), B), DATA))
    assert len(str(info.value)) < 300


def test_read_header_reads_no_more_than_the_header() -> None:
    stream = io.BytesIO(VALID)
    read_header(stream, len(VALID))
    assert stream.tell() == len(header_part(VALID))


def test_read_header_refuses_before_reading_an_oversized_header() -> None:
    class Exploding(io.BytesIO):
        def read(self, size: int | None = -1) -> bytes:
            if size is not None and size > 8:
                raise AssertionError(f"read {size} bytes of a header that is over the cap")
            return super().read(size)

    data = struct.pack("<Q", 4096) + b"{" + b" " * 5000
    with pytest.raises(InvalidShardError, match="limit"):
        read_header(Exploding(data), len(data), max_header_bytes=4095)


# --------------------------------------------------------------------------- fuzzing

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _never_anything_but_invalid_shard(data: bytes) -> None:
    for attempt in (lambda: read(data), lambda: parse_header(data), lambda: read(data, max_header_bytes=64)):
        try:
            header = attempt()
        except InvalidShardError:
            continue
        # whatever passes is a consistent, contiguous layout of digest-named tensors
        assert header.entries
        assert all(is_digest(e.digest) and e.nbytes > 0 for e in header.entries)
        assert [e.begin for e in header.entries] == [0] + [e.end for e in header.entries[:-1]]


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_invalid_shard(data: bytes) -> None:
    _never_anything_but_invalid_shard(data)


@FUZZ
@given(st.binary(max_size=600).map(lambda tail: struct.pack("<Q", len(tail)) + tail))
def test_arbitrary_headers_with_a_matching_length_raise_only_invalid_shard(data: bytes) -> None:
    _never_anything_but_invalid_shard(data)


@FUZZ
@given(st.data())
def test_mutated_valid_shard_raises_only_invalid_shard(data: st.DataObject) -> None:
    blob = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["replace", "insert", "delete", "truncate", "append"]))
        at = data.draw(st.integers(0, max(len(blob) - 1, 0)))
        byte = data.draw(st.integers(0, 255))
        if kind == "replace" and blob:
            blob[at] = byte
        elif kind == "insert":
            blob.insert(at, byte)
        elif kind == "delete" and blob:
            del blob[at]
        elif kind == "truncate":
            del blob[at:]
        else:
            blob.append(byte)
    _never_anything_but_invalid_shard(bytes(blob))


JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=8)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
ENTRY_VALUES = st.fixed_dictionaries(
    {
        "dtype": st.one_of(st.sampled_from(["F32", "U8", "I64", "BOOL", "f32", ""]), JSON_VALUES),
        "shape": st.one_of(st.lists(st.integers(-2, 4), max_size=3), JSON_VALUES),
        "data_offsets": st.one_of(st.lists(st.integers(-2, 40), max_size=3), JSON_VALUES),
    },
    optional={"extra": JSON_VALUES},
)


@pytest.mark.slow  # a hypothesis search over header structures
@FUZZ
@given(
    st.lists(
        st.tuples(
            st.one_of(st.sampled_from([DA, DB, "__metadata__", "0" * 64]), st.text(max_size=8)),
            st.one_of(ENTRY_VALUES, JSON_VALUES),
        ),
        max_size=5,
    ),
    st.binary(max_size=48),
)
def test_structured_headers_raise_only_invalid_shard(members: list[tuple[str, object]], data: bytes) -> None:
    text = "{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in members) + "}"
    _never_anything_but_invalid_shard(frame(text, data))


# --------------------------------------------------------------------------- verify_shard_file


@pytest.fixture
def shard_path(tmp_path: Path) -> Path:
    path = tmp_path / "shard.safetensors"
    path.write_bytes(VALID)
    return path


def test_verify_accepts_a_valid_shard(shard_path: Path) -> None:
    header = verify_shard_file(shard_path)
    assert [e.digest for e in header.entries] == [DA, DB]
    assert header.shard_id == blake3.blake3(header_part(VALID)).hexdigest()


@pytest.mark.parametrize("position", [-16, -9, -8, -1])
def test_verify_detects_a_changed_data_byte(shard_path: Path, position: int) -> None:
    blob = bytearray(VALID)
    blob[position] ^= 0x01
    shard_path.write_bytes(bytes(blob))
    with pytest.raises(IntegrityError, match="hashes to") as info:
        verify_shard_file(shard_path)
    assert info.value.code == "integrity"


def test_verify_rejects_a_shard_one_byte_short(shard_path: Path) -> None:
    shard_path.write_bytes(VALID[:-1])
    with pytest.raises(InvalidShardError, match="1 bytes too few"):
        verify_shard_file(shard_path)


def test_verify_rejects_a_shard_one_byte_long(shard_path: Path) -> None:
    shard_path.write_bytes(VALID + b"\0")
    with pytest.raises(InvalidShardError, match="1 trailing bytes"):
        verify_shard_file(shard_path)


def test_verify_rejects_an_empty_file(shard_path: Path) -> None:
    shard_path.write_bytes(b"")
    with pytest.raises(InvalidShardError):
        verify_shard_file(shard_path)


def test_verify_honours_the_header_cap(shard_path: Path) -> None:
    with pytest.raises(InvalidShardError, match="limit"):
        verify_shard_file(shard_path, max_header_bytes=16)


@pytest.mark.slow  # verifies the shard once per bit
def test_verify_detects_every_single_bit_flip_anywhere(shard_path: Path) -> None:
    """The header pins every tensor by digest and the layout by rule, so no flipped bit gets through."""
    for position in range(len(VALID)):
        for bit in range(8):
            blob = bytearray(VALID)
            blob[position] ^= 1 << bit
            shard_path.write_bytes(bytes(blob))
            with pytest.raises((InvalidShardError, IntegrityError)):
                verify_shard_file(shard_path)


_SHAPES = st.lists(st.integers(0, 3000), max_size=4)
_METADATA = st.one_of(st.none(), st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))


@settings(max_examples=200, deadline=None)
@given(
    tensors=st.lists(st.tuples(st.sampled_from(sorted(DTYPES)), _SHAPES), min_size=1, max_size=12),
    names=st.lists(st.one_of(st.none(), st.text(max_size=6)), min_size=12, max_size=12),
    metadata=_METADATA,
    align=st.sampled_from([8, 4096]),
    at_least=st.sampled_from([0, 100, 5000]),
)
def test_header_bytes_are_the_json_dumps_text_byte_for_byte(
    tensors: list[tuple[str, list[int]]],
    names: list[str | None],
    metadata: dict[str, str] | None,
    align: int,
    at_least: int,
) -> None:
    """Headers are formatted directly, not by json.dumps, and must stay the very same bytes: a
    shard's id is the digest of its header, so the same tensors must make the same shard. Names
    are digests, or (an export's) any text, a name twice included."""
    named = [
        (name if name is not None else f"{number:064x}", dtype, shape)
        for number, ((dtype, shape), name) in enumerate(zip(tensors, names, strict=False))
    ]
    document: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    position = 0
    for digest, dtype, shape in named:
        end = position + byte_length(dtype, shape)
        document[digest] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, end]}
        position = end
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * max(0, at_least - 8 - len(text))
    text += b" " * (-(8 + len(text)) % align)
    assert header_bytes(named, metadata, align=align, at_least=at_least) == struct.pack("<Q", len(text)) + text
    digests_only = all(is_digest(name) for name, _, _ in named)
    if digests_only and position and all(byte_length(dtype, shape) for _, dtype, shape in named):
        assert parse_header(header_bytes(named)).entries == laid_out_entries(named)


@settings(max_examples=200, deadline=None)
@given(
    layouts=st.lists(
        st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 100_000), max_size=4).map(tuple)),
        max_size=30,
    ),
    metadata=st.sampled_from([None, {}, {"format": "pt"}, {"a": 'b"\u00e9', "n": "1"}]),
    align=st.sampled_from([8, 16, 4096]),
)
def test_header_size_is_the_length_of_the_header_written_for_digest_names(
    layouts: list[tuple[str, tuple[int, ...]]], metadata: dict[str, str] | None, align: int
) -> None:
    # What a writer leaves room for before it knows the digests: exactly the header's length,
    # whatever the dtypes, shapes, offsets' digits (empty tensors included) and metadata.
    named = [(f"{index:064x}", dtype, shape) for index, (dtype, shape) in enumerate(layouts)]
    assert header_size(layouts, metadata, align=align) == len(header_bytes(named, metadata, align=align))
