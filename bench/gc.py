"""How long garbage collection takes: N shards, half of them garbage, on SQLite and PostgreSQL.

    .venv/bin/python bench/gc.py [--shards 1000] [--tensors-per-shard 4] [--postgres URL]

Builds a fresh store with local blobs, ingests ``--shards`` small shards, commits versions that
reference every shard, deletes the versions referencing half of them, then times a dry run and a
real sweep (grace 0), and ``missing()`` over every remaining digest (it stamps what it reports
present, the cost a save pays so a collection spares its tensors). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "service"))

from shardkit import body, build_shard, entry, raw  # noqa: E402

from ckptstore.service.blobs import LocalBlobStore  # noqa: E402
from ckptstore.service.db import Database, schema  # noqa: E402
from ckptstore.service.db.models import utcnow  # noqa: E402
from ckptstore.service.store import Store  # noqa: E402


def postgres_store(url: str, home: Path) -> tuple[Store, str]:
    import psycopg
    from sqlalchemy.engine import make_url

    base = make_url(url)
    name = f"ckptstore_bench_{uuid.uuid4().hex[:12]}"
    admin = base.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    database = Database(base.set(database=name).render_as_string(hide_password=False))
    schema.upgrade(database)
    return Store(database, LocalBlobStore(home / "blobs"), home / "staging"), name


def drop_database(url: str, name: str) -> None:
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run(store: Store, shards: int, per_shard: int) -> dict[str, float]:
    rng = random.Random(0)
    entries = []
    started = time.perf_counter()
    for index in range(shards):
        tensors = [raw("F32", (rng.randint(16, 256),), index * per_shard + i) for i in range(per_shard)]
        store.ingest_file(build_shard(tensors).write(store.staging_path()))
        entries.append([entry(f"model/{index}.{i}", t) for i, t in enumerate(tensors)])
    ingest_seconds = time.perf_counter() - started
    versions = 10
    per_version = shards // versions
    for v in range(versions):
        chunk = [e for group in entries[v * per_version : (v + 1) * per_version] for e in group]
        store.commit("bench", body(*chunk))
    for v in range(1, versions + 1, 2):
        store.delete_version("bench", v)
    now = utcnow() + timedelta(seconds=1)
    started = time.perf_counter()
    dry = store.gc(grace_seconds=0, dry_run=True, now=now)
    dry_seconds = time.perf_counter() - started
    started = time.perf_counter()
    real = store.gc(grace_seconds=0, now=now)
    real_seconds = time.perf_counter() - started
    assert dry.shards_swept == real.shards_swept == shards // 2, (dry, real)
    kept = [e.digest for group in entries for e in group]
    started = time.perf_counter()
    store.missing(kept)
    missing_seconds = time.perf_counter() - started
    started = time.perf_counter()
    store.missing(kept)
    missing_again = time.perf_counter() - started
    return {
        "ingest": ingest_seconds,
        "dry": dry_seconds,
        "sweep": real_seconds,
        "swept": float(real.shards_swept),
        "missing": missing_seconds,
        "missing_again": missing_again,
        "digests": float(len(kept)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--tensors-per-shard", type=int, default=4)
    parser.add_argument("--postgres", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    print("| database | shards | swept | dry run s | sweep s | missing() over all digests s (stamping) |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in ("sqlite", "postgresql"):
        with tempfile.TemporaryDirectory() as scratch:
            home = Path(scratch)
            name = None
            if kind == "sqlite":
                store = Store.open_home(home)
            else:
                store, name = postgres_store(args.postgres, home)
            try:
                figures = run(store, args.shards, args.tensors_per_shard)
            finally:
                store.close()
                if name is not None:
                    drop_database(args.postgres, name)
        print(
            f"| {kind} | {args.shards} | {figures['swept']:.0f} | {figures['dry']:.3f} | {figures['sweep']:.3f} "
            f"| {figures['missing']:.3f} ({figures['digests']:.0f} digests) |"
        )


if __name__ == "__main__":
    main()
