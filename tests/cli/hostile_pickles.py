"""Pickles and torch.save archives made by hand, for the hostile import corpus (:mod:`tests.cli.hostile_imports`).

What an attacker puts inside a ``.pt``/``.pth``/``.bin``/``.ckpt``, a Trainer's ``optimizer.pt``
or ``scheduler.pt``, or a DCP byte entry: calls that run code when unpickled (at every protocol,
by ``GLOBAL``, ``STACK_GLOBAL`` or a copyreg extension code), object graphs that are kilobytes on
disk and gigabytes when walked, nesting deeper than any reader's stack, and zip archives whose
members are compressed or whose records claim more bytes than they hold.

Nothing here is ever unpickled: the module only writes bytes.
"""

from __future__ import annotations

import builtins
import collections
import copyreg
import io
import os
import pickle  # noqa: TID251 - making the hostile files under test
import struct
import subprocess
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

#: The copyreg extension code an ``EXT1`` payload names (any code 1-255 no library registers).
EXTENSION_CODE = 0xF3
PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)


class Call:
    """A call that runs when unpickled: ``func(*args)``.

    ``func`` may itself be a :class:`Call`, so ``getattr(__import__('os'), 'system')('...')``
    pickles as three nested ``REDUCE`` opcodes with no reference to ``os.system`` at all.
    """

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __call__(self, *args: Any) -> Any:  # pickle asks that a reduce's callable be callable
        raise AssertionError("a hostile payload is only ever pickled")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def touch(marker: Path) -> str:
    return f"touch {marker}"


#: Each payload, given the marker file it creates when run.
PAYLOADS = {
    "system": lambda marker: Call(os.system, touch(marker)),
    "eval": lambda marker: Call(builtins.eval, f"__import__('os').system({touch(marker)!r})"),
    "Popen": lambda marker: Call(subprocess.Popen, ["touch", str(marker)]),
    "getattr": lambda marker: Call(Call(getattr, Call(builtins.__import__, "os"), "system"), touch(marker)),
}


class Evil:
    """An object whose unpickling runs ``os.system('touch MARKER')``: put it anywhere in a saved state."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return os.system, (touch(self.marker),)


def hostile_pickle(payload: str, marker: Path, protocol: int) -> bytes:
    """A pickle at ``protocol`` whose loading runs ``payload`` (a :data:`PAYLOADS` name), creating ``marker``."""
    return pickle.dumps(PAYLOADS[payload](marker), protocol=protocol)  # noqa: TID251 - making the hostile file under test


@contextmanager
def system_extension() -> Iterator[None]:
    """``os.system`` registered under :data:`EXTENSION_CODE`, as a library in the reading process might
    have registered it: pickles made meanwhile name it by ``EXT1`` instead of a global."""
    module, name = os.system.__module__, os.system.__name__
    copyreg.add_extension(module, name, EXTENSION_CODE)
    try:
        yield
    finally:
        copyreg.remove_extension(module, name, EXTENSION_CODE)


def extension_pickle(marker: Path, protocol: int) -> bytes:
    """A pickle that calls ``os.system`` through its copyreg extension code (``EXT1``, protocol 2 and up)."""
    with system_extension():
        data = hostile_pickle("system", marker, protocol)
    assert pickle.EXT1 in data and b"system" not in data, "the payload must name os.system by its code alone"
    return data


def dag_bomb(levels: int = 40) -> bytes:
    """``{"base_lrs": (x0, x1, ..., x40)}`` where ``x[i] = [x[i-1], x[i-1]]``: a few hundred bytes whose
    walk visits 2**levels lists.

    Each level is a new list holding the previous one twice, by memo reference (``BINGET``). Only
    opcodes torch's weights_only unpickler reads are used (no ``POP``), so the levels pile up on the
    stack and end in one tuple.
    """
    key = b"base_lrs"
    out = bytearray(b"\x80\x02" + pickle.EMPTY_DICT + pickle.BINUNICODE + struct.pack("<I", len(key)) + key)
    out += pickle.MARK + pickle.EMPTY_LIST + pickle.BINPUT + bytes([0])
    for level in range(1, levels + 1):
        previous = pickle.BINGET + bytes([level - 1])
        out += pickle.EMPTY_LIST + pickle.MARK + previous + previous + pickle.APPENDS + pickle.BINPUT + bytes([level])
    return bytes(out + pickle.TUPLE + pickle.SETITEM + pickle.STOP)


def deep_nesting(depth: int = 100_000) -> bytes:
    """``[[[...]]]`` nested ``depth`` deep: ``depth`` empty lists pushed, then each appended into the one below."""
    return b"\x80\x02" + pickle.EMPTY_LIST * depth + pickle.APPEND * (depth - 1) + pickle.STOP


class _StorageRef:
    """A storage record of a torch.save archive, pickled by persistent id as torch writes it."""

    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _TensorRef:
    """A float32 tensor over record ``key`` as torch.save pickles one (``_rebuild_tensor_v2``)."""

    def __init__(self, key: str, shape: tuple[int, ...]) -> None:
        self.key, self.shape = key, shape

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        numel = 1
        for size in self.shape:
            numel *= size
        strides = tuple(int(torch.tensor(self.shape[i + 1 :]).prod()) for i in range(len(self.shape)))
        return torch._utils._rebuild_tensor_v2, (
            _StorageRef(self.key, numel),
            0,
            self.shape,
            strides,
            False,
            collections.OrderedDict(),
        )


class _ArchivePickler(pickle.Pickler):  # noqa: TID251 - making the hostile file under test
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


def tensor_pickle(shapes: dict[str, tuple[int, ...]]) -> bytes:
    """A torch.save ``data.pkl`` of ``{name: float32 tensor}``, tensor ``i`` over record ``str(i)``."""
    value = {name: _TensorRef(str(i), shape) for i, (name, shape) in enumerate(shapes.items())}
    buffer = io.BytesIO()
    _ArchivePickler(buffer, protocol=2).dump(value)
    return buffer.getvalue()


def torch_archive(path: Path, data_pkl: bytes, records: dict[str, bytes] | None = None) -> Path:
    """A torch.save zip archive (``archive/data.pkl``, ``byteorder``, ``data/<key>``, ``version``), members stored."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        for key, data in (records or {}).items():
            archive.writestr(f"archive/data/{key}", data)
        archive.writestr("archive/version", "3\n")
    return path


def zip_bomb(path: Path, name: str, gib: int = 2) -> Path:
    """A torch.save archive of ``{name: float32 tensor}`` whose storage record is ``gib`` GiB of zeros,
    deflate-compressed to a few MB."""
    numel = (gib << 30) // 4
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", tensor_pickle({name: (numel,)}))
        archive.writestr("archive/byteorder", "little")
        member = zipfile.ZipInfo("archive/data/0")
        member.compress_type = zipfile.ZIP_DEFLATED
        zeros = bytes(16 << 20)
        with archive.open(member, "w", force_zip64=True) as record:
            for _ in range((gib << 30) // len(zeros)):
                record.write(zeros)
        archive.writestr("archive/version", "3\n")
    return path


def torch_saved(value: Any, path: Path, *, legacy: bool = False) -> Path:
    """``torch.save(value, path)``, as the user's training script wrote it (``legacy``: the pre-zip format)."""
    torch.save(value, path, _use_new_zipfile_serialization=not legacy)  # noqa: TID251 - making the file under test
    return path


def torch_saved_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)  # noqa: TID251 - making the file under test
    return buffer.getvalue()
