"""numpy scalars and arrays in a ``.pt`` (``{"best_acc": np.float64(0.9), "hist": np.array([...])}``,
common in older checkpoints) are read as data by the allow-list reader, never through numpy's own
reconstructors: scalars become numbers in ``extra`` (and metrics where the name is one), arrays tensors
of the same dtype, shape and bits. Arrays that are not plain numbers, or whose shape and bytes
disagree, refuse the file in one line."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ckptstore.client.formats.importing import read_checkpoint
from ckptstore.service.errors import InvalidInputError
from tests.cli.conftest import Cli
from tests.cli.hostile_pickles import torch_saved
from tests.client.models import tensors_equal

DTYPES = ["?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8"]
WEIGHTS = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def test_numpy_scalars_and_arrays_in_a_training_checkpoint_are_stored(cli: Cli, tmp_path: Path) -> None:
    hist = np.array([0.5, 0.25, 0.125])
    path = torch_saved(
        {"model": WEIGHTS, "epoch": np.int64(3), "best_acc": np.float64(0.9), "hist": hist, "done": np.bool_(True)},
        tmp_path / "old.pt",
    )
    cli.ok("import", path, "run")
    loaded = cli.client.load("run")
    assert loaded.extra["epoch"] == 3 and type(loaded.extra["epoch"]) is int
    assert loaded.extra["best_acc"] == 0.9 and loaded.extra["done"] is True
    assert tensors_equal(loaded.extra["hist"], torch.from_numpy(hist))
    assert loaded.metrics == {"best_acc": 0.9}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(DTYPES),
    order=st.sampled_from("<>"),
    fortran=st.booleans(),
    data=st.data(),
)
def test_any_plain_numeric_array_and_scalar_reads_back_bitwise(
    tmp_path_factory: pytest.TempPathFactory, dtype: str, order: str, fortran: bool, data: st.DataObject
) -> None:
    kind = np.dtype(dtype).newbyteorder(order) if np.dtype(dtype).itemsize > 1 else np.dtype(dtype)
    array = data.draw(hnp.arrays(kind, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)))
    if fortran:
        array = np.asfortranarray(array)
    scalar = np.asarray(data.draw(hnp.from_dtype(kind)), dtype=kind)[()]
    path = torch_saved({"model": WEIGHTS, "values": array, "scalar": scalar}, tmp_path_factory.mktemp("np") / "f.pt")
    imported = read_checkpoint(path)
    expected = torch.from_numpy(np.ascontiguousarray(array, dtype=kind.newbyteorder("=")))
    assert tensors_equal(imported.extra["values"], expected)
    wanted = scalar.item()
    if isinstance(wanted, int) and wanted >= 1 << 63:  # past what a version's JSON holds: left out, said why
        assert "does not fit in 64 bits" in imported.left_out["scalar"]
        return
    found = imported.extra["scalar"]
    assert type(found) is type(wanted)
    assert found == wanted or (isinstance(wanted, float) and math.isnan(wanted) and math.isnan(found))


class Reduced:
    """Pickles as ``func(*args)`` finished by ``BUILD`` with ``state``: a hand-made numpy value."""

    def __init__(self, func: Any, args: tuple[Any, ...], state: Any) -> None:
        self.reduced = (func, args, state)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduced


def hand_made_array(shape: tuple[int, ...], dtype: Any, raw: bytes) -> Reduced:
    """What numpy's own reduce of an array writes, with the shape, dtype and bytes given."""
    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]
    return Reduced(reconstruct, (np.ndarray, (0,), b"b"), (1, shape, dtype, False, raw))


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        (np.array([1, "a"], dtype=object), "not a plain numeric type"),
        (np.array(["ab", "c"]), "not a plain numeric type"),
        (hand_made_array((1 << 40, 1 << 40), np.dtype("f4"), b"\0" * 16), "has 16 bytes"),
        (hand_made_array((4,), np.dtype("f4"), b"\0" * 12), "has 12 bytes, not 16"),
        (hand_made_array((4,), np.dtype("f4"), "not bytes"), "something other than numbers"),
        (hand_made_array((-1,), np.dtype("f4"), b""), "non-negative integers"),
    ],
    ids=["object-dtype", "string-dtype", "huge-shape", "short-bytes", "text-for-bytes", "negative-shape"],
)
def test_hostile_numpy_values_refuse_the_file_in_one_line(cli: Cli, tmp_path: Path, value: Any, refusal: str) -> None:
    path = torch_saved({"model": WEIGHTS, "hist": value}, tmp_path / "hostile.pt")
    with pytest.raises(InvalidInputError, match=refusal):
        read_checkpoint(path)
    result = cli("import", path, "run")
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and refusal in result.stderr
    assert cli.client.runs() == []
