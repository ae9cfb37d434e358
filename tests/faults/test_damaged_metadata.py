"""Stored values that no longer parse are the store's own error naming the damage, never a raw one.

A disk fault can leave a SQLite row whose JSON, timestamp or text no longer parses. Whatever
reads it (a load, a listing, verify) must fail with the store's own error (IntegrityError: the
stored bytes are wrong, so retrying cannot help), which the CLI prints as one line and a server
answers as 400 ``integrity``: not a ``JSONDecodeError``, ``ValueError`` or
``UnicodeDecodeError`` escaping as a traceback or a 500. Each damage is written with the
``sqlite3`` module straight into the metadata file, behind the store's back.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import client
from ckptstore.service.db.session import DAMAGED
from ckptstore.service.errors import CheckpointError, IntegrityError, StorageError
from ckptstore.service.settings import METADATA_FILE


def saved_home(home: Path) -> Path:
    """An embedded store holding one version of a small model."""
    torch.manual_seed(0)
    with client.Client(home=home) as ckpt:
        ckpt.save("run", torch.nn.Linear(3, 2), step=1, metrics={"loss": 0.5})
    return home


def damage(home: Path, sql: str, *parameters: object) -> None:
    """Run ``sql`` on the metadata file with the plain driver (no store, no checks)."""
    with sqlite3.connect(home / METADATA_FILE) as connection:
        connection.execute(sql, parameters)


DAMAGES: dict[str, tuple[str, tuple[object, ...], Callable[[client.Client], object]]] = {
    "a shape that is not JSON": (
        "UPDATE tensors SET shape = ?",
        ("[2,,3]",),
        lambda ckpt: ckpt.load("run", 1),
    ),
    "a timestamp that is not one": (
        "UPDATE runs SET created_at = ?",
        ("2026-12-07 21:50:52.61\x13061",),
        lambda ckpt: ckpt.load("run", 1),
    ),
    "a version's metrics that are not JSON": (
        "UPDATE versions SET metrics = ?",
        ('{"loss": 0.5',),
        lambda ckpt: ckpt.versions("run"),
    ),
    "text that is not UTF-8": (
        "UPDATE versions SET manifest = CAST(? AS TEXT)",
        (b'{"format":"ckptstore.manifest/1\xa0\xff',),
        lambda ckpt: ckpt.load("run", 1),
    ),
}


@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_damaged_stored_value_is_a_storage_error_naming_the_damage(tmp_path: Path, name: str) -> None:
    home = saved_home(tmp_path / "home")
    sql, parameters, read = DAMAGES[name]
    damage(home, sql, *parameters)
    with client.Client(home=home) as ckpt, pytest.raises((IntegrityError, StorageError)) as caught:
        read(ckpt)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("metadata database error"), message
    if name != "text that is not UTF-8":  # SQLite's driver refuses that one itself, in its words
        assert isinstance(caught.value, IntegrityError) and DAMAGED in message, message


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=24), column=st.sampled_from(["shape", "dtype"]))
def test_any_bytes_in_a_tensor_row_load_right_or_fail_with_the_stores_error(
    tmp_path_factory: pytest.TempPathFactory, data: bytes, column: str
) -> None:
    home = saved_home(tmp_path_factory.mktemp("home"))
    with client.Client(home=home) as ckpt:
        expected = ckpt.load("run", 1).state_dict
    damage(home, f"UPDATE tensors SET {column} = CAST(? AS TEXT)", data)
    with client.Client(home=home) as ckpt:
        try:
            loaded = ckpt.load("run", 1).state_dict
        except CheckpointError:
            return  # refused, in the store's own words
    assert loaded is not None and expected is not None
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[key], expected[key]) for key in expected)
