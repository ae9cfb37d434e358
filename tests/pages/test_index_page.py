"""The runs index: search over run ids and tags, sortable columns, store-wide totals, each run's
main metric, and dedup told as bytes stored by the run against bytes shared."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ckptstore.service.format.manifest import ManifestBody
from ckptstore.service.store import Store
from tests.pages.dom import Node, parse
from tests.pages.kit import ALPHA_V1, LONG, commit, nbytes, page_client, seed
from tests.pages.test_pages import page


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page tests' runs, 'copycat' (alpha's first version again: every byte was stored by
    alpha) reporting val_loss and acc, and 'quiet' with no metrics."""
    folder = tmp_path_factory.mktemp("index") / "home"
    store = Store.open_home(folder)
    try:
        seed(store)
        commit(store, "copycat", ALPHA_V1, tags=["mirror"], metrics={"val_loss": 0.75, "acc": 0.5})
        store.commit("quiet", ManifestBody(tensors=[]))
    finally:
        store.close()
    return folder


@pytest.fixture
def client(home: Path) -> Iterator[TestClient]:
    with page_client(home) as test_client:
        yield test_client


def runs(doc: Node) -> dict[str, list[str]]:
    """Run id -> its row's cells."""
    return {row[0]: row for row in doc.one("table", id="runs").rows()}


def column(doc: Node) -> list[str]:
    """The run ids, top to bottom."""
    return [row[0] for row in doc.one("table", id="runs").rows()]


def test_a_run_whose_bytes_another_run_stored_shows_them_as_shared(client: TestClient) -> None:
    rows = runs(page(client, "/"))
    logical = nbytes(ALPHA_V1)
    assert rows["copycat"][5:8] == [f"{logical} B", "0 B", f"{logical} B (100.0%)"]
    assert rows["alpha"][5:8] == ["875 B", "603 B", "272 B (31.1%)"]
    assert rows["quiet"][5:8] == ["0 B", "0 B", "0 B (—)"]


def test_store_wide_totals_sum_every_run(client: TestClient) -> None:
    doc = page(client, "/?q=alpha")  # the totals stay those of the whole store
    totals = {div.one("dt").text: div.one("dd").text for div in doc.one("dl", id="store-totals").all("div")}
    logical = 875 + 2_027_520 + nbytes(ALPHA_V1)
    stored = 603 + 77_824
    assert totals == {
        "Runs": "4",
        "Versions": "124",
        "Logical": "1.9 MiB",
        "Stored": f"{stored / 1024:.1f} KiB",
        "Saving": f"{(1 - stored / logical) * 100:.1f}%",
    }
    assert doc.one("dl", id="store-totals").one("span", title=f"{logical:,} bytes").text == "1.9 MiB"


def test_the_latest_value_of_each_runs_main_metric(client: TestClient) -> None:
    doc = page(client, "/")
    assert doc.one("table", id="runs").header()[4] == "Latest metric"
    rows = runs(doc)
    assert [rows[r][4] for r in ("alpha", "copycat", "quiet", LONG)] == ["loss 1.50", "val_loss 0.75", "—", "loss 0.00"]
    assert (
        doc.one("span", title="loss = 1.5 at v2").text == "loss 1.50"
    )  # one format per column, the full value on hover
    chosen = page(client, "/?metric=acc")
    assert chosen.one("table", id="runs").header()[4] == "acc"
    assert [runs(chosen)[r][4] for r in ("alpha", "copycat", LONG)] == ["0.5", "0.5", "—"]


def test_search_finds_run_ids_and_tags_ignoring_case(client: TestClient) -> None:
    assert column(page(client, "/?q=ALPHA")) == ["alpha"]
    assert sorted(column(page(client, "/?q=mirr"))) == ["copycat"]  # a tag of copycat
    assert sorted(column(page(client, "/?q=e"))) == ["alpha", "lora-sweep", "quiet"]  # ids; 'best', 'release-1'
    doc = page(client, "/?q=release")
    assert column(doc) == [LONG]
    assert doc.one("p", id="matches").text == "1 run of 4 with “release” in the run id or a tag."
    assert doc.one("input", name="q").attrs["value"] == "release"
    none = page(client, "/?q=zzz")
    assert none.all("table", id="runs") == [] and "No run id or tag holds “zzz”" in none.one("p", class_="empty").text


@pytest.mark.parametrize(
    ("query", "order"),
    [
        ("sort=run&order=asc", ["alpha", "copycat", "lora-sweep", "quiet"]),
        ("sort=run&order=desc", ["quiet", "lora-sweep", "copycat", "alpha"]),
        ("sort=versions", [LONG, "alpha", "copycat", "quiet"]),
        ("sort=logical&order=asc", ["quiet", "copycat", "alpha", LONG]),
        ("sort=stored", [LONG, "alpha", "copycat", "quiet"]),
        ("sort=shared", [LONG, "copycat", "alpha", "quiet"]),
        ("sort=metric&order=asc", [LONG, "copycat", "alpha", "quiet"]),  # without a value: last
        ("sort=metric", ["alpha", "copycat", LONG, "quiet"]),
        ("sort=saved", ["quiet", "copycat", LONG, "alpha"]),
    ],
)
def test_every_column_sorts(client: TestClient, query: str, order: list[str]) -> None:
    assert column(page(client, f"/?{query}")) == order


def test_sort_links_toggle_and_keep_the_search(client: TestClient) -> None:
    doc = page(client, "/?q=a&sort=stored")
    links = dict((text, href) for href, text in doc.one("table", id="runs").one("thead").links())
    assert links["Stored by this run"] == "/?q=a&sort=stored&order=asc"
    assert links["Run"] == "/?q=a&sort=run&order=asc"
    assert links["Logical size"] == "/?q=a&sort=logical"
    assert doc.one("a", class_="active").text == "Stored by this run"


@pytest.mark.parametrize(
    ("query", "status", "says"),
    [
        ("sort=<b>", 400, "cannot sort runs by '<b>': use one of run, versions"),
        ("order=up", 422, "order"),
        ("q=" + "x" * 101, 422, "q: String should have at most 100 characters"),
        ("metric=<script>", 400, "metric '<script>' cannot name a metric"),
        ("metric=" + "m" * 129, 422, "metric"),
    ],
)
def test_hostile_index_parameters_are_4xx_pages(client: TestClient, query: str, status: int, says: str) -> None:
    response = client.get(f"/?{query}")
    assert response.status_code == status
    assert "<b>" not in response.text and "<script>" not in response.text.split("<body>")[1]
    assert says in parse(response.text).one("p", class_="message").text


def test_a_search_for_markup_is_shown_as_text(client: TestClient) -> None:
    response = client.get("/?q=%3Cscript%3Ealert(1)%3C/script%3E")
    assert response.status_code == 200
    assert "<script>alert(1)" not in response.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in response.text
