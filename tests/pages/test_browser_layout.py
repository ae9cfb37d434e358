"""The pages at common window widths in a real headless Chromium against a real uvicorn server:
no table column or snippet is clipped, and the runs page's form compares runs.

A table fits its container (nothing hidden to the right of a scroll bar 50 rows down) and no
header or cell holds more text than it shows; the version page's Python snippet shows every
line whole and names the store it came from.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from playwright.sync_api import Browser, Page, expect

from ckptstore.service.api import create_app
from ckptstore.service.format.manifest import ManifestBody
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.pages.kit import LONG, entry, ingest, raw, seed
from tests.pages.test_browser import browser  # noqa: F401 - the module's headless Chromium
from tests.servers import running_server

pytestmark = pytest.mark.slow  # a headless browser drives the pages

RUN = "bert-base-lr-sweep"
#: What a Hugging Face Trainer run reports, as the run table shows it: seven metric columns.
METRICS = ("loss", "lr", "grad_norm", "epoch", "eval_loss", "eval_accuracy", "tokens_per_second")
WIDTHS = (1280, 1400, 1920)
SMALL_RUNS = [f"probe-{i}" for i in range(9)]


def trainer_metrics(step: int, scale: float = 1.0) -> dict[str, float]:
    return {
        "loss": 2.5 * scale / (1 + step),
        "lr": 0.000256862 * (1 - step / 13) + 1.19898e-07,
        "grad_norm": 3.1 + step,
        "epoch": step / 4,
        "eval_loss": 2.0 / (1 + step),
        "eval_accuracy": 0.5 + step / 30,
        "tokens_per_second": 12000.5 + step,
    }


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page tests' runs, a tagged 13-version run reporting a Trainer's seven metrics, a second
    run like it, and nine one-version runs."""
    folder = tmp_path_factory.mktemp("layout") / "home"
    store = Store.open_home(folder)
    try:
        seed(store)
        tensor = raw(9500, (4,))
        ingest(store, tensor)
        entries = [entry("model/w", tensor, trainable=True)]
        for run, scale in ((RUN, 1.0), (RUN + "-2", 1.5)):
            for step in range(13):
                group = {"lr": trainer_metrics(step)["lr"], "betas": {"__tuple__": [0.9, 0.999]}, "params": ["w"]}
                body = ManifestBody(
                    tensors=entries,
                    step=step * 50,
                    metrics=trainer_metrics(step, scale),
                    state={"optim": {"state": {}, "param_groups": [group]}},
                )
                store.commit(run, body, tags=["warmup-done"] if step == 4 else [])
        for index, run in enumerate(SMALL_RUNS):
            store.commit(run, ManifestBody(tensors=entries, step=index, metrics={"loss": 1.0 / (index + 1)}))
    finally:
        store.close()
    return folder


@pytest.fixture(scope="module")
def served(home: Path) -> Iterator[str]:
    store = Store.open_home(home)
    app: FastAPI = create_app(store, Settings(home=home, tokens=None, host="127.0.0.1"))
    try:
        with running_server(app) as url:
            yield url
    finally:
        store.close()


#: Pages with tables, each looked at in every width.
PAGES = {
    "runs": "/",
    "run": f"/runs/{RUN}",
    "run-long": f"/runs/{LONG}",
    "version": f"/runs/{RUN}/versions/3",
    "diff": f"/runs/{RUN}/diff?a=1&b=13&values=1&all=1",
    "compare": f"/compare?run={RUN}&run={RUN}-2&run=alpha&run={LONG}",
}

#: For each table: its width against its container's, and the headers and cells holding more than they show.
MEASURE = """() => Array.from(document.querySelectorAll("table")).map((table) => ({
  id: table.id,
  table: table.getBoundingClientRect().width,
  box: table.parentElement.clientWidth,
  clipped: Array.from(table.querySelectorAll("th, td"))
    .filter((cell) => cell.scrollWidth > cell.clientWidth + 1)
    .map((cell) => cell.innerText),
}))"""


def measure(page: Page) -> list[dict[str, object]]:
    return page.evaluate(MEASURE)


@pytest.mark.parametrize("width", WIDTHS)
def test_no_column_is_clipped_at_common_widths(browser: Browser, served: str, width: int, tmp_path: Path) -> None:  # noqa: F811
    context = browser.new_context(viewport={"width": width, "height": 900}, color_scheme="light")
    try:
        page = context.new_page()
        for name, url in PAGES.items():
            page.goto(served + url)
            assert page.evaluate("document.documentElement.scrollWidth - window.innerWidth") == 0, url
            for table in measure(page):
                assert table["table"] <= table["box"] + 1, f"{url} #{table['id']} is wider than its box at {width} px"
                assert table["clipped"] == [], f"{url} #{table['id']} clips {table['clipped']} at {width} px"
            page.screenshot(path=tmp_path / f"{name}-{width}.png", full_page=True)
        # The run table the probe saw cut ("Dedup savin"): every header is there, whole.
        page.goto(served + PAGES["run"])
        headers = page.locator("#versions thead th").all_inner_texts()
        assert [h.replace("\n", " ") for h in headers[-5:]] == [
            "Logical size",
            "New bytes stored",
            "Dedup saving",
            "Trainable",
            "Parent",
        ]
        assert {name.replace("\n", "") for name in headers} >= set(METRICS)
        for cell in page.locator("#versions thead th").all():
            box = cell.bounding_box()
            assert box is not None and box["x"] + box["width"] <= width, cell.inner_text()
    finally:
        context.close()


@pytest.mark.parametrize("width", (800, *WIDTHS))
def test_the_python_snippet_shows_every_line_and_the_store(browser: Browser, served: str, width: int) -> None:  # noqa: F811
    context = browser.new_context(viewport={"width": width, "height": 900})
    try:
        page = context.new_page()
        page.goto(served + f"/runs/{RUN}/versions/3")
        snippet = page.locator("#snippet-python")
        fits = snippet.evaluate("pre => pre.scrollWidth <= pre.clientWidth && pre.scrollHeight <= pre.clientHeight")
        assert fits, f"the snippet is cut at {width} px"
        text = snippet.evaluate("pre => pre.textContent")
        assert f'store = client.Client("{served}", token=os.environ.get("CKPTSTORE_TOKEN"))' in text
        assert f'loaded = store.load("{RUN}", version=3, model=model, optim=optim)' in text
        box = snippet.bounding_box()
        assert box is not None and box["x"] + box["width"] <= width
    finally:
        context.close()


def test_tick_runs_on_the_runs_page_and_compare_them(browser: Browser, served: str) -> None:  # noqa: F811
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    problems: list[str] = []
    try:
        page = context.new_page()
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda error: problems.append(str(error)))
        page.goto(served + "/")
        button = page.locator("#compare-runs-button")
        expect(button).to_be_disabled()
        page.get_by_label(f"compare run {RUN}", exact=True).check()
        expect(page.locator("#compare-runs-hint")).to_have_text("Tick 1 more run to compare (at most 8).")
        page.get_by_label(f"compare run {RUN}-2", exact=True).check()
        expect(button).to_be_enabled()
        button.click()
        page.wait_for_url("**/compare?run=*")
        assert sorted(page.url.split("?", 1)[1].split("&")) == sorted([f"run={RUN}", f"run={RUN}-2"])
        loss = page.locator('figure[data-metric="lr"] g.series')
        expect(loss).to_have_count(2)
        expect(page.locator('figure[data-metric="lr"] circle.pt')).to_have_count(26)
        point = page.locator(f'figure[data-metric="loss"] g[data-run="{RUN}-2"] circle[data-version="2"]')
        point.hover()
        assert point.locator("title").text_content() == f"{RUN}-2 · v2 · step 50 · loss 1.875000"

        # Eight runs at most: the ninth box is disabled once eight are ticked.
        page.goto(served + "/")
        for run in SMALL_RUNS[:8]:
            page.get_by_label(f"compare run {run}", exact=True).check()
        expect(page.get_by_label(f"compare run {SMALL_RUNS[8]}", exact=True)).to_be_disabled()
        expect(page.locator("#compare-runs-hint")).to_have_text("Compare 8 runs (8 at most).")
        button.click()
        page.wait_for_url("**/compare?run=*")
        expect(page.locator('figure[data-metric="loss"] g.series')).to_have_count(8)
        assert problems == []
    finally:
        context.close()


def test_the_comparison_works_without_javascript(browser: Browser, served: str) -> None:  # noqa: F811
    context = browser.new_context(java_script_enabled=False)
    try:
        page = context.new_page()
        page.goto(served + "/")
        for run in SMALL_RUNS:  # nine: the server refuses, saying why
            page.get_by_label(f"compare run {run}", exact=True).check()
        page.locator("#compare-runs-button").click()
        page.wait_for_url("**/compare?run=*")
        expect(page.locator("p.message")).to_contain_text("a page compares at most 8")
        page.goto(served + "/")
        page.get_by_label("compare run alpha", exact=True).check()
        page.get_by_label(f"compare run {LONG}", exact=True).check()
        page.locator("#compare-runs-button").click()
        page.wait_for_url("**/compare?run=*")
        expect(page.locator("h1")).to_have_text("Compare 2 runs")
        expect(page.locator('figure[data-metric="loss"] g.series')).to_have_count(2)
    finally:
        context.close()
