"""The run page shows the run's retention policy and marks the versions the next commit removes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ckptstore.service.api import create_app
from ckptstore.service.api.pages.data import RetentionView
from ckptstore.service.catalog.retention_rules import Policy
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.pages.dom import Node, parse
from tests.pages.kit import commit, long_version

RUN = "sweep"
LOSSES = [5.0, 1.0, 4.0, 3.0, 6.0, 2.0, 7.0]  # versions 1..7


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """Run ``sweep`` with seven versions (version 3 tagged), and run ``plain`` with no policy."""
    opened = Store.open_home(tmp_path / "home")
    try:
        for version, loss in enumerate(LOSSES, start=1):
            tags = ["keep-me"] if version == 3 else []
            commit(opened, RUN, long_version(version), tags=tags, step=version, metrics={"loss": loss})
        commit(opened, "plain", long_version(1), metrics={"loss": 1.0})
        yield opened
    finally:
        opened.close()


@pytest.fixture
def client(store: Store, tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(store, Settings(home=tmp_path / "home", tokens=None, host="127.0.0.1"))
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as test_client:
        yield test_client


def page(client: TestClient, url: str) -> Node:
    response = client.get(url)
    assert response.status_code == 200, response.text[:2000]
    return parse(response.text)


def marked(doc: Node) -> list[int]:
    """The versions whose rows are marked as removed at the next commit."""
    return sorted(int(row.attrs["data-version"]) for row in doc.all("tr", class_="retention-removes"))


def column(doc: Node) -> dict[int, str]:
    """Version -> the text of its Retention cell."""
    table = doc.one("table", id="versions")
    assert table.header()[-1] == "Retention"
    return {int(row[1].removeprefix("v")): row[-1] for row in table.rows()}


def test_a_run_without_a_policy_says_so_and_marks_nothing(client: TestClient) -> None:
    doc = page(client, f"/runs/{RUN}")
    assert doc.one("p", id="retention").text == "Retention policy: none (every version is kept)"
    assert "Retention" not in doc.one("table", id="versions").header()
    assert marked(doc) == []


def test_the_page_marks_what_the_policy_removes_and_why_the_rest_stays(client: TestClient, store: Store) -> None:
    store.set_retention(RUN, keep_last=2, keep_best=1, metric="loss")
    doc = page(client, f"/runs/{RUN}")
    summary = doc.one("p", id="retention").text
    assert summary == (
        "Retention policy: keep the last 2 versions and the best 1 by loss (lowest), plus every tagged version "
        "and the newest · 3 versions not kept: the next commit removes them (marked below)"
    )
    assert marked(doc) == [1, 4, 5] == store.get_retention(RUN).would_remove
    assert column(doc) == {
        7: "kept: last 2, newest",
        6: "kept: last 2",
        5: "removed at the next commit",
        4: "removed at the next commit",
        3: "kept: tagged",
        2: "kept: best 1 by loss",
        1: "removed at the next commit",
    }
    # Sorted and paginated, the marks follow the versions.
    sorted_doc = page(client, f"/runs/{RUN}?sort=metric:loss&order=asc&per_page=3")
    assert [int(r.attrs["data-version"]) for r in sorted_doc.one("table", id="versions").all("tr")[1:]] == [2, 6, 4]
    assert marked(sorted_doc) == [4]

    # The next commit removes what was marked, and version 6, which it pushes out of the last 2.
    commit(store, RUN, long_version(8), step=8, metrics={"loss": 1.5})
    assert [v.version for v in store.versions(RUN)] == [2, 3, 7, 8]
    after = page(client, f"/runs/{RUN}")
    assert marked(after) == [] and after.one("p", id="retention").text.startswith("Retention policy: keep the last 2")
    store.untag(RUN, "keep-me")
    untagged = page(client, f"/runs/{RUN}")
    assert marked(untagged) == [3]
    assert "· 1 version not kept: the next commit removes it" in untagged.one("p", id="retention").text


def test_a_policy_keeping_everything_says_so(client: TestClient, store: Store) -> None:
    store.set_retention(RUN, keep_last=50)
    doc = page(client, f"/runs/{RUN}")
    assert doc.one("p", id="retention").text.endswith("· every version is kept as the run stands")
    assert marked(doc) == []
    assert set(column(doc).values()) == {"kept: last 50", "kept: last 50, tagged", "kept: last 50, newest"}
    assert page(client, "/runs/plain").one("p", id="retention").text == "Retention policy: none (every version is kept)"


def test_labels_without_a_policy_remove_nothing() -> None:
    view = RetentionView(Policy(), {1: [], 2: []})
    assert view.would_remove == []
    active = RetentionView(Policy(keep_last=1), {1: [], 2: ["last", "newest"]})
    assert active.would_remove == [1]
    assert (active.label(1), active.label(2)) == ("removed at the next commit", "kept: last 1, newest")
