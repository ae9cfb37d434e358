"""The one reader of pickled bytes: what it reads back, what it refuses, and that nothing runs.

Pickles are made by the standard library (``pickle.dumps``) at every protocol, and by hand
for what the standard pickler never writes; the reader must equal the value for what it
allows and raise ``InvalidInputError`` (never anything else) for every other byte string.
"""

from __future__ import annotations

import json
import os
import pickle  # noqa: TID251 - making the pickles under test; nothing here is unpickled
import pickletools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.client.formats.pickled.allowlist import PickleLimits
from ckptstore.client.formats.pickled.reader import read_pickle
from ckptstore.client.formats.torch_save.constructors import TorchFile
from ckptstore.service.errors import InvalidInputError

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


# -- what is hashed, compared or formatted while reading ---------------------------------------

key_atoms = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=4)
    | st.binary(max_size=4)
)
tuple_keys = st.recursive(key_atoms, lambda inner: st.lists(inner, max_size=5).map(tuple), max_leaves=60)


def parts_and_depth(key: Any) -> tuple[int, int]:
    """A key's parts (itself and every part inside, a shared part counted wherever it is) and nesting."""
    if type(key) is not tuple:
        return 1, 0
    inside = [parts_and_depth(part) for part in key]
    return 1 + sum(p for p, _ in inside), 1 + max((d for _, d in inside), default=0)


@settings(max_examples=300, deadline=None)
@given(key=tuple_keys, protocol=st.sampled_from(PROTOCOLS), holder=st.sampled_from(["dict", "set", "frozenset"]))
def test_a_key_is_read_exactly_when_its_parts_and_depth_are_bounded(key: Any, protocol: int, holder: str) -> None:
    value: Any = {"dict": {key: 1}, "set": {key}, "frozenset": [frozenset([key])]}[holder]
    parts, depth = parts_and_depth(key)
    limits = PickleLimits()
    fits = parts <= limits.max_key_parts and depth <= limits.max_key_depth
    try:
        got = read(pickle.dumps(value, protocol=protocol))
    except InvalidInputError as exc:
        assert not fits, (parts, depth)
        assert "key" in str(exc) and "deep" in str(exc)
    else:
        assert fits and got == value, (parts, depth)


def bomb(levels: int = 40) -> bytes:
    """Opcodes (no PROTO, no STOP) leaving ``x = [x, x]`` ``levels`` deep on the stack: 2**levels parts."""
    return dag(levels)[2:-1]


DEEP_TUPLE = b")" + b"\x85" * 1_000_000


def _unicode(text: str) -> bytes:
    return b"X" + len(text.encode()).to_bytes(4, "little") + text.encode()


FLOAT_STORAGE = _unicode("storage") + b"ctorch\nFloatStorage\n"
FLOAT_PID = b"(" + FLOAT_STORAGE + _unicode("0") + _unicode("cpu") + b"K\x01tQ"
UNTYPED_PID = (
    b"(" + _unicode("storage") + b"ctorch.storage\nUntypedStorage\n" + _unicode("0") + _unicode("cpu") + b"K\x04tQ"
)
#: A tensor's arguments after its storage: offset 0, size (1,), stride (1,), requires_grad False.
AT_0_SIZE_1 = b"K\x00K\x01\x85K\x01\x85\x89"
V2 = b"ctorch._utils\n_rebuild_tensor_v2\n"
V3 = b"ctorch._utils\n_rebuild_tensor_v3\n"

#: Pickles whose refusal is the whole test: read as a torch.save pickle (numpy arrays allowed), each must be
#: refused saying its words, in a few steps. A regression hashes a million-deep tuple (a crash in C) or
#: formats a reference bomb (a hang), so they are read in a child process of their own, under a timeout.
HOSTILE: dict[str, tuple[bytes, str]] = {
    # keys: what hashing would recurse into, or walk, or collide
    "deep tuple key": (b"\x80\x02}" + DEEP_TUPLE + b"Ns.", "a dict key is a tuple too deep"),
    "deep tuple in ADDITEMS": (b"\x80\x04\x8f(" + DEEP_TUPLE + b"\x90.", "a set member is a tuple too deep"),
    "deep tuple in FROZENSET": (b"\x80\x04(" + DEEP_TUPLE + b"\x91.", "a set member is a tuple too deep"),
    "deep tuple in set()": (b"\x80\x02c__builtin__\nset\n((" + DEEP_TUPLE + b"ltR.", "member of a set is a tuple too"),
    "tuple of a bomb as key": (b"\x80\x02}" + bomb() + b"\x85Ns.", "a dict key is a tuple"),
    "bomb as key": (b"\x80\x02}" + bomb() + b"Ns.", "a dict key is a list"),
    "dict as key": (b"\x80\x02}}Ns.", "a dict key is a dict"),
    "bomb as DICT key": (b"\x80\x02(" + bomb() + b"K\x01d.", "a dict key is a list"),
    "bomb as SETITEMS key": (b"\x80\x02}(" + bomb() + b"K\x01u.", "a dict key is a list"),
    "bomb in set()": (b"\x80\x02c__builtin__\nset\n((" + bomb() + b"ltR.", "a member of a set is a list"),
    "memo index": (b"\x80\x02p99999999999\n.", "memo index"),
    "memo index of 23 digits": (b"\x80\x02Np99999999999999999999999\n.", "memo index"),
    "4097 tuple keys": (
        b"\x80\x02}" + b"".join(b"M" + i.to_bytes(2, "little") + b"\x85Ns" for i in range(4097)) + b".",
        "more than 4096",
    ),
    "4097 large int keys": (
        b"\x80\x02}"
        + b"".join(b"\x8a\x0a" + ((i + 1) << 61).to_bytes(10, "little") + b"Ns" for i in range(4097))
        + b".",
        "limit",
    ),
    # messages: what a refusal would format
    "bomb as storage key": (
        b"\x80\x02(" + FLOAT_STORAGE + bomb() + _unicode("cpu") + b"K\x01tQ.",
        "a storage's key is a list",
    ),
    "bomb as storage type": (
        b"\x80\x02(" + _unicode("storage") + bomb() + _unicode("k") + _unicode("cpu") + b"K\x01tQ.",
        "wrong types",
    ),
    "bomb as persistent id kind": (b"\x80\x02(" + bomb() + b"NNNNtQ.", "not a storage"),
    "bomb as v3 dtype": (b"\x80\x02" + V3 + b"(" + UNTYPED_PID + AT_0_SIZE_1 + b"}" + bomb() + b"tR.", "dtype a list"),
    "bomb as hooks": (b"\x80\x02" + V2 + b"(" + FLOAT_PID + AT_0_SIZE_1 + bomb() + b"tR.", "backward hooks"),
    "bomb as OrderedDict args": (
        b"\x80\x02ccollections\nOrderedDict\n(" + bomb() + b"tR.",
        "OrderedDict is made with arguments",
    ),
    "bomb as encoding": (b"\x80\x02c_codecs\nencode\n(" + _unicode("x") + bomb() + b"tR.", "latin1"),
    "bomb as set()'s list": (b"\x80\x02c__builtin__\nset\n(" + bomb() + b"\x85tR.", "a member of a set is a list"),
    "bomb as numpy dtype": (b"\x80\x02cnumpy\ndtype\n(" + bomb() + b"K\x00K\x01tR.", "numpy dtype a list is not"),
}


def read_torch(data: bytes) -> Any:
    """``data`` read as a torch.save pickle is: storages by persistent id, numpy arrays allowed."""
    reader = TorchFile("test.pt", numpy_arrays=True)
    return read_pickle(data, where="test.pt", globals_=reader.globals_table(), persistent_load=reader.persistent_load)[
        0
    ]


def refuse_hostile() -> None:
    """In the child: each :data:`HOSTILE` case's outcome as a line of JSON, as soon as it is known."""
    for name, (data, _) in HOSTILE.items():
        try:
            read_torch(data)
        except InvalidInputError as exc:
            said = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported, and failed, by the parent
            said = f"escaped as {type(exc).__name__}"
        else:
            said = "read, not refused"
        print(json.dumps({"case": name, "said": said[:1000]}), flush=True)


def test_hostile_pickles_are_refused_before_anything_hashes_or_formats_them() -> None:
    root = Path(__file__).resolve().parents[2]
    script = "from tests.client.test_pickle_reader import refuse_hostile; refuse_hostile()"
    try:
        ran = subprocess.run(
            [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120, check=False
        )
        out, code = ran.stdout, ran.returncode
    except subprocess.TimeoutExpired as expired:
        out, code = (
            (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else expired.stdout or "",
            "hung",
        )
    said = {row["case"]: row["said"] for row in map(json.loads, out.splitlines())}
    problems = [
        f"{name}: {said.get(name, f'no answer (the child ended: {code})')!r}, expected {words!r}"
        for name, (_, words) in HOSTILE.items()
        if words not in said.get(name, "") or len(said[name]) > 400
    ]
    assert not problems, "\n".join(problems)


def test_keys_torch_files_hold_still_read() -> None:
    small_tuples = {(i, "x", (i,)): i for i in range(4096)}  # the most composite keys one pickle may hold
    assert read(pickle.dumps(small_tuples, protocol=2)) == small_tuples
    ints = {i: [i] for i in range(100_000)}  # optimizer states keyed by index: ints hash to themselves
    assert read(pickle.dumps(ints, protocol=4)) == ints
