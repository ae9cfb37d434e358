"""The pages' data shaping on plain values: sizes, shares, page links, sort orders, sections."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from service.api.pages_data import Order, RunPage, human_size, number, percent, section_of, shape, sort_versions, when
from service.errors import InvalidInputError
from service.records import VersionInfo


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


def info(version: int, step: int | None, **metrics: float) -> VersionInfo:
    return VersionInfo(
        run_id="r",
        version=version,
        parent=None,
        created_at=datetime(2025, 1, 1),
        tags=[],
        step=step,
        metrics=metrics,
        tensors_total=0,
        tensors_new=0,
        bytes_total=0,
        bytes_new=0,
        bytes_trainable=0,
    )


def test_sorting_puts_missing_values_last_in_either_order() -> None:
    versions = [info(1, 10, loss=3.0), info(2, None, loss=1.0), info(3, 30), info(4, 40, loss=1.0)]

    def order(sort: str, how: Order) -> list[int]:
        return [v.version for v in sort_versions(versions, sort, how)]

    assert order("metric:loss", "asc") == [2, 4, 1, 3]  # ties by version
    assert order("metric:loss", "desc") == [1, 4, 2, 3]
    assert order("step", "asc") == [1, 3, 4, 2]
    assert order("step", "desc") == [4, 3, 1, 2]
    assert order("version", "desc") == [4, 3, 2, 1]
    with pytest.raises(InvalidInputError, match="cannot sort by 'metric:'"):
        sort_versions(versions, "metric:", "asc")


def test_sections_of_keys() -> None:
    assert section_of("model/fc.weight") == ("Model", "model/")
    assert section_of("optim/state/fc.weight/exp_avg") == ("Optimizer state", "optim/state/")
    assert section_of("optim/param_groups/0/lr_tensor") == ("Param groups", "optim/param_groups/")
    assert section_of("optim/other") == ("Optimizer state", "optim/")
    assert section_of("scheduler/last_epoch") == ("Scheduler", "scheduler/")
    assert section_of("extra/rng") == ("Extra", "extra/")
