"""Schema migrations: an empty database upgrades to head, the models and the migrations agree,
a database at another revision is refused with the fix named, and the scripts ship in the package.

Each test gets a brand-new database: a SQLite file, or a PostgreSQL database made for it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select, text

from ckptstore.service.db import Database
from ckptstore.service.db.models import Base
from ckptstore.service.db.schema import (
    alembic_config,
    current_revision,
    head_revision,
    migrations_dir,
    require_current,
    revisions,
    upgrade,
)
from ckptstore.service.errors import StorageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pytest brings tomli on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A database with nothing in it."""
    if request.param == "sqlite":
        database = Database(f"sqlite:///{tmp_path / 'metadata.db'}")
    else:
        database = Database(request.getfixturevalue("postgres_databases").create())
    try:
        yield database
    finally:
        database.dispose()


def tables(database: Database) -> set[str]:
    return set(inspect(database.engine).get_table_names())


def differences(database: Database) -> list[object]:
    """What autogenerate would change to make ``database`` match the models."""
    with database.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return list(compare_metadata(context, Base.metadata))


def test_upgrade_brings_an_empty_database_to_head(empty_database: Database) -> None:
    assert current_revision(empty_database) is None

    upgrade(empty_database)

    assert current_revision(empty_database) == head_revision()
    assert tables(empty_database) == {*Base.metadata.tables, "alembic_version"}
    require_current(empty_database)
    upgrade(empty_database)  # already at head: nothing to do
    assert current_revision(empty_database) == head_revision()


def test_models_and_migrations_agree(empty_database: Database) -> None:
    upgrade(empty_database)
    assert differences(empty_database) == []


def test_the_comparison_notices_a_schema_that_drifted(empty_database: Database) -> None:
    # Guards the test above: a comparison that saw nothing would pass it vacuously.
    upgrade(empty_database)
    expected = {("add_index", "ix_part_refs_digest"), ("remove_column", "stray")}
    with empty_database.engine.begin() as connection:
        connection.exec_driver_sql("DROP INDEX ix_part_refs_digest")
        connection.exec_driver_sql("ALTER TABLE runs ADD COLUMN stray INTEGER")
        if empty_database.dialect == "postgresql":  # SQLite cannot change a column's type in place
            connection.exec_driver_sql("ALTER TABLE shards ALTER COLUMN size TYPE INTEGER")
            expected.add(("modify_type", "size"))

    flat = [diff for item in differences(empty_database) for diff in (item if isinstance(item, list) else [item])]
    found = {(diff[0], diff[3] if diff[0].startswith("modify_") else diff[-1].name) for diff in flat}

    assert found == expected


def test_an_empty_database_is_refused_with_the_fix_named(empty_database: Database) -> None:
    expected = (
        f"revision none (an empty database) but this ckptstore needs {head_revision()}: run `ckptstore db upgrade`"
    )
    with pytest.raises(StorageError, match=re.escape(expected)):
        require_current(empty_database)
    assert tables(empty_database) == set()  # checking changed nothing


def test_a_database_from_a_newer_ckptstore_is_refused_and_left_alone(empty_database: Database) -> None:
    upgrade(empty_database)
    with empty_database.engine.begin() as connection:
        connection.exec_driver_sql("UPDATE alembic_version SET version_num = '9999_future'")

    with pytest.raises(StorageError, match="9999_future.*upgrade ckptstore"):
        require_current(empty_database)
    with pytest.raises(StorageError, match="9999_future.*upgrade ckptstore"):
        upgrade(empty_database)

    assert current_revision(empty_database) == "9999_future"


def test_downgrade_to_base_removes_every_table_and_upgrade_restores_them(empty_database: Database) -> None:
    upgrade(empty_database)
    with empty_database.engine.begin() as connection:
        command.downgrade(alembic_config(connection), "base")
    assert tables(empty_database) == {"alembic_version"}
    assert current_revision(empty_database) is None

    upgrade(empty_database)

    assert differences(empty_database) == []


def test_opening_a_served_database_requires_the_newest_schema(postgres_databases: Any) -> None:
    url = postgres_databases.create()
    with pytest.raises(StorageError, match=re.escape("run `ckptstore db upgrade`")):
        Database.open(url)
    migrating = Database(url)
    try:
        assert tables(migrating) == set()  # opening did not migrate: that is the operator's call
        upgrade(migrating)
    finally:
        migrating.dispose()
    opened = Database.open(url)
    try:
        assert current_revision(opened) == head_revision()
    finally:
        opened.dispose()


def test_opening_a_sqlite_url_migrates_it(tmp_path: Path) -> None:
    opened = Database.open(f"sqlite:///{tmp_path / 'metadata.db'}")
    try:
        assert current_revision(opened) == head_revision()
    finally:
        opened.dispose()


def test_an_unreachable_database_is_a_storage_error() -> None:
    unreachable = Database("postgresql+psycopg://nobody@127.0.0.1:1/none", connect_args={"connect_timeout": 5})
    try:
        with pytest.raises(StorageError, match="schema revision"):
            require_current(unreachable)
        with pytest.raises(StorageError, match="could not upgrade"):
            upgrade(unreachable)
    finally:
        unreachable.dispose()


def test_create_schema_migrates_rather_than_creating_tables_unversioned(tmp_path: Path) -> None:
    database = Database(f"sqlite:///{tmp_path / 'metadata.db'}", create_schema=True)
    try:
        assert current_revision(database) == head_revision()
    finally:
        database.dispose()


def test_an_embedded_store_upgrades_itself_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "new-home" / "metadata.db"
    first = Database.sqlite_file(path)
    first.dispose()
    reopened = Database.sqlite_file(path)
    try:
        assert current_revision(reopened) == head_revision()
        require_current(reopened)
        assert differences(reopened) == []
    finally:
        reopened.dispose()


def test_postgresql_connections_dropped_by_the_server_are_replaced(pg_url: str) -> None:
    database, admin = Database(pg_url), Database(pg_url)
    try:
        with database.transaction() as session:
            pid = session.scalar(select(text("pg_backend_pid()")))
        with admin.transaction() as session:  # e.g. a server restart or a proxy closing idle connections
            assert session.scalar(select(text(f"pg_terminate_backend({int(pid)})"))) is True

        with database.transaction() as session:
            assert session.scalar(select(text("pg_backend_pid()"))) != pid
    finally:
        database.dispose()
        admin.dispose()


# -- packaging ----------------------------------------------------------------------------------


def test_migration_scripts_are_found_through_the_service_package() -> None:
    folder = migrations_dir()
    assert (folder / "env.py").is_file()
    assert (folder / "script.py.mako").is_file()
    assert (folder / "versions" / "0001_initial.py").is_file()


def test_the_revisions_read_without_alembic_are_alembics_own() -> None:
    # Opening a store checks its revision from the scripts' revision lines, never importing Alembic.
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(alembic_config())
    assert revisions() == {script.revision: script.down_revision for script in scripts.walk_revisions()}
    assert head_revision() == scripts.get_current_head()


def test_opening_a_store_imports_no_alembic(tmp_path: Path) -> None:
    Database.sqlite_file(tmp_path / "metadata.db").dispose()  # created and migrated: Alembic runs here
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from ckptstore.service.db import Database\n"
        f"Database.sqlite_file(Path({str(tmp_path / 'metadata.db')!r})).dispose()\n"
        "assert 'alembic' not in sys.modules, 'opening a current store imported alembic'\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_every_package_goes_into_the_wheel() -> None:
    # The package list in pyproject.toml is written out (discovery cannot map client/, service/ and
    # migrations/ under the one name ckptstore), so a new package folder must be added there or a
    # `pip install .` would lack it. client/_ckptstore/ is the package ckptstore itself.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        "client": "ckptstore.client",
        "service": "ckptstore.service",
        "migrations": "ckptstore.service.migrations",
    }
    on_disk = {
        ".".join((folders[top], *p.parent.relative_to(ROOT / top).parts))
        for top in folders
        for p in (ROOT / top).rglob("__init__.py")
        if "_ckptstore" not in p.parts
    }
    assert sorted(config["packages"]) == sorted(on_disk | {"ckptstore"})
    assert config["package-dir"] == {"ckptstore": "client/_ckptstore", **{v: k for k, v in folders.items()}}
    assert config["package-data"]["ckptstore.service.migrations"] == ["script.py.mako"]


def test_both_packages_ship_their_typing_marker() -> None:
    # PEP 561: without py.typed in the wheel, a user's type checker ignores our annotations.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for folder in ("client", "service"):
        assert (ROOT / folder / "py.typed").is_file()
        assert "py.typed" in config["package-data"][f"ckptstore.{folder}"]


def test_a_store_created_before_migrations_is_stamped_and_opens(tmp_path: Path) -> None:
    from ckptstore.service.db import schema as schema_module

    path = tmp_path / "old" / "metadata.db"
    path.parent.mkdir()
    old = Database(f"sqlite:///{path}")
    with old.engine.begin() as connection:
        command.upgrade(schema_module.alembic_config(connection), "0001")
        connection.exec_driver_sql("DROP TABLE alembic_version")  # as stores made before Alembic
    old.dispose()
    database = Database.sqlite_file(path)
    try:
        assert schema_module.current_revision(database) == schema_module.head_revision()
    finally:
        database.dispose()


def test_revision_0007_gives_every_stored_version_the_digests_a_commit_writes(
    empty_database: Database, tmp_path: Path
) -> None:
    from ckptstore.service.blobs import LocalBlobStore
    from ckptstore.service.db.models import Version, table
    from ckptstore.service.format.manifest import ManifestBody, TensorEntry
    from ckptstore.service.format.sharding import UnhashedTensor
    from ckptstore.service.store import Store

    upgrade(empty_database)
    store = Store(empty_database, LocalBlobStore(tmp_path / "blobs"), tmp_path / "staging")
    _receipt, digests = store.put_tensors([UnhashedTensor("U8", (n,), memoryview(bytes(n))) for n in (1, 2, 3)])
    entries = [
        TensorEntry(
            key=f"model/{n}",
            dtype="U8",
            shape=[n + 1],
            dtype_class="integer",
            digest=digest,
            placement="target",
            device_type="cpu",
            trainable=n == 0,
        )
        for n, digest in enumerate(digests)
    ]
    # More versions than the migration fills in one batch (200), in two runs.
    for number in range(205):
        body = ManifestBody(tensors=entries[: 1 + number % 3], step=number, metrics={"loss": 1 / (number + 1)})
        store.commit(f"run-{number % 2}", body)
    versions = table(Version)
    columns = select(versions.c.run_id, versions.c.version, versions.c.manifest_digest, versions.c.figures_digest)
    with empty_database.engine.connect() as connection:
        written = set(connection.execute(columns).all())
    assert len(written) == 205 and all(len(row[2]) == len(row[3]) == 64 for row in written)

    with empty_database.engine.begin() as connection:
        command.downgrade(alembic_config(connection), "0006")
    assert "manifest_digest" not in {c["name"] for c in inspect(empty_database.engine).get_columns("versions")}
    upgrade(empty_database)

    with empty_database.engine.connect() as connection:
        assert set(connection.execute(columns).all()) == written
    assert store.check_metadata("run-0", 1) == [] and store.check_metadata("run-1", "latest") == []
    assert store.manifest("run-1", 100).step == 199  # run-1 holds the odd numbers
