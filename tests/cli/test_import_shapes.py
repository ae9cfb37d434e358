"""``ckptstore import`` refuses a tensor whose shape no tensor can have (its size or strides
overflow 64 bits) by name, whatever file holds it, and stores nothing."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from tests.cli.conftest import Cli

#: No element, yet laid out contiguously these need strides of 2**124 and 2**63.
SHAPES = [[0, 2**62, 2**62], [0, 2**63]]


def safetensors_file(path: Path, shape: list[int]) -> Path:
    text = json.dumps({"big": {"dtype": "U8", "shape": shape, "data_offsets": [0, 0]}}).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    return path


def assert_refused(cli: Cli, source: Path, shape: list[int]) -> None:
    result = cli("import", source, "victim")
    assert result.exit_code in (1, 2), result.output
    assert result.stderr.startswith("error: "), result.stderr
    assert f"shape {shape}" in result.stderr and "overflow 64-bit integers" in result.stderr, result.stderr
    assert json.loads(cli.ok("ls", "--json")) == []


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_safetensors_file_with_such_a_shape_is_refused(cli: Cli, tmp_path: Path, shape: list[int]) -> None:
    assert_refused(cli, safetensors_file(tmp_path / "model.safetensors", shape), shape)


def test_a_torch_save_file_with_such_a_view_is_refused(cli: Cli, tmp_path: Path) -> None:
    """torch.save keeps a view's size and strides, so a zero-size view of any shape survives it."""
    shape = [0, 2**40, 2**40]
    path = tmp_path / "model.pt"
    big = torch.empty(0).as_strided(shape, [0, 0, 0])
    torch.save({"w": torch.ones(2), "big": big}, path)  # noqa: TID251 - making the user's file under test
    assert_refused(cli, path, shape)
