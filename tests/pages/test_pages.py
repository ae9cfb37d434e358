"""The HTML pages through the real app in-process: what each page shows, pagination and
sorting over a run of 120 versions, escaping of hostile tensor keys, HTML error pages, login."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path
from urllib.parse import urlencode

import pytest
from fastapi.testclient import TestClient

from ckptstore.service.errors import InvalidManifestError, InvalidNameError
from ckptstore.service.format.manifest import manifest_from_json, validate_body
from ckptstore.service.store import Store
from tests.pages.dom import Node, parse
from tests.pages.kit import (
    ALPHA_V1,
    ALPHA_V2,
    ATTRIBUTE_KEY,
    FC_W2,
    HOSTILE1,
    LONG_VERSIONS,
    READ_TOKEN,
    SCRIPT_KEY,
    WRITE_TOKEN,
    long_loss,
    nbytes,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pytest brings tomli on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def page(client: TestClient, url: str, status: int = 200) -> Node:
    """GET ``url``, check it is an HTML page with ``status``, and parse it."""
    response = client.get(url)
    assert response.status_code == status, response.text[:2000]
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in response.headers["content-security-policy"]
    return parse(response.text)


def version_column(doc: Node) -> list[int]:
    """The version numbers of the run page's rows, top to bottom."""
    return [int(row[1].removeprefix("v")) for row in doc.one("table", id="versions").rows()]


# -- the runs index -------------------------------------------------------------------------------


def test_runs_index_lists_each_run_with_versions_sizes_and_tags(client: TestClient) -> None:
    doc = page(client, "/")
    table = doc.one("table", id="runs")
    assert table.header()[:3] == ["Run", "Versions", "Latest"]
    rows = {row[0]: row for row in table.rows()}
    assert set(rows) == {"alpha", "lora-sweep"}
    alpha_logical = nbytes(ALPHA_V1) + nbytes(ALPHA_V2)
    alpha_stored = nbytes(ALPHA_V1) + 64 + 32 + 64 + 4 + 16 + 3  # v2 adds fc.weight, head, exp_avg, step, hostiles
    assert (alpha_logical, alpha_stored) == (875, 603)
    assert rows["alpha"][1:3] == ["2", "v2"]
    assert rows["alpha"][3].endswith(" UTC")
    assert table.header()[3:] == [
        "Latest saved",
        "Latest metric",
        "Logical size",
        "Stored by this run",
        "Shared",
        "Tags",
    ]
    assert rows["alpha"][4:8] == ["loss 1.5", "875 B", "603 B", "272 B (31.1%)"]
    assert rows["alpha"][8] == "best v2 first v1"
    assert rows["lora-sweep"][1:3] == [str(LONG_VERSIONS), f"v{LONG_VERSIONS}"]
    # 120 versions of a 16 KiB frozen base stored once, plus 512 new bytes (adapter, exp_avg) each.
    assert (120 * (16384 + 512), 16384 + 120 * 512) == (2_027_520, 77_824)
    assert rows["lora-sweep"][4:8] == [f"loss {long_loss(LONG_VERSIONS):.1f}", "1.9 MiB", "76.0 KiB", "1.9 MiB (96.2%)"]
    assert rows["lora-sweep"][8] == "lowest-loss v120 release-1 v100"
    links = dict(table.links())
    assert links["/runs/alpha"] == "alpha"
    assert links["/runs/alpha/versions/best"] == "best v2"
    assert links[f"/runs/lora-sweep/versions/{LONG_VERSIONS}"] == f"v{LONG_VERSIONS}"
    # Exact byte counts sit in the title for a reader who hovers.
    assert table.one("span", title="875 bytes").text == "875 B"


def test_runs_index_of_an_empty_store_says_so(tmp_path: Path) -> None:
    from ckptstore.service.api import create_app
    from ckptstore.service.settings import Settings

    store = Store.open_home(tmp_path / "home")
    try:
        with TestClient(
            create_app(store, Settings(home=tmp_path / "home", tokens=None)), base_url="http://127.0.0.1"
        ) as client:
            doc = page(client, "/")
    finally:
        store.close()
    assert doc.all("table") == []
    assert "No runs yet" in doc.one("p", class_="empty").text


# -- a run's versions --------------------------------------------------------------------------------


def test_run_page_lists_versions_newest_first_with_their_figures(client: TestClient) -> None:
    doc = page(client, "/runs/alpha")
    table = doc.one("table", id="versions")
    header = table.header()
    assert header[1:5] == ["Version", "Created", "Tags", "Step"]
    assert header[5:7] == ["acc", "loss"]  # every metric in its own column
    assert header[7:] == ["Logical size", "New bytes stored", "Dedup saving", "Trainable", "Parent"]
    v2, v1 = table.rows()
    # One format per metric column: acc 0.125 and 0.5 both with three decimals.
    assert v2[1:2] + v2[3:] == ["v2", "best", "20", "0.500", "1.5", "455 B", "183 B", "59.8%", "30.4%", "v1"]
    assert v1[1:2] + v1[3:] == ["v1", "first", "10", "0.125", "2.5", "420 B", "420 B", "0.0%", "23.8%", "—"]
    links = table.links()
    assert ("/runs/alpha/versions/2", "v2") in links and ("/runs/alpha/versions/1", "v1") in links
    boxes = doc.one("form", id="compare").all("input", type="checkbox")
    assert [(b.attrs["name"], b.attrs["value"]) for b in boxes] == [("v", "2"), ("v", "1")]
    assert doc.one("form", id="compare").attrs["action"] == "/runs/alpha/diff"
    assert doc.all("nav", class_="pager") == []  # one page: no page links


def test_run_page_paginates_fifty_versions_a_page(client: TestClient) -> None:
    first = page(client, "/runs/lora-sweep")
    assert version_column(first) == list(range(120, 70, -1))
    third = page(client, "/runs/lora-sweep?page=3&per_page=50")
    assert version_column(third) == list(range(20, 0, -1))
    pager = first.all("nav", class_="pager")[0]
    assert [text for _, text in pager.links()] == ["2", "3", "Older ›"]
    assert pager.one("span", class_="current").text == "1"
    second_links = page(client, "/runs/lora-sweep?page=2").all("nav", class_="pager")[0].links()
    assert second_links == [  # page 1 is the plain URL
        ("/runs/lora-sweep", "‹ Newer"),
        ("/runs/lora-sweep", "1"),
        ("/runs/lora-sweep?page=3", "3"),
        ("/runs/lora-sweep?page=3", "Older ›"),
    ]


def test_page_links_skip_far_pages_and_keep_the_page_size(client: TestClient) -> None:
    doc = page(client, "/runs/lora-sweep?page=9&per_page=7")
    pager = doc.all("nav", class_="pager")[0]
    assert pager.text == "‹ Newer 1 … 7 8 9 10 11 … 18 Older ›"
    assert ("/runs/lora-sweep?page=18&per_page=7", "18") in pager.links()
    assert version_column(doc) == list(range(120 - 8 * 7, 120 - 9 * 7, -1))


def test_a_page_past_the_last_is_a_404_page(client: TestClient) -> None:
    doc = page(client, "/runs/lora-sweep?page=4", status=404)
    assert "there is no page 4" in doc.one("p", class_="message").text


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_run_page_sorts_all_versions_by_a_metric_before_paginating(client: TestClient, order: str) -> None:
    by_loss = sorted(range(1, LONG_VERSIONS + 1), key=long_loss, reverse=order == "desc")
    first = page(client, f"/runs/lora-sweep?sort=metric:loss&order={order}")
    second = page(client, f"/runs/lora-sweep?sort=metric:loss&order={order}&page=2")
    assert version_column(first) + version_column(second) == by_loss[:100]
    losses = [float(row[5]) for row in first.one("table", id="versions").rows()]
    assert losses == sorted(losses, reverse=order == "desc") and len(set(losses)) == 50
    # The column header sorts by its metric and toggles the order when already sorted by it.
    header_link = first.one("a", class_="active").attrs["href"]
    flipped = "desc" if order == "asc" else "asc"
    assert header_link == "/runs/lora-sweep?sort=metric%3Aloss" + (f"&order={flipped}" if flipped == "asc" else "")


def test_versions_without_the_sorted_metric_come_last(client: TestClient) -> None:
    doc = page(client, "/runs/lora-sweep?sort=metric:val_loss&order=asc&per_page=20")
    with_metric = list(range(120, 0, -10))  # val_loss = 100 - version, ascending
    without = [v for v in range(120, 0, -1) if v % 10]
    assert version_column(doc) == with_metric + without[:8]
    assert doc.one("table", id="versions").header()[5:7] == ["loss", "val_loss"]


@pytest.mark.parametrize(
    ("query", "status", "says"),
    [
        ("sort=metric:<b>", 400, "cannot sort by 'metric:<b>'"),
        ("sort=colour", 400, "use one of version, step, logical, stored or metric:<name>"),
        ("order=sideways", 422, "order"),
        ("per_page=0", 422, "per_page"),
        ("per_page=501", 422, "per_page"),
        ("page=x", 422, "page"),
    ],
)
def test_bad_run_page_parameters_give_html_errors(client: TestClient, query: str, status: int, says: str) -> None:
    response = client.get(f"/runs/lora-sweep?{query}")
    assert response.status_code == status
    assert "<b>" not in response.text
    assert says in parse(response.text).one("p", class_="message").text


# -- one version -----------------------------------------------------------------------------------


def sections(doc: Node) -> dict[str, dict[str, dict[str, str]]]:
    """Section title -> key shown -> column header -> cell text."""
    found = {}
    for section in doc.all("section", class_="tensors"):
        title = section.one("h2").children[0]
        assert isinstance(title, str)
        table = section.one("table")
        header = table.header()
        found[title.strip()] = {row[0]: dict(zip(header, row, strict=True)) for row in table.rows()}
    return found


def test_version_page_groups_tensors_and_marks_what_the_parent_shares(client: TestClient) -> None:
    doc = page(client, "/runs/alpha/versions/2")
    found = sections(doc)
    assert list(found) == ["Model", "Optimizer state", "Extra"]
    model = found["Model"]
    assert list(model) == ["emb.weight", "fc.weight", "fc.bias", "head.weight"]
    assert list(model["emb.weight"].values())[1:] == [
        "F32",
        "8 × 8",
        "floating",
        "target",
        "cpu",
        "frozen",
        "256 B",
        "shared",
        "bytes",
    ]
    assert [model["fc.weight"][c] for c in ("Trainable", "Size", "vs parent")] == ["trainable", "64 B", "new"]
    assert model["fc.bias"]["vs parent"] == "shared"
    assert model["head.weight"]["vs parent"] == "new"
    optim = found["Optimizer state"]
    assert "Trainable" not in optim["fc.weight/exp_avg"]
    assert optim["fc.weight/exp_avg"]["Placement"] == "param fc.weight"
    step = optim["fc.weight/step"]
    assert [step[c] for c in ("Shape", "Class", "Placement", "Size")] == ["scalar", "floating", "host", "4 B"]
    assert [row["vs parent"] for row in optim.values()] == ["new", "new"]
    assert set(found["Extra"]) == {SCRIPT_KEY.removeprefix("extra/"), ATTRIBUTE_KEY.removeprefix("extra/")}
    facts = doc.one("div", class_="facts").text
    for fact in ("Step 20", "Logical size 455 B", "New bytes stored 183 B", "Shared with parent 272 B"):
        assert fact in facts
    # One denominator on every page: the model's bytes (368 B), as the run page's Trainable column.
    assert "Model 368 B Trainable 112 B (30.4% of the model) Frozen 256 B" in facts
    assert [dt.text for dt in doc.one("dl", id="metrics").all("dt")] == ["acc", "loss"]
    assert ("/runs/alpha/versions/1", "v1") in doc.one("dd", id="parent").links()
    assert ("/runs/alpha/versions/best", "best") in doc.one("h1").links()


def test_first_version_has_no_parent_to_share_with(client: TestClient) -> None:
    doc = page(client, "/runs/alpha/versions/first")
    assert doc.one("dd", id="parent").text == "— (first version)"
    found = sections(doc)
    assert {row["vs parent"] for rows in found.values() for row in rows.values()} == {"—"}
    assert list(found) == ["Model", "Optimizer state", "Extra"]


def test_version_page_links_the_manifest_json_and_each_tensors_bytes(client: TestClient) -> None:
    doc = page(client, "/runs/alpha/versions/latest")
    manifest_link = dict((text, href) for href, text in doc.one("p", class_="downloads").links())["manifest JSON"]
    assert manifest_link == "/runs/alpha/versions/2/manifest.json"
    downloaded = client.get(manifest_link)
    assert downloaded.status_code == 200 and downloaded.headers["content-type"] == "application/json"
    assert downloaded.content == client.get("/v1/runs/alpha/versions/2").content
    assert manifest_from_json(downloaded.content).version == 2
    hrefs = {a.attrs["title"].split()[-1]: a.attrs["href"] for a in doc.all("a", class_="dl")}
    assert client.get(hrefs[FC_W2.digest]).content == FC_W2.data
    hostile = client.get(hrefs[HOSTILE1.digest])  # the key is '<script>…' and goes through the query string
    assert hostile.status_code == 200 and hostile.content == HOSTILE1.data
    # Named by the key, with only letters, digits, '.', '_' and '-' left of it.
    assert hostile.headers["content-disposition"] == 'attachment; filename="extra._script_alert_1_.script.i64.bin"'
    plain = client.get(hrefs[FC_W2.digest])
    assert plain.headers["content-disposition"] == 'attachment; filename="model.fc.weight.f32.bin"'


def test_tensor_download_of_an_unknown_key_is_a_404_page(client: TestClient) -> None:
    doc = page(client, "/runs/alpha/versions/2/tensor?name=model/nope", status=404)
    assert "has no tensor 'model/nope'" in doc.one("p", class_="message").text


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("/runs/alpha/versions/2", {SCRIPT_KEY.removeprefix("extra/"), ATTRIBUTE_KEY.removeprefix("extra/")}),
        ("/runs/alpha/diff?a=1&b=2", {SCRIPT_KEY, ATTRIBUTE_KEY}),
    ],
)
def test_hostile_tensor_keys_are_escaped(client: TestClient, url: str, shown: set[str]) -> None:
    response = client.get(url)
    assert response.status_code == 200
    raw = response.text
    assert "<script>alert(1)</script>" not in raw
    assert "<img" not in raw and ATTRIBUTE_KEY.removeprefix("extra/") not in raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in raw
    assert "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in raw
    doc = parse(raw)
    assert [s.attrs.get("src") for s in doc.all("script")] == ["/static/pages.js"]
    assert doc.all("img") == []
    assert shown <= {cell.text for cell in doc.all("td", class_="key")}  # shown as text, exactly


def test_names_shown_in_pages_cannot_carry_markup(store: Store) -> None:
    # Run ids, tags and metric names are strict patterns, so only tensor keys need the escaping test.
    body = validate_body({"tensors": []})
    with pytest.raises(InvalidNameError):
        store.commit("<b>", body)
    with pytest.raises(InvalidNameError):
        store.commit("alpha", body, tags=["<b>"])
    with pytest.raises(InvalidManifestError):
        validate_body({"tensors": [], "metrics": {"<b>": 1.0}})


# -- diff ----------------------------------------------------------------------------------------


def test_diff_page_counts_each_status_and_lists_what_differs(client: TestClient) -> None:
    doc = page(client, "/runs/alpha/diff?a=1&b=2")
    assert doc.one("h1").text == "alpha · v1 → v2"
    totals = {row[0]: row[1:] for row in doc.one("table", id="totals").rows()}
    assert totals == {
        "added": ["3", "51 B"],
        "removed": ["1", "16 B"],
        "changed": ["3", "132 B"],
        "unchanged": ["2", "272 B"],
    }
    tensors = {row[1]: row for row in doc.one("table", id="tensors").rows()}
    assert set(tensors) == {
        "model/head.weight",
        SCRIPT_KEY,
        ATTRIBUTE_KEY,
        "extra/rng",
        "model/fc.weight",
        "optim/state/fc.weight/exp_avg",
        "optim/state/fc.weight/step",
    }
    assert tensors["extra/rng"] == ["removed", "extra/rng", "U8[16]", "—", "16 B", "—"]
    assert tensors["model/head.weight"] == ["added", "model/head.weight", "—", "F32[2,4]", "32 B", "—"]
    assert tensors["model/fc.weight"][4:] == ["64 B", "64 B"]  # stored whole: every byte is in the new piece
    assert tensors["model/fc.weight"][0] == "changed"
    values = {row[0]: row[1:] for row in doc.one("table", id="values").rows()}
    assert values == {
        "metrics/acc": ["0.125", "0.500", "+0.375", "+300.0%"],
        "metrics/loss": ["2.5", "1.5", "−1.0", "−40.0%"],
        "optim/param_groups/0/lr": ["0.10", "0.05", "−0.05", "−50.0%"],
        "step": ["10", "20", "+10", "—"],  # a counter: its change, no percentage
    }
    assert ("/runs/alpha/diff?a=1&b=2&all=1", "show all 9") in doc.links()


def test_diff_page_shows_unchanged_tensors_on_request(client: TestClient) -> None:
    doc = page(client, "/runs/alpha/diff?a=1&b=2&all=1")
    statuses = [row[0] for row in doc.one("table", id="tensors").rows()]
    assert len(statuses) == 9 and statuses.count("unchanged") == 2
    assert ("/runs/alpha/diff?a=1&b=2", "hide unchanged") in doc.links()


def test_diff_from_the_plain_form_orders_the_ticked_versions(client: TestClient) -> None:
    doc = page(client, "/runs/alpha/diff?v=2&v=1")
    assert doc.one("h1").text == "alpha · v1 → v2"
    by_tag = page(client, "/runs/alpha/diff?a=best&b=first")  # a and b are taken as given
    assert by_tag.one("h1").text == "alpha · v2 → v1"
    assert {row[0]: row[1] for row in by_tag.one("table", id="totals").rows()}["added"] == "1"


@pytest.mark.parametrize(
    ("query", "status"),
    [("", 400), ("v=1", 400), ("v=1&v=2&v=3", 400), ("a=1", 400), ("a=1&b=99", 404), ("a=1&b=<i>", 400)],
)
def test_diff_needs_two_existing_versions(client: TestClient, query: str, status: int) -> None:
    response = client.get(f"/runs/alpha/diff?{query}")
    assert response.status_code == status
    assert response.headers["content-type"].startswith("text/html")
    assert "<i>" not in response.text


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "status", "code", "says"),
    [
        ("/runs/nope", 404, "not_found", "run 'nope' does not exist"),
        ("/runs/alpha/versions/9", 404, "not_found", "run 'alpha' has no version 9"),
        ("/runs/alpha/versions/nightly", 404, "not_found", "run 'alpha' has no tag 'nightly'"),
        ("/runs/alpha/versions/%3Cb%3E", 400, "invalid_name", "invalid version reference '<b>'"),
        ("/runs/bad..run", 400, "invalid_name", "invalid run id 'bad..run'"),
        ("/runs/%3Cscript%3E/versions/1", 400, "invalid_name", "invalid run id '<script>'"),
        ("/runs/alpha/versions/" + "9" * 65, 422, "invalid_input", "ref"),
        ("/runs/nope/diff?a=1&b=2", 404, "not_found", "run 'nope' does not exist"),
    ],
)
def test_errors_on_pages_are_html_pages(client: TestClient, url: str, status: int, code: str, says: str) -> None:
    response = client.get(url)
    assert response.status_code == status
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert response.headers["x-error-code"] == code
    assert "<script>" not in response.text and "<b>" not in response.text
    doc = parse(response.text)
    assert doc.one("h1").text.startswith(str(status))
    assert says in doc.one("p", class_="message").text


def test_the_json_api_keeps_its_json_errors(client: TestClient) -> None:
    response = client.get("/v1/runs/nope/versions")
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"code": "not_found", "message": "run 'nope' does not exist"}
    assert client.get("/v1/runs/bad..run/versions").json()["code"] == "invalid_name"


def test_static_files_are_served(client: TestClient) -> None:
    css = client.get("/static/style.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert ".num" in css.text
    script = client.get("/static/pages.js")
    assert script.status_code == 200 and "compare" in script.text


def test_templates_and_static_files_ship_as_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = config["package-data"]["ckptstore.service.api.pages"]
    folder = ROOT / "service" / "api" / "pages"
    shipped = [p.relative_to(folder).as_posix() for p in folder.glob("*/*") if p.parent.name in {"templates", "static"}]
    assert len(shipped) >= 10
    for name in shipped:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), f"{name} would be left out of the wheel"


# -- auth ----------------------------------------------------------------------------------------


def test_pages_without_a_token_redirect_to_login(guarded: TestClient) -> None:
    for url, target in [("/", "/"), ("/runs/lora-sweep?page=2&sort=step", "/runs/lora-sweep?page=2&sort=step")]:
        response = guarded.get(url)
        assert response.status_code == 303
        assert response.headers["location"] == "/login?" + urlencode({"next": target})
    login = parse(guarded.get("/login?next=/runs/alpha").text)
    assert login.one("input", name="next").attrs["value"] == "/runs/alpha"
    assert login.one("input", name="token").attrs["type"] == "password"


@pytest.mark.parametrize("token", [READ_TOKEN, WRITE_TOKEN])
def test_a_token_in_the_header_or_the_cookie_opens_the_pages(guarded: TestClient, token: str) -> None:
    assert guarded.get("/runs/alpha", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    guarded.cookies.set("ckptstore_token", token)
    doc = page(guarded, "/runs/alpha/versions/2")
    assert "Log out" in doc.one("header").text
    assert guarded.get("/runs/alpha/versions/2/manifest.json").status_code == 200


def test_a_wrong_token_in_the_header_is_a_401_page(guarded: TestClient) -> None:
    response = guarded.get("/", headers={"Authorization": "Bearer not-a-valid-token-at-all"})
    assert response.status_code == 401
    assert response.headers["x-error-code"] == "unauthorized"
    assert "the bearer token is not valid" in parse(response.text).one("p", class_="message").text


def test_a_stale_cookie_sends_the_browser_to_login(guarded: TestClient) -> None:
    guarded.cookies.set("ckptstore_token", "revoked-token-123456789")
    response = guarded.get("/runs/alpha")
    assert response.status_code == 303 and response.headers["location"] == "/login?next=%2Fruns%2Falpha"


def test_the_api_does_not_take_the_page_cookie(guarded: TestClient) -> None:
    guarded.cookies.set("ckptstore_token", READ_TOKEN)
    response = guarded.get("/v1/runs")
    assert response.status_code == 401 and response.headers["content-type"] == "application/json"


def test_login_sets_an_http_only_strict_cookie_and_logout_clears_it(guarded: TestClient) -> None:
    response = guarded.post("/login", data={"token": READ_TOKEN, "next": "/runs/alpha"})
    assert response.status_code == 303 and response.headers["location"] == "/runs/alpha"
    cookie = response.headers["set-cookie"]
    assert cookie.startswith(f"ckptstore_token={READ_TOKEN};")
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower() and "Path=/" in cookie
    assert guarded.get("/runs/alpha").status_code == 200
    out = guarded.post("/logout")
    assert out.status_code == 303 and out.headers["location"] == "/login"
    assert 'ckptstore_token=""' in out.headers["set-cookie"] and "Max-Age=0" in out.headers["set-cookie"]
    assert guarded.get("/runs/alpha").status_code == 303
    assert "/logout" in {f.attrs["action"] for f in parse(guarded.get("/logout").text).all("form")}


def test_login_refuses_a_wrong_token(guarded: TestClient) -> None:
    response = guarded.post("/login", data={"token": "guess-guess-guess-guess", "next": "/"})
    assert response.status_code == 401
    assert "set-cookie" not in response.headers
    assert "not valid" in parse(response.text).one("p", class_="error-text").text


def test_login_only_redirects_within_this_server(guarded: TestClient) -> None:
    for target in ("//evil.example/", "https://evil.example/", "/\\evil.example", "javascript:alert(1)"):
        response = guarded.post("/login", data={"token": READ_TOKEN, "next": target})
        assert response.status_code == 303 and response.headers["location"] == "/", target


def test_login_refuses_a_form_posted_from_another_site(guarded: TestClient) -> None:
    response = guarded.post("/login", data={"token": READ_TOKEN}, headers={"Origin": "https://evil.example"})
    assert response.status_code == 403 and "set-cookie" not in response.headers
    same = guarded.post("/login", data={"token": READ_TOKEN}, headers={"Origin": "http://127.0.0.1"})
    assert same.status_code == 303


def test_login_refuses_an_oversized_form(guarded: TestClient) -> None:
    response = guarded.post("/login", data={"token": "x" * 5000})
    assert response.status_code == 413 and response.headers["content-type"].startswith("text/html")


def test_tokens_in_the_url_are_refused(guarded: TestClient) -> None:
    response = guarded.get(f"/runs/alpha?token={READ_TOKEN}", headers={"Authorization": f"Bearer {READ_TOKEN}"})
    assert response.status_code == 400
    assert "log in at /login" in parse(response.text).one("p", class_="message").text


def test_login_and_static_files_need_no_token(guarded: TestClient) -> None:
    assert guarded.get("/login").status_code == 200
    assert guarded.get("/static/style.css").status_code == 200


def test_open_pages_say_there_is_nothing_to_log_in_to(client: TestClient) -> None:
    assert "Log in" not in page(client, "/").one("header").text
    assert "nothing to log in to" in page(client, "/login").text
    assert client.post("/login", data={"token": "anything"}, follow_redirects=False).status_code == 303
