"""The run page's charts (inline SVG, a point per version, downsampled past the cap) and its
filters (tag glob, metric range), through the real app; hostile query values get 4xx pages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ckptstore.service.api import create_app
from ckptstore.service.api.pages import runs as pages_runs
from ckptstore.service.format.manifest import ManifestBody
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.pages.dom import Node, parse
from tests.pages.kit import LONG, LONG_VERSIONS, entry, ingest, long_loss, page_client, raw
from tests.pages.test_pages import page, version_column


def chart(doc: Node, metric: str) -> Node:
    """The figure charting ``metric``."""
    return doc.one("figure", **{"data-metric": metric})


def points(figure: Node) -> list[int]:
    """The versions of a line chart's points, left to right."""
    return [int(c.attrs["data-version"]) for c in figure.all("circle", class_="pt")]


def bars(doc: Node) -> list[int]:
    """The versions of the storage chart's bars."""
    return [int(g.attrs["data-version"]) for g in doc.one("figure", id="storage-chart").all("g", class_="bar")]


def hover(figure: Node, version: int) -> str:
    """The hover text of the point of ``version``."""
    circle = figure.one("circle", **{"data-version": str(version)})
    return circle.one("title").text


def test_every_version_has_its_point_in_each_metric_chart(client: TestClient) -> None:
    doc = page(client, f"/runs/{LONG}")
    figures = doc.one("section", id="charts").all("figure", class_="metric-chart")
    assert [f.attrs["data-metric"] for f in figures] == ["loss", "val_loss"]
    loss = chart(doc, "loss")
    assert sorted(points(loss)) == list(range(1, LONG_VERSIONS + 1))
    assert points(chart(doc, "val_loss")) == list(range(10, LONG_VERSIONS + 1, 10))  # ordered by step
    assert hover(loss, 7) == f"v7 · step 700 · loss {long_loss(7):g}"
    assert "120 points" in loss.one("figcaption").text and "over step" in loss.one("figcaption").text
    svg = loss.one("svg")
    assert svg.attrs["viewbox"] == "0 0 480 210" and svg.attrs["role"] == "img"
    assert len(svg.one("polyline").attrs["points"].split()) == LONG_VERSIONS
    assert bars(doc) == list(range(1, LONG_VERSIONS + 1))
    assert "Every version has its point (120 versions)" in doc.one("p", id="chart-note").text


def test_the_storage_chart_splits_each_version_into_new_and_shared_bytes(client: TestClient) -> None:
    doc = page(client, f"/runs/{LONG}")
    storage = doc.one("figure", id="storage-chart")
    first, second = storage.all("g", class_="bar")[:2]
    assert first.one("title").text == "v1 · 16.5 KiB in all: 16.5 KiB new, 0 B shared"
    assert second.one("title").text == "v2 · 16.5 KiB in all: 512 B new, 16.0 KiB shared"
    assert float(second.one("rect", class_="shared").attrs["height"]) > 10 * float(
        second.one("rect", class_="new").attrs["height"]
    )
    assert [t.text for t in storage.all("text", class_="y")] == ["0 B", "5.0 KiB", "10.0 KiB", "15.0 KiB", "20.0 KiB"]


def test_charts_are_drawn_by_the_server_without_script_or_inline_style(client: TestClient) -> None:
    response = client.get(f"/runs/{LONG}")
    assert "style=" not in response.text and "<script>" not in response.text
    doc = parse(response.text)
    assert [s.attrs.get("src") for s in doc.all("script")] == ["/static/pages.js"]


def test_past_the_cap_charts_are_downsampled_and_say_so(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pages_runs, "CHART_POINTS", 25)  # 120 versions: one point per 5 version numbers
    doc = page(client, f"/runs/{LONG}")
    assert points(chart(doc, "loss")) == [*range(1, 120, 5), 120]
    # val_loss is on every tenth version only: its chart samples the versions that report it.
    assert points(chart(doc, "val_loss")) == list(range(10, 121, 10))
    assert bars(doc) == [*range(1, 120, 5), 120]
    note = doc.one("p", id="chart-note").text
    assert note.startswith("Downsampled: the charts draw 25 versions of 120 — the first in each run of 5 version")
    assert "The table lists every version" in note
    assert version_column(doc) == list(range(120, 70, -1))  # the table is not sampled


@pytest.fixture(scope="module")
def long_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with run 'long': 700 versions, loss 1/v at step 10·v, 'keep' tags on every 100th."""
    home = tmp_path_factory.mktemp("long") / "home"
    store = Store.open_home(home)
    try:
        tensor = raw(5000, (4,))
        ingest(store, tensor)
        entries = [entry("model/w", tensor, trainable=True)]
        for version in range(1, 701):
            tags = [f"keep-{version}"] if version % 100 == 0 else []
            store.commit(
                "long", ManifestBody(tensors=entries, step=10 * version, metrics={"loss": 1 / version}), tags=tags
            )
    finally:
        store.close()
    return home


@pytest.fixture
def long_client(long_home: Path) -> Iterator[TestClient]:
    with page_client(long_home) as test_client:
        yield test_client


def test_a_run_longer_than_the_cap_draws_at_most_the_cap(long_client: TestClient) -> None:
    doc = page(long_client, "/runs/long")
    drawn = points(chart(doc, "loss"))  # 700 versions over 300 points: one per 3 version numbers
    assert drawn == list(range(1, 701, 3)) and len(drawn) == 234 <= pages_runs.CHART_POINTS
    assert bars(doc) == drawn
    assert "draw 234 versions of 700 — the first in each run of 3 version numbers" in doc.one("p", id="chart-note").text
    assert doc.one("p", id="run-summary").text.startswith("700 versions")
    filtered = page(long_client, "/runs/long?tag=keep-*")
    assert points(chart(filtered, "loss")) == list(range(100, 701, 100))
    assert version_column(filtered) == list(range(700, 0, -100))


def test_filter_by_tag_glob(client: TestClient) -> None:
    doc = page(client, f"/runs/{LONG}?tag=release-*")
    assert version_column(doc) == [100]
    assert points(chart(doc, "loss")) == [100] and bars(doc) == [100]
    assert doc.one("p", id="run-summary").text.startswith("1 version matches the filter (tagged 'release-*')")
    assert version_column(page(client, f"/runs/{LONG}?tag=*")) == [120, 100]
    assert doc.one("input", name="tag").attrs["value"] == "release-*"
    assert ("/runs/lora-sweep", "Show every version") in doc.links()


def test_filter_by_metric_range_keeps_charts_table_and_links_in_step(client: TestClient) -> None:
    url = f"/runs/{LONG}?metric=loss&min=1&max=2&per_page=5"
    doc = page(client, url)
    wanted = [v for v in range(LONG_VERSIONS, 0, -1) if 1 <= long_loss(v) <= 2]
    assert len(wanted) == 11
    assert version_column(doc) == wanted[:5]
    assert sorted(points(chart(doc, "loss"))) == sorted(wanted)
    assert "11 versions match the filter (loss from 1 to 2)" in doc.one("p", id="run-summary").text
    pager = doc.all("nav", class_="pager")[0]
    assert ("/runs/lora-sweep?metric=loss&min=1&max=2&page=2&per_page=5", "2") in pager.links()
    sort_link = dict((text, href) for href, text in doc.one("table", id="versions").links())["Step"]
    assert sort_link == "/runs/lora-sweep?metric=loss&min=1&max=2&per_page=5&sort=step&order=asc"
    only_val = page(client, f"/runs/{LONG}?metric=val_loss&max=3")
    assert version_column(only_val) == [120, 110, 100]
    at_least = page(client, f"/runs/{LONG}?metric=val_loss&min=11.5")
    assert version_column(at_least) == [10] and "val_loss at least 11.5" in at_least.one("p", id="run-summary").text


def test_an_empty_form_is_no_filter_and_a_filter_keeping_nothing_says_so(client: TestClient) -> None:
    assert version_column(page(client, f"/runs/{LONG}?tag=&metric=&min=&max=")) == list(range(120, 70, -1))
    doc = page(client, f"/runs/{LONG}?metric=loss&min=50")
    assert doc.all("table", id="versions") == [] and doc.all("section", id="charts") == []
    assert "No version matches the filter (loss at least 50)" in doc.one("p", class_="empty").text


@pytest.mark.parametrize(
    ("query", "status", "says"),
    [
        ("tag=<script>", 400, "tag filter '<script>' may hold letters, digits"),
        ("tag=" + "a" * 65, 422, "tag"),
        ("metric=<b>", 400, "metric '<b>' cannot name a metric"),
        ("metric=loss&min=nan", 400, "min must be a finite number such as 0.5, not 'nan'"),
        ("metric=loss&max=inf", 400, "max must be a finite number"),
        ("metric=loss&min=abc", 400, "min must be a finite number"),
        ("metric=loss&min=" + "1" * 41, 422, "min"),
        ("min=1", 400, "min and max need a metric"),
        ("metric=loss&min=2&max=1", 400, "min (2) is above max (1)"),
        ("page=9", 404, "run 'lora-sweep' has 120 versions, 3 pages of 50; there is no page 9"),
        ("tag=release-1&page=2", 404, "has 1 version matching the filter, 1 page of 50; there is no page 2"),
    ],
)
def test_hostile_or_wrong_filter_values_are_4xx_pages_naming_the_problem(
    client: TestClient, query: str, status: int, says: str
) -> None:
    response = client.get(f"/runs/{LONG}?{query}")
    assert response.status_code == status
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert "<script>" not in response.text.split("<body>")[1] and "<b>" not in response.text
    assert says in parse(response.text).one("p", class_="message").text


def test_more_metrics_than_charts_are_named(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pages_runs, "MAX_CHARTS", 1)
    doc = page(client, f"/runs/{LONG}")
    assert [f.attrs["data-metric"] for f in doc.all("figure", class_="metric-chart")] == ["loss"]
    assert "Not charted (1 more metrics): val_loss." in doc.one("section", id="charts").text


def test_a_run_without_steps_is_charted_over_version_numbers(tmp_path: Path) -> None:
    store = Store.open_home(tmp_path / "home")
    try:
        tensor = raw(31, (2,))
        ingest(store, tensor)
        for step in (10, None, 30):
            body = ManifestBody(tensors=[entry("model/w", tensor, trainable=True)], step=step, metrics={"loss": 1.0})
            store.commit("stepless", body)
        with TestClient(
            create_app(store, Settings(home=tmp_path / "home", tokens=None, host="127.0.0.1")),
            base_url="http://127.0.0.1",
        ) as client:
            doc = page(client, "/runs/stepless")
    finally:
        store.close()
    loss = chart(doc, "loss")
    assert "over version" in loss.one("figcaption").text  # one version has no step
    assert points(loss) == [1, 2, 3]
    assert hover(loss, 2) == "v2 · loss 1"
    assert [t.text for t in loss.all("text", class_="y")] == ["0.90", "0.95", "1.00", "1.05", "1.10"]
