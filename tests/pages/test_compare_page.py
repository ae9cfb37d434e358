"""The compare page (/compare?run=a&run=b…): a chart per metric with a line per run, the newest
versions' hyperparameters side by side, the runs page's form that opens it, its bounds (runs
compared, points drawn, statements run) and its access rules, through the real app."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from ckptstore.service.api import create_app
from ckptstore.service.api.pages import compare as pages_compare
from ckptstore.service.api.pages import runs as pages_runs
from ckptstore.service.format.manifest import ManifestBody
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.pages.dom import Node, parse
from tests.pages.kit import LONG, READ_TOKEN, TOKENS, entry, ingest, long_loss, page_client, raw, seed
from tests.pages.test_pages import page

HOSTILE = "<script>alert(1)</script>"


def betas_state(lr: float, betas: list[float], note: str = "plain") -> dict[str, Any]:
    """An optimizer section as the client writes it: betas as a tuple marker, and a text setting."""
    group = {"lr": lr, "betas": {"__tuple__": betas}, "note": note, "params": ["w"]}
    return {"optim": {"state": {}, "param_groups": [group]}}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page tests' runs, and 'lr-a' / 'lr-b': 13 versions each at steps 0…12 with loss and a
    tiny lr; 'lr-b' has other betas and a setting holding markup."""
    folder = tmp_path_factory.mktemp("compare") / "home"
    store = Store.open_home(folder)
    try:
        seed(store)
        tensor = raw(7000, (4,))
        ingest(store, tensor)
        entries = [entry("model/w", tensor, trainable=True)]
        for run, scale, betas, note in (("lr-a", 1.0, [0.9, 0.999], "plain"), ("lr-b", 2.0, [0.89, 0.999], HOSTILE)):
            for step in range(13):
                lr = 0.000256862 * (1 - step / 13) + 1.19898e-07
                metrics = {"loss": scale / (1 + step), "lr": lr}
                body = ManifestBody(tensors=entries, step=step, metrics=metrics, state=betas_state(lr, betas, note))
                store.commit(run, body)
    finally:
        store.close()
    return folder


@pytest.fixture
def client(home: Path) -> Iterator[TestClient]:
    with page_client(home) as test_client:
        yield test_client


def lines(doc: Node, metric: str) -> dict[str, list[int]]:
    """Run -> the versions of its line's points in the chart of ``metric``, left to right."""
    figure = doc.one("figure", **{"data-metric": metric})
    return {
        g.attrs["data-run"]: [int(c.attrs["data-version"]) for c in g.all("circle", class_="pt")]
        for g in figure.all("g", class_="series")
    }


def values(doc: Node) -> dict[str, list[str]]:
    return {row[0]: row[1:] for row in doc.one("table", id="values").rows()}


def test_each_metric_is_one_chart_with_a_line_per_run(client: TestClient) -> None:
    doc = page(client, "/compare?run=lr-a&run=lr-b")
    assert doc.one("h1").text == "Compare 2 runs"
    figures = doc.one("section", id="charts").all("figure", class_="metric-chart")
    assert [f.attrs["data-metric"] for f in figures] == ["loss", "lr"]
    assert lines(doc, "loss") == {"lr-a": list(range(1, 14)), "lr-b": list(range(1, 14))}
    loss = doc.one("figure", **{"data-metric": "loss"})
    assert [g.attrs["class"] for g in loss.all("g", class_="series")] == ["series s0", "series s1"]
    assert len(loss.all("polyline")) == 2
    first = loss.one("g", **{"data-run": "lr-b"}).one("circle", **{"data-version": "1"})
    assert first.one("title").text == "lr-b · v1 · step 0 · loss 2.000000"
    # The step axis counts whole steps; the lr series and its axis are each in one notation.
    assert [t.text for t in loss.all("text", class_="x")] == ["0", "5", "10"]  # never 2.5, 7.5
    lr = doc.one("figure", **{"data-metric": "lr"})
    hovers = [c.one("title").text.rsplit(" ", 1)[1] for c in lr.all("circle", class_="pt")]
    assert all("e-" in text for text in hovers) and "1.19898e-07" not in hovers  # sci, 6 digits each
    assert {t.text for t in lr.all("text", class_="y")} <= {"0.0000", "0.0001", "0.0002", "0.0003"}
    runs = {row[0]: row[1:] for row in doc.one("table", id="compared-runs").rows()}
    assert runs == {
        "lr-a": ["13", "v13", "12", "16 B", "every version"],
        "lr-b": ["13", "v13", "12", "16 B", "every version"],
    }


def test_the_newest_versions_hyperparameters_side_by_side(client: TestClient) -> None:
    response = client.get("/compare?run=lr-a&run=lr-b")
    assert HOSTILE not in response.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in response.text
    doc = parse(response.text)
    header = doc.one("table", id="values").header()
    assert header == ["Path", "lr-a v13", "lr-b v13"]
    found = values(doc)
    assert found == {
        "metrics/loss": ["0.0769231", "0.1538462"],  # one row, one number of decimals
        "optim/param_groups/0/betas": ["(0.9, 0.999)", "(0.89, 0.999)"],
        "optim/param_groups/0/note": ['"plain"', f'"{HOSTILE}"'],
    }
    cells = {cell.text: cell.attrs.get("title") for cell in doc.one("table", id="values").all("td")}
    assert cells["(0.89, 0.999)"] == '{"__tuple__": [0.89, 0.999]}'  # the stored value on hover
    every = values(page(client, "/compare?run=lr-a&run=lr-b&all=1"))
    assert every["step"] == ["12", "12"] and every["metrics/lr"] == ["1.98785e-05", "1.98785e-05"]
    assert ("/compare?run=lr-a&run=lr-b&all=1", "also the 3 every run shares") in doc.links()


def test_runs_with_different_metrics_and_lengths(client: TestClient) -> None:
    doc = page(client, f"/compare?run=alpha&run={LONG}&run=lr-a")
    assert [f.attrs["data-metric"] for f in doc.all("figure", class_="metric-chart")] == [
        "acc",
        "loss",
        "lr",
        "val_loss",
    ]
    assert lines(doc, "acc") == {"alpha": [1, 2]}  # only the run reporting it has a line
    assert lines(doc, "loss") == {"alpha": [1, 2], LONG: list(range(1, 121)), "lr-a": list(range(1, 14))}
    assert [g.attrs["class"] for g in doc.one("figure", **{"data-metric": "val_loss"}).all("g")] == [
        "grid",
        "series s1",
    ]
    found = values(doc)
    assert found["step"] == ["20", "12,000", "12"]
    assert found["metrics/acc"] == ["0.5", "—", "—"]
    assert found["metrics/loss"] == ["1.5000000", f"{long_loss(120):.7f}", "0.0769231"]


def test_the_runs_page_form_opens_the_comparison(client: TestClient) -> None:
    doc = page(client, "/")
    form = doc.one("form", id="compare-runs")
    assert form.attrs["action"] == "/compare" and form.attrs["method"] == "get"
    boxes = form.all("input", type="checkbox")
    assert {b.attrs["value"] for b in boxes} == {"alpha", LONG, "lr-a", "lr-b"}
    assert all(b.attrs["name"] == "run" for b in boxes)
    assert form.one("button", id="compare-runs-button").text == "Compare runs"


@pytest.mark.parametrize(
    ("query", "status", "words"),
    [
        ("", 400, "pick at least two runs"),
        ("?run=alpha", 400, "pick at least two runs"),
        ("?run=alpha&run=alpha", 400, "pick at least two runs"),  # the same run twice is one run
        ("?" + "&".join(f"run=r{i}" for i in range(9)), 400, "9 runs were picked; a page compares at most 8"),
        ("?run=alpha&run=nobody", 404, "nobody"),
        ("?run=alpha&run=..%2Fetc", 400, "run id"),
    ],
)
def test_a_comparison_out_of_bounds_is_a_clear_4xx_page(
    client: TestClient, query: str, status: int, words: str
) -> None:
    response = client.get("/compare" + query)
    assert response.status_code == status, response.text[:500]
    assert words in parse(response.text).one("p", class_="message").text


def test_eight_runs_are_the_most(client: TestClient, home: Path) -> None:
    store = Store.open_home(home)
    try:
        for i in range(8):
            store.commit(f"many-{i}", ManifestBody(tensors=[], step=i, metrics={"loss": float(i)}))
    finally:
        store.close()
    names = [f"many-{i}" for i in range(8)]
    doc = page(client, "/compare?" + "&".join(f"run={n}" for n in names))
    assert [g.attrs["class"] for g in doc.one("figure", **{"data-metric": "loss"}).all("g", class_="series")] == [
        f"series s{i}" for i in range(8)
    ]
    assert pages_compare.MAX_RUNS == 8


def test_pages_need_a_token_when_tokens_are_configured(home: Path) -> None:
    store = Store.open_home(home)
    try:
        app = create_app(store, Settings(home=home, tokens=TOKENS, host="127.0.0.1"))
        with TestClient(app, follow_redirects=False, base_url="http://127.0.0.1") as guarded:
            refused = guarded.get("/compare?run=lr-a&run=lr-b")
            assert refused.status_code == 303 and refused.headers["location"].startswith("/login?next=")
            allowed = guarded.get("/compare?run=lr-a&run=lr-b", headers={"Authorization": f"Bearer {READ_TOKEN}"})
            assert allowed.status_code == 200 and READ_TOKEN not in allowed.text
    finally:
        store.close()


def count_statements(store: Store, client: TestClient, url: str) -> tuple[int, Node]:
    """Statements the page at ``url`` runs, and the page."""
    seen: list[str] = []

    def capture(*args: Any) -> None:
        seen.append(args[2])

    event.listen(store.db.engine, "before_cursor_execute", capture)
    try:
        doc = page(client, url)
    finally:
        event.remove(store.db.engine, "before_cursor_execute", capture)
    return len(seen), doc


def test_nothing_the_page_reads_grows_with_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pages_runs, "CHART_POINTS", 10)
    home = tmp_path / "home"
    store = Store.open_home(home)
    tensor = raw(8000, (4,))
    ingest(store, tensor)
    entries = [entry("model/w", tensor, trainable=True)]

    def grow(run: str, first: int, last: int) -> None:
        for step in range(first, last):
            metrics = {"loss": 1 / (1 + step), **({"val_loss": 2.0} if step % 7 == 0 else {})}
            store.commit(run, ManifestBody(tensors=entries, step=step, metrics=metrics))

    try:
        grow("short", 0, 15)
        grow("long", 0, 40)
        app = create_app(store, Settings(home=home, tokens=None, host="127.0.0.1"))
        with TestClient(app, base_url="http://127.0.0.1") as client:
            before, doc = count_statements(store, client, "/compare?run=short&run=long")
            assert len(lines(doc, "loss")["long"]) <= pages_runs.CHART_POINTS + 1
            grow("long", 40, 400)  # ten times the history
            after, doc = count_statements(store, client, "/compare?run=short&run=long")
        drawn = lines(doc, "loss")["long"]
        assert len(drawn) <= pages_runs.CHART_POINTS + 1 and drawn[-1] == 400
        assert after == before  # the same statements, each reading a bounded sample
        assert "draws a sample" in doc.one("p", id="chart-note").text
        assert {row[0]: row[-1] for row in doc.one("table", id="compared-runs").rows()}["long"].endswith("(a sample)")
    finally:
        store.close()
