"""One number format per column and series, whole-number step axes, and a diff that reads as
Python: properties over hypothesis values, then the pages that show them (the run table's lr
column, its charts' axes and the diff of betas and step)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.service.api.pages.charts import line_chart, nice_ticks
from ckptstore.service.api.pages.formatting import delta, python_text
from ckptstore.service.api.pages.numbers import DIGITS, NumberFormat
from ckptstore.service.format.manifest import ManifestBody
from ckptstore.service.store import Store
from tests.pages.dom import Node
from tests.pages.kit import entry, ingest, page_client, raw
from tests.pages.test_pages import page

#: Magnitudes a metric or hyperparameter takes: learning rates to token counts.
values = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False, allow_infinity=False).filter(
    lambda v: v == 0 or abs(v) >= 1e-12
)
columns = st.lists(values, min_size=1, max_size=40)


def parsed(text: str) -> float:
    return float(text.replace(",", ""))


def decimals(text: str) -> int:
    """Digits after the point (of the mantissa, in scientific notation)."""
    return len(text.partition("e")[0].partition(".")[2])


@settings(max_examples=400, deadline=None)
@given(columns)
def test_a_column_is_written_in_one_notation_with_one_precision(column: list[float]) -> None:
    fmt = NumberFormat.of(column)
    texts = [fmt(v) for v in column]
    shown = [t for v, t in zip(column, texts, strict=True) if v != 0]
    scientific = ["e" in t for t in shown]
    assert all(scientific) or not any(scientific), texts  # never 1.19898e-07 beside 0.000256862
    assert len({decimals(t) for t in shown}) <= 1, texts  # the same decimals in every row
    if fmt.kind == "integer":
        assert all("." not in t and "e" not in t for t in texts)
    for value, text in zip(column, texts, strict=True):
        # Every value keeps its six significant digits: off by at most half the sixth digit's unit.
        if value == 0:
            assert parsed(text) == 0
        else:
            unit = 10 ** (math.floor(math.log10(abs(value))) - (DIGITS - 1))
            assert abs(parsed(text) - value) <= unit * 0.5000001, (value, text)


@given(columns, st.sampled_from([math.nan, math.inf, -math.inf, None]))
def test_what_is_not_a_number_never_picks_the_notation(column: list[float], odd: float | None) -> None:
    assert NumberFormat.of([*column, odd]) == NumberFormat.of(column)
    assert NumberFormat.of(column)(odd) in {"NaN", "Infinity", "-Infinity", "—"}


def test_the_columns_the_pages_showed_mixed() -> None:
    lr = NumberFormat.of([1.19898e-07, 0.000256862])
    assert [lr(1.19898e-07), lr(0.000256862)] == ["1.19898e-07", "2.56862e-04"]
    loss = NumberFormat.of([2.5, 0.125, 11.25])
    assert [loss(2.5), loss(0.125), loss(11.25)] == ["2.500", "0.125", "11.250"]
    assert NumberFormat.of([12000, 3])(12000) == "12,000"


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**7), st.integers(0, 10**7), st.integers(2, 8))
def test_step_axes_take_whole_numbers_only(a: int, b: int, count: int) -> None:
    low, high = min(a, b), max(a, b)
    ticks = nice_ticks(low, high, count, integer=True)
    assert ticks and all(float(t).is_integer() and low <= t <= high for t in ticks)
    assert ticks == sorted(set(ticks)) and len(ticks) <= 4 * count


def test_a_step_axis_from_2_to_14_has_no_halves() -> None:
    chart = line_chart("loss", [(float(s), 1 / s, s, "") for s in range(2, 15)], "step")
    assert [t.label for t in chart.x_ticks] == ["5", "10"]  # not 2.5, 7.5, 12.5
    assert nice_ticks(2, 14) == [2.5, 5.0, 7.5, 10.0, 12.5]  # a value axis may still take halves


@given(st.lists(st.floats(0.01, 0.9999), min_size=1, max_size=4))
def test_tuples_read_as_python_tuples(items: list[float]) -> None:
    text = python_text({"__tuple__": items})
    assert text.startswith("(") and text.endswith(")") and "__tuple__" not in text
    assert len(text[1:-1].rstrip(",").split(", ")) == len(items)


def test_stored_markers_read_as_python() -> None:
    assert python_text({"__tuple__": [0.89, 0.999]}) == "(0.89, 0.999)"
    assert python_text({"__tuple__": [3]}) == "(3,)"
    assert python_text({"__float__": "inf"}) == "inf"
    assert python_text({"__dtype__": "bfloat16"}) == "torch.bfloat16"
    assert python_text({"__dict__": [[3, "a"]]}) == '{3: "a"}'
    assert python_text([True, None]) == "[True, None]"


@given(st.integers(0, 10**9), st.integers(0, 10**9))
def test_a_counter_changes_by_a_count_never_a_percentage(before: int, after: int) -> None:
    change = delta(before, after, "step")
    assert change is not None and change[2] == "—" and "%" not in change[0]
    assert parsed(change[0].replace("−", "-").replace("±", "")) == after - before


# -- the pages ----------------------------------------------------------------------------------

LRS = [0.000256862 * (1 - step / 13) + 1.19898e-07 for step in range(13)]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run 'warmup': 13 versions at steps 2…14 whose lr decays from 0.000256862 to 1.19898e-07 +,
    betas saved as a tuple and a step counter."""
    folder = tmp_path_factory.mktemp("numbers") / "home"
    store = Store.open_home(folder)
    try:
        tensor = raw(9000, (4,))
        ingest(store, tensor)
        entries = [entry("model/w", tensor, trainable=True)]
        for index, lr in enumerate(LRS):
            group = {"lr": lr, "betas": {"__tuple__": [0.89 + index / 100, 0.999]}, "params": ["w"]}
            body = ManifestBody(
                tensors=entries,
                step=index + 2,
                metrics={"lr": lr, "loss": 2.5 / (index + 1)},
                state={"optim": {"state": {}, "param_groups": [group]}},
            )
            store.commit("warmup", body)
        store.commit("warmup", ManifestBody(tensors=entries, step=1000, metrics={"lr": 1.19898e-07, "loss": 0.1}))
    finally:
        store.close()
    return folder


@pytest.fixture
def client(home: Path) -> Iterator[TestClient]:
    with page_client(home) as test_client:
        yield test_client


def column(doc: Node, name: str) -> list[str]:
    table = doc.one("table", id="versions")
    index = table.header().index(name)
    return [row[index] for row in table.rows()]


def test_the_run_table_writes_each_metric_column_in_one_notation(client: TestClient) -> None:
    doc = page(client, "/runs/warmup?per_page=13&sort=step&order=asc")
    lr = column(doc, "lr")
    assert lr == [f"{value:.5e}" for value in LRS]
    assert all(re.fullmatch(r"\d\.\d{5}e-0\d", text) for text in lr), lr
    loss = column(doc, "loss")
    assert len({decimals(text) for text in loss}) == 1 and "e" not in "".join(loss)
    cells = doc.one("table", id="versions").all("td", class_="metric")
    assert {c.attrs["title"] for c in cells} >= {repr(LRS[0])}  # the exact value on hover


def test_the_charts_step_axis_and_value_axis(client: TestClient) -> None:
    doc = page(client, "/runs/warmup?tag=&metric=lr&min=0&max=1")
    figure = doc.one("figure", **{"data-metric": "lr"})
    x = [t.text for t in figure.all("text", class_="x")]
    assert x and all(re.fullmatch(r"[\d,]+", label) for label in x), x
    y = [t.text for t in figure.all("text", class_="y")]
    assert len({"e" in label for label in y}) == 1 and len({decimals(label) for label in y}) == 1, y
    hovers = [c.one("title").text.rsplit(" ", 1)[1] for c in figure.all("circle", class_="pt")]
    assert all(re.fullmatch(r"\d\.\d{5}e-0\d", text) for text in hovers), hovers


def test_a_step_axis_of_steps_2_to_14_counts_whole_steps(tmp_path: Path) -> None:
    store = Store.open_home(tmp_path / "home")
    try:
        tensor = raw(9100, (4,))
        ingest(store, tensor)
        for step in range(2, 15):
            store.commit(
                "short",
                ManifestBody(tensors=[entry("model/w", tensor, trainable=True)], step=step, metrics={"loss": 1 / step}),
            )
    finally:
        store.close()
    with page_client(tmp_path / "home") as client:
        doc = page(client, "/runs/short")
    figure = doc.one("figure", **{"data-metric": "loss"})
    assert [t.text for t in figure.all("text", class_="x")] == ["5", "10"]


def test_the_diff_reads_tuples_and_counts_steps(client: TestClient) -> None:
    doc = page(client, "/runs/warmup/diff?a=1&b=13")
    found = {row[0]: row[1:] for row in doc.one("table", id="values").rows()}
    assert found["optim/param_groups/0/betas"] == ["(0.89, 0.999)", "(1.01, 0.999)", "—", "—"]
    assert found["step"] == ["2", "14", "+12", "—"]  # a counter: +12, never +600%
    change = LRS[12] - LRS[0]
    assert found["optim/param_groups/0/lr"] == [
        f"{LRS[0]:.5e}",
        f"{LRS[12]:.5e}",
        f"−{-change:.5e}",
        f"−{-change / LRS[0] * 100:.1f}%",
    ]
    assert "__tuple__" not in doc.one("table", id="values").text
