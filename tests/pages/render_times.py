"""Render times of the HTML pages at 1,000 runs and a run of 1,000 versions (a script, not a test).

    .venv/bin/python -m tests.pages.render_times                 # 1000 runs, a run of 1000 versions
    .venv/bin/python -m tests.pages.render_times --huge 100000   # and a run of 100,000 versions

Builds an embedded store in a temporary folder: 999 small runs and run 'big' (1,000 versions of a
model of 48 tensors, 8 of them trainable and changed each version, with their Adam state; loss and
lr on every version, val_loss on every tenth, a tag on every hundredth). ``--huge N`` adds run
'huge' of N versions written straight into the versions table (copies of one version's row), to
show that the run page's charts read a bounded sample. Each page is fetched through the real app
in-process; the figure is the median wall time of the requests, with the app's own Server-Timing
beside it, and the size of the HTML.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import insert, select

from ckptstore.service.api import create_app
from ckptstore.service.db.models import Version
from ckptstore.service.format.manifest import ManifestBody
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.pages.kit import entry, ingest, raw

BASE = [raw(10_000 + i, (64, 64)) for i in range(40)]
PAGES = [
    "/",
    "/?q=run-01",
    "/?sort=stored",
    "/?sort=metric&order=asc",
    "/runs/big",
    "/runs/big?page=15",
    "/runs/big?sort=metric:loss&order=asc",
    "/runs/big?tag=keep-*",
    "/runs/big?metric=loss&min=0.5&max=1.5",
    "/runs/big/versions/1000",
    "/runs/big/versions/1000?q=*adapter*",
    "/runs/big/diff?a=1&b=1000",
    "/runs/big/diff?a=999&b=1000&values=1",
    "/runs/run-0005",
]


def version_body(store: Store, number: int) -> ManifestBody:
    """Version ``number`` of run 'big': the frozen base, 8 new adapter tensors and their Adam state."""
    adapters = [raw(1_000_000 + number * 100 + i, (16, 64)) for i in range(8)]
    moments = [raw(2_000_000 + number * 100 + i, (16, 64)) for i in range(16)]
    ingest(store, *adapters, *moments)
    tensors = [entry(f"model/base.{i}.weight", t, trainable=False) for i, t in enumerate(BASE)]
    tensors += [entry(f"model/adapter.{i}.weight", t, trainable=True) for i, t in enumerate(adapters)]
    for i, t in enumerate(moments):
        name = f"adapter.{i // 2}.weight"
        tensors.append(entry(f"optim/state/{name}/exp_avg{'_sq' if i % 2 else ''}", t, placement="param", param=name))
    metrics = {"loss": 2.0 / (1 + number / 100), "lr": 1e-4 * 0.999**number}
    if number % 10 == 0:
        metrics["val_loss"] = metrics["loss"] * 1.1
    state = {"optim": {"state": {}, "param_groups": [{"lr": metrics["lr"], "betas": [0.9, 0.999], "params": []}]}}
    return ManifestBody(tensors=tensors, step=number * 50, metrics=metrics, state=state)


def build(home: Path, runs: int, versions: int, huge: int) -> None:
    """The store the pages are timed on."""
    store = Store.open_home(home)
    try:
        ingest(store, *BASE)
        small = [entry(f"model/base.{i}.weight", t, trainable=False) for i, t in enumerate(BASE[:4])]
        for index in range(runs - 1):
            tags = ["best"] if index % 3 == 0 else []
            body = ManifestBody(tensors=small, step=index, metrics={"loss": 1 / (index + 1)})
            store.commit(f"run-{index:04d}", body, tags=tags)
        for number in range(1, versions + 1):
            tags = [f"keep-{number}"] if number % 100 == 0 else []
            store.commit("big", version_body(store, number), tags=tags)
        if huge:
            copy_versions(store, "huge", huge)
    finally:
        store.close()


def copy_versions(store: Store, run_id: str, count: int) -> None:
    """Run ``run_id`` of ``count`` versions: one committed version, then copies of its row."""
    store.commit(run_id, ManifestBody(tensors=[entry("model/base.0.weight", BASE[0], trainable=False)]))
    with store.db.transaction() as session:
        row = session.execute(select(Version).where(Version.run_id == run_id)).scalar_one()
        fields = {c.name: getattr(row, c.name) for c in Version.__table__.columns}
        for start in range(2, count + 1, 5000):
            rows = [
                {**fields, "version": n, "parent": n - 1, "step": n, "metrics": {"loss": 1 / n}}
                for n in range(start, min(count, start + 4999) + 1)
            ]
            session.execute(insert(Version), rows)


def measure(client: TestClient, url: str, repeats: int) -> tuple[float, float, int]:
    """(median wall ms, median app ms from Server-Timing, HTML bytes) of ``url``."""
    walls, apps = [], []
    size = 0
    for _ in range(repeats):
        started = time.perf_counter()
        response = client.get(url)
        walls.append((time.perf_counter() - started) * 1000)
        if response.status_code != 200:
            raise SystemExit(f"{url}: {response.status_code} {response.text[:300]}")
        apps.append(float(response.headers["server-timing"].split("dur=")[1]))
        size = len(response.content)
    return statistics.median(walls), statistics.median(apps), size


def main(argv: list[str] | None = None) -> None:
    """Build the store, then print each page's render time."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--versions", type=int, default=1000)
    parser.add_argument("--huge", type=int, default=0, help="also a run of this many versions")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        home = Path(folder) / "home"
        started = time.perf_counter()
        build(home, args.runs, args.versions, args.huge)
        print(f"built {args.runs} runs, run 'big' of {args.versions} versions in {time.perf_counter() - started:.0f} s")
        store = Store.open_home(home)
        try:
            app = create_app(store, Settings(home=home, tokens=None, host="127.0.0.1"))
            pages = PAGES + (["/runs/huge", "/runs/huge?page=1000", "/?q=huge"] if args.huge else [])
            with TestClient(app, base_url="http://127.0.0.1") as client:
                client.get("/")  # the first request loads the templates
                print(f"{'page':<44} {'wall ms':>8} {'app ms':>8} {'HTML KiB':>9}")
                for url in pages:
                    wall, inside, size = measure(client, url, args.repeats)
                    flag = "" if wall < 200 else "  over 200 ms"
                    print(f"{url:<44} {wall:8.1f} {inside:8.1f} {size / 1024:9.1f}{flag}")
        finally:
            store.close()


if __name__ == "__main__":
    main(sys.argv[1:])
