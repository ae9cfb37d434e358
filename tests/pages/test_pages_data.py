"""The pages' data shaping on plain values: sizes, shares, page links, sort orders, sections."""

from __future__ import annotations

import math
import re
import struct
from datetime import datetime, timedelta, timezone

import pytest

from ckptstore.service.api.pages import tensor_values
from ckptstore.service.api.pages.charts import byte_ticks, line_chart, nice_ticks
from ckptstore.service.api.pages.data import (
    RunFilter,
    RunPage,
    download_name,
    human_size,
    number,
    percent,
    section_of,
    shape,
    when,
)
from ckptstore.service.api.pages.formatting import delta, full_json, reading_json
from ckptstore.service.errors import InvalidInputError
from tests.pages import kit


@pytest.mark.parametrize(
    ("nbytes", "shown"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (5 << 20, "5.0 MiB"),
        (3 << 30, "3.0 GiB"),
        (2**70, "1024.0 EiB"),
    ],
)
def test_human_size_uses_binary_units(nbytes: int, shown: str) -> None:
    assert human_size(nbytes) == shown


def test_cell_formats() -> None:
    assert (percent(None), percent(0.0), percent(0.8754)) == ("—", "0.0%", "87.5%")
    assert (number(None), number(12000), number(0.1 + 0.2), number(1e-9)) == ("—", "12,000", "0.3", "1e-09")
    assert (shape([]), shape([4, 4]), shape([0])) == ("scalar", "4 × 4", "0")
    assert when(datetime(2025, 3, 1, 9, 0)) == "2025-03-01 09:00:00 UTC"
    assert when(datetime(2025, 3, 1, 10, 0, tzinfo=timezone(timedelta(hours=1)))) == "2025-03-01 09:00:00 UTC"


def run_page(page: int, pages: int) -> RunPage:
    return RunPage("r", [], [], pages * 50, page, pages, 50, "version", "desc")


@pytest.mark.parametrize(
    ("page", "pages", "links"),
    [
        (1, 1, [1]),
        (1, 3, [1, 2, 3]),
        (1, 10, [1, 2, 3, None, 10]),
        (5, 10, [1, 2, 3, 4, 5, 6, 7, None, 10]),
        (4, 10, [1, 2, 3, 4, 5, 6, None, 10]),
        (8, 10, [1, None, 6, 7, 8, 9, 10]),
        (10, 10, [1, None, 8, 9, 10]),
    ],
)
def test_page_links_keep_the_ends_and_the_neighbours(page: int, pages: int, links: list[int | None]) -> None:
    assert run_page(page, pages).page_links() == links


def test_sort_urls_toggle_and_leave_defaults_out() -> None:
    current = RunPage("r", [], [], 500, 3, 10, 20, "metric:loss", "asc")
    assert current.url() == "/runs/r?page=3&per_page=20&sort=metric%3Aloss&order=asc"
    assert current.sort_url("metric:loss") == "/runs/r?per_page=20&sort=metric%3Aloss"
    assert current.sort_url("step") == "/runs/r?per_page=20&sort=step&order=asc"
    assert current.url(page=1, sort="version", order="desc") == "/runs/r?per_page=20"


def test_sections_of_keys() -> None:
    assert section_of("model/fc.weight") == ("Model", "model/")
    assert section_of("optim/state/fc.weight/exp_avg") == ("Optimizer state", "optim/state/")
    assert section_of("optim/param_groups/0/lr_tensor") == ("Param groups", "optim/param_groups/")
    assert section_of("optim/other") == ("Optimizer state", "optim/")
    assert section_of("scheduler/last_epoch") == ("Scheduler", "scheduler/")
    assert section_of("extra/rng") == ("Extra", "extra/")


def test_values_read_rounded_with_their_change() -> None:
    assert reading_json(0.0022499999999999994) == "0.00225"
    assert reading_json([0.9, 0.9990000000000001]) == "[0.9, 0.999]"
    assert reading_json({"__tuple__": [0.89, 0.9990000000000001]}) == "(0.89, 0.999)"  # betas, as Python writes them
    assert reading_json({"b": 1 / 3, "a": "x"}) == '{"a": "x", "b": 0.333333}'
    assert (reading_json(None), reading_json(True), reading_json(12000)) == ("—", "True", "12,000")
    assert full_json(0.0022499999999999994) == "0.0022499999999999994"
    assert delta(0.0025, 0.0022499999999999994) == ("−0.00025", repr(0.0022499999999999994 - 0.0025), "−10.0%")
    assert delta(0, 5) == ("+5", "5", "—")
    assert delta(2, 2) == ("±0", "0", "—")  # whole numbers (counters, sizes): no percentage
    assert delta(2.0, 2.0) == ("±0", "0.0", "+0.0%")
    assert delta(10.0, 59.0, "metrics/epoch") == ("+49", "49.0", "—")  # a counter by name
    assert delta(-1.5, 2.5) == ("+4.0", "4.0", "—")  # across zero a percentage means nothing
    assert delta(-4.0, -2.0) == ("+2", "2.0", "+50.0%")  # over the magnitude of the old value
    assert delta([1], [2]) is None and delta(True, False) is None and delta("a", 1) is None


@pytest.mark.parametrize(
    ("low", "high", "ticks"),
    [
        (0, 10, [0, 2, 4, 6, 8, 10]),
        (0.013, 0.097, [0.02, 0.04, 0.06, 0.08]),
        (100, 12000, [2500, 5000, 7500, 10000]),
        (3, 3, [3]),
    ],
)
def test_axis_ticks_are_round_numbers(low: float, high: float, ticks: list[float]) -> None:
    assert nice_ticks(low, high) == ticks


def test_byte_axis_ticks_step_in_binary_units() -> None:
    assert [human_size(t) for t in byte_ticks(16_896)] == ["0 B", "5.0 KiB", "10.0 KiB", "15.0 KiB", "20.0 KiB"]
    assert [human_size(t) for t in byte_ticks(3 << 20)] == ["0 B", "1.0 MiB", "2.0 MiB", "3.0 MiB"]
    assert byte_ticks(1) == [0, 1]


def test_a_line_chart_places_each_point_inside_the_plot() -> None:
    chart = line_chart("loss", [(100.0, 2.0, 1, "a"), (300.0, 1.0, 3, "c"), (200.0, 4.0, 2, "b")], "step")
    assert [m.version for m in chart.marks] == [1, 2, 3]  # by x
    assert all(chart.left <= m.x <= chart.right and chart.top <= m.y <= chart.bottom for m in chart.marks)
    assert chart.marks[1].y < chart.marks[0].y < chart.marks[2].y  # higher values are drawn higher
    single = line_chart("loss", [(5.0, 1.0, 1, "only")], "step")
    assert len(single.marks) == 1 and single.line.count(",") == 1


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("model/fc.weight", "model.fc.weight.f32.bin"),
        ("extra/<script>alert(1)</script>", "extra._script_alert_1_.script.f32.bin"),
        ('extra/"; filename=evil.exe', "extra._filename_evil.exe.f32.bin"),
        ("extra/../../etc/passwd", "extra.etc.passwd.f32.bin"),
        ("extra/ünïcödé", "extra._n_c_d.f32.bin"),
    ],
)
def test_download_names_keep_only_safe_characters_of_the_key(key: str, name: str) -> None:
    trainable = True if key.startswith("model/") else None
    assert download_name(kit.entry(key, kit.raw(1), trainable=trainable)) == name


def test_a_long_key_is_cut_and_told_apart_by_its_digest() -> None:
    tensor = kit.raw(1)
    name = download_name(kit.entry("extra/" + "a" * 300, tensor))
    assert name == "extra." + "a" * 114 + "-" + tensor.digest[:12] + ".f32.bin"


@pytest.mark.parametrize(
    ("dtype", "data", "values"),
    [
        ("F16", struct.pack("<3e", 1.5, -2.0, 65504.0), [1.5, -2.0, 65504.0]),
        ("BF16", struct.pack("<f", 3.0)[2:] + struct.pack("<f", -0.5)[2:], [3.0, -0.5]),
        ("F8_E4M3", bytes([0x38, 0xB8, 0x7E, 0x01]), [1.0, -1.0, 448.0, 2**-9]),
        ("F8_E5M2", bytes([0x3C, 0x7B, 0x7C]), [1.0, 57344.0, math.inf]),
        ("F8_E4M3FNUZ", bytes([0x40, 0x7F]), [1.0, 240.0]),
        ("F8_E5M2FNUZ", bytes([0x40, 0x7F]), [1.0, 57344.0]),
        ("I16", struct.pack("<2h", -3, 7), [-3, 7]),
        ("BOOL", bytes([0, 1]), [0, 1]),
    ],
)
def test_values_decode_without_torch(dtype: str, data: bytes, values: list[float]) -> None:
    assert list(tensor_values.decode(dtype, data)) == values


def test_float8_nans() -> None:
    assert math.isnan(tensor_values.decode("F8_E4M3", bytes([0x7F]))[0])
    assert math.isnan(tensor_values.decode("F8_E4M3FNUZ", bytes([0x80]))[0])
    assert math.isnan(tensor_values.decode("F8_E5M2", bytes([0x7D]))[0])
    assert not tensor_values.comparable("C64")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("<b>", None, None, None), "tag filter '<b>' may hold"),
        ((None, "bad metric", None, None), "metric 'bad metric' cannot name a metric"),
        ((None, "loss", "1e999", None), "min must be a finite number such as 0.5, not '1e999'"),
        ((None, None, None, "2"), "min and max need a metric"),
        ((None, "loss", "3", "2"), "min (3) is above max (2)"),
    ],
)
def test_run_filters_refuse_what_they_cannot_mean(args: tuple[str | None, ...], says: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(says)):
        RunFilter.parse(*args)


def test_run_filters_read_a_form() -> None:
    assert RunFilter.parse("", " ", "", "") == RunFilter()
    chosen = RunFilter.parse(" best ", "loss", "0.5", "")
    assert chosen == RunFilter("best", "loss", 0.5, None)
    assert chosen.describe() == "tagged 'best', loss at least 0.5"
    assert chosen.query() == {"tag": "best", "metric": "loss", "min": "0.5", "max": None}
