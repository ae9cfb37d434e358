"""How ckptstore's costs grow with history and tensor count, against its floors.

Prints, on an embedded store (SQLite and a folder):

1. **History.** A run of models of 1,024 and 16,384 small tensors, one tensor changed per
   version: the commit time and the metadata added per version (growth of the SQLite file,
   averaged over the versions before each mark) at versions 2, 100 and 1000.
2. **Listings.** ``Store.versions`` of those runs at their last version, the run page of the
   16,384-tensor run, a save's ``sizes_held`` question on that store, and the runs index ``/``
   over 1,000 runs (through the real app).
3. **Many tensors.** 32,768 tensors through the client against ``safetensors`` ``save_file``
   of ``model.state_dict()`` (+fsync) and ``load_file`` + ``load_state_dict``, same run: the first save into a fresh
   store, a resave of the same model (every tensor deduplicated), and a load into the model.
4. **First full save.** 256 MiB and 768 MiB fp32 transformers saved into a fresh store
   against ``safetensors`` ``save_file`` + fsync, alternating, three runs each
   (``bench/full_save.py`` runs more).
5. **CLI.** The wall time of ``ckptstore ls`` as a subprocess.

Each line shows its floor and whether it holds. ``--quick`` stops the history at version 100.

    .venv/bin/python bench/scale.py --quick
    .venv/bin/python bench/scale.py
    .venv/bin/python bench/scale.py --many-tensors    # section 3 alone
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from fastapi.testclient import TestClient
from sqlalchemy import text

from ckptstore.client import Client
from ckptstore.service.api.app import create_app
from ckptstore.service.api.pages import data as pages_data
from ckptstore.service.format.bounds import MAX_SIZES_PER_QUERY
from ckptstore.service.format.manifest import ManifestBody, TensorEntry
from ckptstore.service.format.sharding import UnhashedTensor
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_start import compile_bytecode  # noqa: E402
from common import Shape, build_model, layers_for  # noqa: E402
from full_save import ckptstore_save, fresh, safetensors_save  # noqa: E402

KIB = 1024


def median_time(action: Callable[[], Any], repeats: int = 5) -> float:
    """The median wall time of ``action`` over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def db_bytes(store: Store) -> int:
    """The SQLite database's size as its connections see it (WAL content included)."""
    with store.db.engine.connect() as connection:
        pages = connection.execute(text("PRAGMA page_count")).scalar_one()
        size = connection.execute(text("PRAGMA page_size")).scalar_one()
    return int(pages) * int(size)


def stored_entries(store: Store, count: int, seed: int) -> list[TensorEntry]:
    """``count`` four-byte tensors stored in one shard, as manifest entries keyed like a model's."""
    data = [memoryview((seed * 10_000_000 + i).to_bytes(4, "little")) for i in range(count)]
    _receipt, digests = store.put_tensors([UnhashedTensor("F32", (1,), d) for d in data])
    return [
        TensorEntry.model_construct(
            key=f"model/layers.{i // 8}.block.{i % 8}.weight",
            dtype="F32",
            shape=[1],
            dtype_class="floating",
            digest=digest,
            placement="param",
            param=f"layers.{i // 8}.block.{i % 8}.weight",
            device_type="cpu",
            trainable=True,
        )
        for i, digest in enumerate(digests)
    ]


def history(home: Path, tensors: int, marks: list[int]) -> tuple[dict[int, tuple[float, float]], Store]:
    """Commit ``max(marks)`` versions changing one tensor each; ``{mark: (commit s, bytes/version)}``."""
    store = Store.open_home(home)
    entries = stored_entries(store, tensors, 0)
    changes = stored_entries(store, max(marks) + 1, 1)
    found: dict[int, tuple[float, float]] = {}
    window = 5
    sizes: dict[int, int] = {}
    times: dict[int, float] = {}
    for version in range(1, max(marks) + 1):
        slot = version % tensors
        entries[slot] = entries[slot].model_copy(update={"digest": changes[version].digest})
        body = ManifestBody.model_construct(
            tensors=list(entries), state={}, step=version, metrics={"loss": 1.0 / version}, library={}
        )
        if any(0 <= mark - version <= window for mark in marks):
            sizes[version - 1] = db_bytes(store)
        started = time.perf_counter()
        store.commit("run", body)
        times[version] = time.perf_counter() - started
        if version in marks:
            start = max(2, version - window)  # version 1 writes the whole model: left out
            per_version = (db_bytes(store) - sizes[start - 1]) / (version - start + 1)
            recent = [times[v] for v in range(start, version + 1)]
            found[version] = (statistics.median(recent), per_version)
    return found, store


def runs_index_time(home: Path, runs: int) -> tuple[float, float]:
    """(seconds for ``/``, seconds for ``/v1/runs``) with ``runs`` runs of two versions each."""
    store = Store.open_home(home)
    entries = stored_entries(store, 4, 2)
    body = ManifestBody.model_construct(tensors=entries, state={}, step=1, metrics={}, library={})
    for index in range(runs):
        store.commit(f"run-{index:04d}", body, tags=["best"])
        store.commit(f"run-{index:04d}", body)
    with TestClient(create_app(store, Settings(host="127.0.0.1"))) as http:
        assert http.get("/").status_code == 200
        page = median_time(lambda: http.get("/").raise_for_status(), 3)
        api = median_time(lambda: http.get("/v1/runs").raise_for_status(), 3)
    store.close()
    return page, api


class Wide(torch.nn.Module):
    """A model of many small parameters."""

    def __init__(self, count: int, width: int) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(width)) for _ in range(count))


def many_tensors(home: Path, count: int, width: int) -> dict[str, float]:
    """Client save and load of ``count`` tensors against safetensors, in seconds.

    "ckptstore save" is a first save into a fresh store (its client opened off the clock), as a
    new run's first checkpoint is; "ckptstore resave" saves the same model again into the same
    store, which stores nothing new (every tensor deduplicates) but still hashes every tensor
    and commits a version of them all. The load reads into the model from a store holding one
    version.
    """
    model = Wide(count, width)
    target = home / "model.safetensors"
    home.mkdir(parents=True, exist_ok=True)
    stores = iter(range(100))
    clients: list[Client] = []

    def st_save() -> None:
        # As a user saves with safetensors (and bench/methods.py times it): the state_dict is taken too.
        safetensors.torch.save_file({k: v.detach() for k, v in model.state_dict().items()}, str(target))
        with open(target, "rb") as handle:
            os.fsync(handle.fileno())

    def st_load() -> None:
        model.load_state_dict(safetensors.torch.load_file(str(target)))

    def fresh_client() -> Client:
        clients.append(Client(home=home / f"store-{next(stores)}"))
        return clients[-1]

    def first_save() -> float:
        ckpt = fresh_client()
        started = time.perf_counter()
        ckpt.save("wide", model)
        return time.perf_counter() - started

    try:
        found = {
            "safetensors save": median_time(st_save, 3),
            "ckptstore save": statistics.median(first_save() for _ in range(3)),
            "ckptstore resave": median_time(lambda: clients[0].save("wide", model), 3),
            "safetensors load": median_time(st_load, 3),
            "ckptstore load": median_time(lambda: clients[1].load("wide", model=model), 3),
        }
    finally:
        for ckpt in clients:
            ckpt.close()
    return found


def first_full_saves(root: Path, nbytes: int, runs: int) -> list[tuple[float, float]]:
    """(safetensors s, ckptstore s) of the first save of a transformer of ``nbytes`` fp32 into a
    fresh store, ``runs`` times, alternating which goes first."""
    vocab, hidden = 32000, 1024
    model = build_model(Shape(vocab, hidden, layers_for(nbytes, vocab, hidden, torch.float32), "fp32", False), "random")
    safetensors_save(model, fresh(root / "warmup"))  # the first pass over fresh memory is slow on VMs
    found = []
    for run in range(runs):
        if run % 2 == 0:
            theirs = safetensors_save(model, fresh(root / "safetensors"))
            ours = ckptstore_save(model, fresh(root / "ckptstore"), None, None)
        else:
            ours = ckptstore_save(model, fresh(root / "ckptstore"), None, None)
            theirs = safetensors_save(model, fresh(root / "safetensors"))
        found.append((theirs, ours))
    return found


def cli_time(home: Path) -> float:
    """Wall time of ``ckptstore ls`` in a fresh process (modules byte-compiled, as installed)."""
    compile_bytecode()
    command = [str(Path(sys.executable).with_name("ckptstore")), "ls"]
    env = {**os.environ, "CKPTSTORE_HOME": str(home)}
    env.pop("CKPTSTORE_URL", None)

    def run() -> None:
        subprocess.run(command, env=env, check=True, capture_output=True)

    return median_time(run, 3)


def verdict(value: float, floor: float) -> str:
    return "ok" if value <= floor else "MISSED"


def many_tensors_table(root: Path) -> None:
    """Print the 32,768-tensor rows (section 3)."""
    print("\n## 32,768 tensors of 1024 floats (128 MiB), client against safetensors")
    times = many_tensors(root / "wide", 32768, 1024)
    for what, theirs_what in (("save", "save"), ("resave", "save"), ("load", "load")):
        ours, theirs = times[f"ckptstore {what}"], times[f"safetensors {theirs_what}"]
        ratio = ours / theirs
        label = {"save": "first save into a fresh store", "resave": "resave, all deduplicated"}.get(what, what)
        print(
            f"{label}: ckptstore {ours:.2f} s, safetensors {theirs_what} {theirs:.2f} s,"
            f" {ratio:.2f}x (floor 1.3x: {verdict(ratio, 1.3)}, goal 1.1x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="stop the history at version 100")
    parser.add_argument("--many-tensors", action="store_true", help="only the 32,768-tensor rows")
    args = parser.parse_args()
    if args.many_tensors:
        with tempfile.TemporaryDirectory(prefix="ckptstore-scale-") as scratch:
            many_tensors_table(Path(scratch))
        return
    marks = [2, 100] if args.quick else [2, 100, 1000]
    with tempfile.TemporaryDirectory(prefix="ckptstore-scale-") as scratch:
        root = Path(scratch)
        print(f"## History: one tensor changed per version (marks {marks})")
        print(f"{'tensors':>8} {'version':>8} {'commit ms':>10} {'metadata/version':>17} {'floor':>22}")
        listing: dict[int, float] = {}
        run_page = sizes_held = 0.0
        for tensors in (1024, 16384):
            found, store = history(root / f"h{tensors}", tensors, marks)
            first = found[2][0]
            for mark, (seconds, per_version) in found.items():
                floor = ""
                if tensors == 16384 and mark > 2:
                    ok = per_version <= 256 * KIB and seconds <= 1.3 * first
                    floor = f"256 KiB, 1.3x v2: {'ok' if ok else 'MISSED'}"
                shown = f"{per_version / KIB:.1f} KiB"
                print(f"{tensors:>8} {mark:>8} {seconds * 1000:>10.1f} {shown:>17} {floor:>22}")
            listing[tensors] = median_time(lambda s=store: s.versions("run"))
            if tensors == 16384:
                run_page = median_time(lambda s=store: pages_data.run_page(s, "run"), 3)
                sizes_held = median_time(lambda s=store: s.sizes_held(range(1, MAX_SIZES_PER_QUERY + 1)))
            store.close()
        print(f"\n## Listings at version {marks[-1]}")
        for tensors, seconds in listing.items():
            shown = f"{seconds * 1000:.1f} ms (floor 50 ms: {verdict(seconds, 0.05)})"
            print(f"versions() of the {tensors}-tensor run: {shown}")
        print(f"run page of the 16384-tensor run: {run_page * 1000:.1f} ms")
        print(f"sizes_held of {MAX_SIZES_PER_QUERY} sizes (a save asks) on that store: {sizes_held * 1000:.1f} ms")
        page, api = runs_index_time(root / "runs", 1000)
        print(f"/ with 1000 runs: {page:.3f} s (floor 0.2 s: {verdict(page, 0.2)}); /v1/runs: {api:.3f} s")
        many_tensors_table(root)
        print("\n## First full save into a fresh store, fp32, durable (ratio: safetensors s / ckptstore s)")
        for mib in (256, 768):
            found = first_full_saves(root / f"full-{mib}", mib << 20, 3)
            ratios = [theirs / ours for theirs, ours in found]
            wins = sum(ratio >= 1.0 for ratio in ratios)
            print(
                f"{mib} MiB: ckptstore {', '.join(f'{ours:.3f}' for _, ours in found)} s;"
                f" safetensors {', '.join(f'{theirs:.3f}' for theirs, _ in found)} s;"
                f" {', '.join(f'{r:.2f}x' for r in ratios)} (floor 1.0x: {wins} of {len(found)} runs)"
            )
        seconds = cli_time(root / "runs")
        print(f"\n## CLI\nckptstore ls: {seconds:.2f} s wall (floor 0.5 s: {verdict(seconds, 0.5)})")


if __name__ == "__main__":
    main()
