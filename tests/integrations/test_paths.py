"""``ckptstore://RUN@REF`` paths and the tags trainers' file names become."""

from __future__ import annotations

import pytest

from ckptstore.client.integrations.paths import StoreRef, parse_store_path, tag_for_path
from ckptstore.service.errors import InvalidNameError
from ckptstore.service.format.names import validate_tag


def test_store_paths_parse_to_run_and_ref() -> None:
    assert parse_store_path("ckptstore://my-run@3") == StoreRef("my-run", 3)
    assert parse_store_path("ckptstore://my-run@best") == StoreRef("my-run", "best")
    assert parse_store_path("ckptstore://my-run") == StoreRef("my-run", "latest")
    assert str(StoreRef("my-run", 3)) == "ckptstore://my-run@3"


@pytest.mark.parametrize("path", ["/tmp/x.ckpt", "last.ckpt", "s3://bucket/x", 7, None])
def test_other_paths_are_not_store_paths(path: object) -> None:
    assert parse_store_path(path) is None


@pytest.mark.parametrize(
    "path", ["ckptstore://my-run@", "ckptstore://../x@1", "ckptstore://run@0", "ckptstore://run@a/b", "ckptstore://"]
)
def test_malformed_store_paths_are_refused_naming_them(path: str) -> None:
    with pytest.raises(InvalidNameError, match="ckptstore://"):
        parse_store_path(path)


def test_file_names_that_are_tags_stay_as_they_are() -> None:
    assert tag_for_path("/ckpts/last.ckpt") == "last"
    assert tag_for_path("/ckpts/last-v1.ckpt") == "last-v1"
    assert tag_for_path("best") == "best"


@pytest.mark.parametrize(
    "names",
    [
        ("epoch=3-step=400.ckpt", "epoch_3-step_400.ckpt"),
        ("3.ckpt", "c3.ckpt"),
        ("latest.ckpt", "latest_.ckpt"),
        ("x" * 70 + "a.ckpt", "x" * 70 + "b.ckpt"),
        ("checkpoint-ü.ckpt", "checkpoint-_.ckpt"),
    ],
)
def test_other_names_become_distinct_valid_tags(names: tuple[str, str]) -> None:
    first, second = (tag_for_path(f"/ckpts/{name}") for name in names)
    assert validate_tag(first) == first and validate_tag(second) == second
    assert first != second
    assert tag_for_path(f"/elsewhere/{names[0]}") == first  # the folder is not part of the tag
