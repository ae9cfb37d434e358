"""The pages in a real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright)
against a real uvicorn server: browse to a run, sort it, tick two versions, compare them, open a
version. Screenshots of each page go to the test's folder; the run page's also to
docs/images/run-page.png for the README (rewritten only when it changed).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from fastapi import FastAPI
from playwright.sync_api import Browser, ConsoleMessage, Dialog, Page, expect, sync_playwright
from sqlalchemy import select

from ckptstore.service.db.models import Version
from ckptstore.service.store import Store
from tests.pages.kit import ATTRIBUTE_KEY, SCRIPT_KEY, long_loss
from tests.servers import running_server

pytestmark = pytest.mark.slow  # a headless browser drives the pages

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DOCS_SCREENSHOT = ROOT / "docs" / "images" / "run-page.png"
SAVED_AT = datetime(2025, 3, 1, 9, 0, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium; fails (never skips) when Debian's chromium is not installed."""
    assert CHROMIUM.is_file(), f"{CHROMIUM} is missing: apt-get install chromium (.ci/run installs it)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def served(open_app: FastAPI, store: Store) -> Iterator[str]:
    """The open app on a real server, its versions' times fixed so screenshots do not change."""
    with store.db.transaction() as session:
        for row in session.scalars(select(Version)):
            row.created_at = SAVED_AT + timedelta(minutes=7 * row.version)
    with running_server(open_app) as url:
        yield url


@pytest.fixture
def watched(browser: Browser) -> Iterator[tuple[Page, list[str]]]:
    """A page at a fixed size and the problems it reports: dialogs (a script ran) and console errors."""
    context = browser.new_context(viewport={"width": 1400, "height": 860}, color_scheme="light")
    page = context.new_page()
    problems: list[str] = []

    def on_dialog(dialog: Dialog) -> None:
        problems.append(f"dialog: {dialog.message}")
        dialog.dismiss()

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            problems.append(f"console: {message.text} ({message.location.get('url')})")

    page.on("dialog", on_dialog)
    page.on("console", on_console)
    try:
        yield page, problems
    finally:
        context.close()


def rows(page: Page, table: str) -> list[list[str]]:
    """Cell texts of the body rows of ``table`` (a CSS selector)."""
    return page.locator(f"{table} tbody tr").evaluate_all(
        "rows => rows.map(r => Array.from(r.cells, c => c.innerText.trim()))"
    )


def save_docs_screenshot(shot: Path) -> None:
    """Copy ``shot`` to docs/images/run-page.png unless the same bytes are already there."""
    DOCS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    if not DOCS_SCREENSHOT.is_file() or DOCS_SCREENSHOT.read_bytes() != shot.read_bytes():
        shutil.copyfile(shot, DOCS_SCREENSHOT)


def test_browse_sort_compare_and_open_a_version(served: str, watched: tuple[Page, list[str]], tmp_path: Path) -> None:
    page, problems = watched
    page.goto(served + "/")
    expect(page.locator("h1")).to_have_text("Runs")
    assert [row[0] for row in rows(page, "#runs")] == ["lora-sweep", "alpha"]
    page.screenshot(path=tmp_path / "runs.png", full_page=True)

    # A run with 120 versions: the newest 50, sorted by loss by clicking its column header.
    page.get_by_role("link", name="lora-sweep", exact=True).click()
    page.wait_for_url(served + "/runs/lora-sweep")
    assert [row[1] for row in rows(page, "#versions")] == [f"v{v}" for v in range(120, 70, -1)]
    page.locator("#versions thead").get_by_role("link", name="loss", exact=True).click()
    page.wait_for_url(served + "/runs/lora-sweep?sort=metric%3Aloss&order=asc")
    by_loss = sorted(range(1, 121), key=long_loss)
    assert [row[1] for row in rows(page, "#versions")] == [f"v{v}" for v in by_loss[:50]]
    expect(page.locator(".pager .current").first).to_have_text("1")
    button = page.locator("#compare-button")
    expect(button).to_be_disabled()
    page.get_by_label(f"compare version {by_loss[0]}").check()
    page.get_by_label(f"compare version {by_loss[1]}").check()
    expect(button).to_be_enabled()
    expect(page.get_by_label(f"compare version {by_loss[2]}")).to_be_disabled()  # two at most
    first, second = sorted(by_loss[:2])
    expect(page.locator("#compare-hint")).to_have_text(f"Compare v{first} with v{second}.")
    page.screenshot(path=tmp_path / "run.png")
    save_docs_screenshot(tmp_path / "run.png")

    # Two versions of alpha compared: the script sends ?a=<older>&b=<newer>.
    page.goto(served + "/")
    page.get_by_role("link", name="alpha", exact=True).click()
    page.wait_for_url(served + "/runs/alpha")
    assert [row[1] for row in rows(page, "#versions")] == ["v2", "v1"]
    page.get_by_label("compare version 2").check()
    expect(page.locator("#compare-hint")).to_have_text("Tick 1 more version to compare.")
    page.get_by_label("compare version 1").check()
    button.click()
    page.wait_for_url(served + "/runs/alpha/diff?a=1&b=2")
    expect(page.locator("h1")).to_have_text("alpha · v1 → v2")
    totals = {row[0]: row[1] for row in rows(page, "#totals")}
    assert totals == {"added": "3", "removed": "1", "changed": "3", "unchanged": "2"}
    assert {row[1] for row in rows(page, "#tensors")} >= {SCRIPT_KEY, ATTRIBUTE_KEY, "extra/rng"}
    assert ["optim/param_groups/0/lr", "0.10", "0.05", "−0.05", "−50.0%"] in rows(page, "#values")
    page.screenshot(path=tmp_path / "diff.png", full_page=True)

    # The newer version's page: sections, shared marks, hostile keys shown as text.
    page.locator("h1").get_by_role("link", name="v2").click()
    page.wait_for_url(served + "/runs/alpha/versions/2")
    expect(page.locator("section.tensors h2")).to_have_count(3)
    model = rows(page, "section.tensors:nth-of-type(1) table")
    assert [(row[0], row[8]) for row in model] == [
        ("emb.weight", "shared"),
        ("fc.weight", "new"),
        ("fc.bias", "shared"),
        ("head.weight", "new"),
    ]
    keys = page.locator("td.key").all_inner_texts()
    assert SCRIPT_KEY.removeprefix("extra/") in keys and ATTRIBUTE_KEY.removeprefix("extra/") in keys
    assert page.locator("img").count() == 0
    page.screenshot(path=tmp_path / "version.png", full_page=True)

    assert problems == []
    assert all((tmp_path / f"{name}.png").stat().st_size > 10_000 for name in ("runs", "run", "diff", "version"))


def test_compare_works_without_javascript(browser: Browser, served: str) -> None:
    context = browser.new_context(java_script_enabled=False)
    try:
        page = context.new_page()
        page.goto(served + "/runs/alpha")
        page.get_by_label("compare version 2").check()
        page.get_by_label("compare version 1").check()
        page.locator("#compare-button").click()
        page.wait_for_url(served + "/runs/alpha/diff?v=2&v=1")
        expect(page.locator("h1")).to_have_text("alpha · v1 → v2")
    finally:
        context.close()


#: The new pages and elements, each looked at 1400 and 800 pixels wide: charts, filters, search,
#: totals, snippets, tensor filter, rounded diff with compared values, and an error page.
LOOKS = {
    "run-charts": "/runs/lora-sweep",
    "run-filtered": "/runs/lora-sweep?tag=*&metric=loss&min=0&max=11",
    "runs-search": "/?q=a&sort=stored",
    "version-filter": "/runs/alpha/versions/2?q=fc.*",
    "diff-values": "/runs/alpha/diff?a=1&b=2&values=1&all=1",
    "error": "/runs/lora-sweep?metric=loss&min=nan",
}


def overflow(page: Page) -> int:
    """Pixels the document is wider than the window (0: no horizontal scroll bar)."""
    return int(page.evaluate("document.documentElement.scrollWidth - window.innerWidth"))


@pytest.mark.parametrize("width", [1400, 800])
def test_new_pages_fit_the_window_without_console_errors(
    browser: Browser, served: str, width: int, tmp_path: Path
) -> None:
    context = browser.new_context(viewport={"width": width, "height": 900}, color_scheme="light")
    problems: list[str] = []
    try:
        page = context.new_page()
        page.on("console", lambda m: problems.append(f"{m.text} ({page.url})") if m.type == "error" else None)
        page.on("pageerror", lambda error: problems.append(f"{error} ({page.url})"))
        for name, url in LOOKS.items():
            page.goto(served + url)
            assert overflow(page) == 0, f"{url} is wider than {width} px"
            for chart in page.locator("svg.chart").all():
                box = chart.bounding_box()
                assert box is not None and 0 <= box["x"] and box["x"] + box["width"] <= width, url
            page.screenshot(path=tmp_path / f"{name}-{width}.png", full_page=True)
        # The error page's own status is the one message expected: Chromium logs a 400 document.
        assert [p for p in problems if not ("status of 400" in p and "min=nan" in p)] == []
        assert len(problems) == 1
    finally:
        context.close()
    assert all((tmp_path / f"{name}-{width}.png").stat().st_size > 10_000 for name in LOOKS)


def test_charts_show_each_version_on_hover_and_draw_without_script(browser: Browser, served: str) -> None:
    for scripts in (True, False):
        context = browser.new_context(viewport={"width": 1400, "height": 900}, java_script_enabled=scripts)
        try:
            page = context.new_page()
            page.goto(served + "/runs/lora-sweep")
            loss = page.locator('figure[data-metric="loss"] circle.pt')
            expect(loss).to_have_count(120)
            expect(page.locator("#storage-chart g.bar")).to_have_count(120)
            point = page.locator('figure[data-metric="loss"] circle[data-version="7"]')
            point.hover()
            assert point.locator("title").text_content() == f"v7 · step 700 · loss {long_loss(7):g}"
            box = point.bounding_box()
            assert box is not None and box["width"] > 0
        finally:
            context.close()


def test_the_filter_form_and_the_copy_buttons_work_in_the_browser(served: str, watched: tuple[Page, list[str]]) -> None:
    page, problems = watched
    page.goto(served + "/runs/lora-sweep")
    page.get_by_label("Tag").fill("release-*")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url("**/runs/lora-sweep?tag=release-*&metric=&min=&max=")
    assert [row[1] for row in rows(page, "#versions")] == ["v100"]
    expect(page.locator('figure[data-metric="loss"] circle.pt')).to_have_count(1)
    page.goto(served + "/?q=LORA")
    assert [row[0] for row in rows(page, "#runs")] == ["lora-sweep"]
    page.goto(served + "/runs/alpha/versions/2")
    expect(page.locator("figure.snippet button.copy")).to_have_count(2)  # added by the script on localhost
    assert problems == []
