"""The one reader of pickled bytes: what it reads back, what it refuses, and that nothing runs.

Pickles are made by the standard library (``pickle.dumps``) at every protocol, and by hand
for what the standard pickler never writes; the reader must equal the value for what it
allows and raise ``InvalidInputError`` (never anything else) for every other byte string.
"""

from __future__ import annotations

import os
import pickle  # noqa: TID251 - making the pickles under test; nothing here is unpickled
import pickletools
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.formats.pickle_reader import read_pickle
from client.formats.pickle_types import PickleLimits
from client.formats.torch_globals import TorchFile
from service.errors import InvalidInputError

TABLE = TorchFile("test.pt").globals_table()
PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)


def read(data: bytes, **kwargs: Any) -> Any:
    return read_pickle(data, where="test.pt", globals_=TABLE, **kwargs)[0]


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**100), max_value=2**100)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.lists(inner, max_size=5).map(tuple)
        | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=5)
        | st.frozensets(st.integers() | st.text(max_size=5), max_size=5).map(set)
    ),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(value=plain, protocol=st.sampled_from(PROTOCOLS))
def test_plain_values_read_back_equal_at_every_protocol(value: Any, protocol: int) -> None:
    assert read(pickle.dumps(value, protocol=protocol)) == value


def test_shared_parts_stay_shared() -> None:
    inner = [1, 2]
    value = read(pickle.dumps({"a": inner, "b": inner}, protocol=4))
    assert value == {"a": [1, 2], "b": [1, 2]} and value["a"] is value["b"]


class Payload:
    """Runs ``func(*args)`` when a general unpickler reads it."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


def payloads(marker: Path) -> dict[str, Any]:
    command = f"touch {marker}"
    return {
        "system": Payload(os.system, command),
        "eval": Payload(eval, f"__import__('os').system({command!r})"),
        "exec": Payload(exec, f"__import__('os').system({command!r})"),
        "Popen": Payload(subprocess.Popen, ["touch", str(marker)]),
        "getattr": Payload(getattr, Payload(os.system, command), "real"),
    }


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_calls_a_pickle_names_are_refused_naming_them_and_never_run(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "ran"
    for name, payload in payloads(marker).items():
        data = pickle.dumps({"w": [1, 2], "x": payload}, protocol=protocol)
        with pytest.raises(InvalidInputError, match=f"global .*{name}"):
            read(data)
        assert not marker.exists()


def test_copyreg_extension_codes_are_refused() -> None:
    for opcode in (b"\x82\x01", b"\x83\x01\x00", b"\x84\x01\x00\x00\x00"):
        with pytest.raises(InvalidInputError, match="extension code"):
            read(b"\x80\x02" + opcode + b")R.")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93)}\x92.", "global builtins.eval"),  # refused at the global first
        (b"(i__builtin__\neval\n.", "INST"),
        (b"(o.", "OBJ"),
        (b"\x80\x05\x97.", "out-of-band"),
        (b"\x80\x02K\x01K\x02a.", "APPEND to a int"),
        (b"\x80\x02]K\x01K\x02s.", "SETITEM on a list"),
        (b"\x80\x02K\x01}b.", "BUILD on a int"),
        (b"\x80\x02X\x01\x00\x00\x00aQ.", "outside data"),
        (b"\x80\x02h\x07.", "memo entry 7"),
        (b"\x80\x02K\x01K\x02.", "stops with 2 values"),
        (b"\x80\x02X\xff\xff\xff\x00a.", "ends inside"),
        (b"\x80\x02\x8a\xff" + bytes(255) + b".", "integer of 255 bytes"),
        (b"\x80\x02e.", "MARK"),
        (b"\x80\x02\xff.", "opcode 0xff"),
        (b"", "ends inside"),
        (b"\x80\x06.", "unknown protocol"),
    ],
)
def test_malformed_or_unsupported_pickles_are_one_clear_error(data: bytes, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        read(data)


def dag(levels: int) -> bytes:
    """``x = [x, x]`` ``levels`` times, by memo reference: a few bytes per level."""
    out = bytearray(b"\x80\x02]q\x00")
    for level in range(1, levels + 1):
        out += b"0]q" + bytes([level]) + b"(h" + bytes([level - 1]) + b"h" + bytes([level - 1]) + b"e"
    return bytes(out + b".")


def test_a_reference_bomb_is_refused_before_anything_walks_it() -> None:
    assert len(read(dag(10))) == 2  # small enough: read back, 2**11 parts as a tree
    with pytest.raises(InvalidInputError, match="expands to more than .* past the limit"):
        read(dag(40))


def test_nesting_deeper_than_the_limit_is_refused_without_recursion() -> None:
    deep = b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b"."
    with pytest.raises(InvalidInputError, match="nests deeper than the limit"):
        read(deep)
    assert read(b"\x80\x02" + b"]" * 50 + b"a" * 49 + b".") is not None


def test_cycles_are_refused() -> None:
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(InvalidInputError, match="contains itself"):
        read(pickle.dumps(cyclic, protocol=2))


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        (PickleLimits(max_items=1000), "more than 1000 objects"),
        (PickleLimits(max_memo=10), "memo passes the limit of 10"),
        (PickleLimits(max_bytes=100), "past the limit of 100 bytes"),
    ],
)
def test_counts_are_bounded_while_reading(limits: PickleLimits, message: str) -> None:
    data = pickle.dumps([str(i) for i in range(2000)], protocol=4)
    with pytest.raises(InvalidInputError, match=message):
        read(data, limits=limits)


def mutations(data: bytes) -> st.SearchStrategy[bytes]:
    """Byte flips, cuts and insertions of ``data``."""
    index = st.integers(min_value=0, max_value=max(len(data) - 1, 0))
    flip = st.tuples(index, st.integers(0, 255)).map(lambda p: data[: p[0]] + bytes([p[1]]) + data[p[0] + 1 :])
    cut = index.map(lambda i: data[:i])
    insert = st.tuples(index, st.binary(min_size=1, max_size=8)).map(lambda p: data[: p[0]] + p[1] + data[p[0] :])
    return st.lists(flip | cut | insert, min_size=1, max_size=4).map(lambda edits: edits[-1])


SEEDS = [pickle.dumps({"a": [1, 2.5, "x", b"y", (3, {4})], "b": None, "c": True}, protocol=p) for p in PROTOCOLS] + [
    dag(12)
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.sampled_from(SEEDS).flatmap(mutations))
def test_no_byte_string_escapes_the_error_tree(data: bytes) -> None:
    try:
        read(data)
    except InvalidInputError:
        pass


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(protocol=st.sampled_from(PROTOCOLS), name=st.sampled_from(["system", "eval", "exec", "Popen", "getattr"]))
def test_mutated_hostile_pickles_never_run(tmp_path: Path, protocol: int, name: str) -> None:
    marker = tmp_path / f"ran-{protocol}-{name}"
    data = pickle.dumps([1, payloads(marker)[name]], protocol=protocol)
    ops = [pos for _, _, pos in pickletools.genops(data) if pos is not None]
    for cut in ops[1:]:
        try:
            read(data[:cut] + data[-1:])
        except InvalidInputError:
            pass
    assert not marker.exists()
