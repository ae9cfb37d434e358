"""``ckptstore import`` of a Lightning ``.ckpt``: stored whole, so the version resumes through
``CkptstoreCheckpointIO`` exactly as the file resumes; what cannot be stored is reported by key,
or refuses the import when Lightning needs it to resume."""

from __future__ import annotations

import io
import json
import pickle  # noqa: TID251 - only to write the hand-made file under test
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")  # the .[lightning] extra; installed in CI

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from ckptstore.client.formats.torch_save.files import read_torch_file  # noqa: E402
from ckptstore.client.integrations.lightning import CkptstoreCheckpointIO, ResumeStateCallback  # noqa: E402
from ckptstore.service.errors import InvalidInputError  # noqa: E402
from tests.cli.conftest import Cli  # noqa: E402
from tests.cli.hostile_pickles import torch_archive, torch_saved  # noqa: E402
from tests.client.models import tensors_equal  # noqa: E402
from tests.integrations.lightning_kit import LossRecorder, TinyModule, loaders, trainer, training_state  # noqa: E402

RESUME_KEYS = {
    "optimizer_states",
    "lr_schedulers",
    "loops",
    "callbacks",
    "epoch",
    "global_step",
    "pytorch-lightning_version",
}


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal, tensors bitwise (dtype and shape included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and tensors_equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def written_ckpt(root: Path, module: pl.LightningModule | None = None, callbacks: list[Any] = ()) -> Path:
    """Two epochs with the plain Lightning trainer (no plug-in), saved to ``root/trained.ckpt``."""
    torch.manual_seed(0)
    fit = trainer(root, epochs=2, plugins=[], callbacks=[ResumeStateCallback(), *callbacks])
    fit.fit(module or TinyModule(), *loaders())
    path = root / "trained.ckpt"
    fit.save_checkpoint(path)
    return path


def resumed(root: Path, ckpt_path: str, plugins: list[Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Training continued to epoch 5 from ``ckpt_path``: the state it ends in and the losses on the way."""
    torch.manual_seed(123)  # the generators' state comes from the checkpoint, not from here
    losses = LossRecorder()
    fit = trainer(root, epochs=5, plugins=plugins, callbacks=[ResumeStateCallback(), losses])
    fit.fit(TinyModule(), *loaders(), ckpt_path=ckpt_path)
    return training_state(fit), losses.losses


def test_an_imported_ckpt_resumes_through_the_plug_in_exactly_as_the_file_does(cli: Cli, tmp_path: Path) -> None:
    # The file holds the generators' state (ResumeStateCallback wrote it), so dropout and the
    # shuffled sampler after the resume point are a function of the checkpoint alone.
    path = written_ckpt(tmp_path / "first")
    from_file, file_losses = resumed(tmp_path / "a", str(path), plugins=[])

    cli.ok("import", path, "run")
    io_plugin = CkptstoreCheckpointIO("run", client=cli.client)
    from_store, store_losses = resumed(tmp_path / "b", "ckptstore://run@latest", plugins=[io_plugin])

    assert from_file["global_step"] == from_store["global_step"] == 20
    assert len(file_losses) == len(store_losses) == 12
    assert_same(store_losses, file_losses, "losses")
    assert_same(from_store, from_file, "state")
    # The version is the whole checkpoint, as the plug-in would have saved it.
    loaded = io_plugin.load_checkpoint("ckptstore://run@1")
    assert RESUME_KEYS | {"state_dict", "hyper_parameters", "hparams_name"} <= set(loaded)
    assert loaded["hyper_parameters"] == {"width": 8, "lr": 1e-2, "scripted_val": False}


class Annotated(TinyModule):
    """A module that adds to its checkpoints a value no version can hold (a set)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["seen_ids"] = {3, 1, 2}
        checkpoint["note"] = "kept"


def test_import_json_reports_the_kept_keys_and_what_it_left_out(cli: Cli, tmp_path: Path) -> None:
    best = ModelCheckpoint(monitor="val_loss", dirpath=tmp_path / "top", save_top_k=1)
    path = written_ckpt(tmp_path, Annotated(), callbacks=[best])
    report = json.loads(cli.ok("import", path, "run", "--json"))

    assert report["left_out"] == {"seen_ids": "seen_ids: cannot store a value of type builtins.set"}
    assert set(report["extra"]) == RESUME_KEYS | {"hyper_parameters", "hparams_name", "note"}
    assert report["model_tensors"] == 4 and report["step"] == 8
    assert report["optimizer_parameters"] == 4 and report["scheduler"] is True  # Adam over 4 tensors, StepLR
    assert report["metrics"] == {"val_loss": pytest.approx(best.current_score.item())}
    version = cli.client.versions("run")[0]
    assert version.step == 8 and version.metrics == report["metrics"]
    assert cli.client.load("run").extra["note"] == "kept"

    text = cli.ok("import", path, "again")
    assert "left out: seen_ids (seen_ids: cannot store a value of type builtins.set)" in text


class SetKeeper(pl.Callback):
    """Callback state that is a set: Lightning needs it to resume, a version cannot hold it."""

    def state_dict(self) -> dict[str, Any]:
        return {"seen": {1, 2}}


def test_a_ckpt_whose_resume_state_cannot_be_stored_is_refused_naming_the_key(cli: Cli, tmp_path: Path) -> None:
    path = written_ckpt(tmp_path, callbacks=[SetKeeper()])
    failed = cli("import", path, "run")
    assert failed.exit_code == 2
    assert "'callbacks' cannot be stored" in failed.stderr and "SetKeeper" in failed.stderr
    assert "builtins.set" in failed.stderr and "Lightning needs it to resume" in failed.stderr
    assert cli.client.runs() == []


def test_tensors_of_the_dtypes_torch_writes_untyped_read_bitwise(tmp_path: Path) -> None:
    # ResumeStateCallback's NumPy key is a uint32 tensor, which torch.save writes with
    # _rebuild_tensor_v3 over an untyped storage; uint16/64 and float8 take the same path.
    saved = {
        "u32": torch.tensor([1, 2**31 + 5, 7], dtype=torch.uint32)[1:],
        "u16": torch.arange(6).to(torch.uint16).reshape(2, 3).t(),
        "u64": torch.tensor([2**63 + 9], dtype=torch.uint64),
        "f8": torch.randn(5, generator=torch.Generator().manual_seed(0)).to(torch.float8_e4m3fn),
        "f32": torch.randn(3),
    }
    loaded = read_torch_file(torch_saved(saved, tmp_path / "x.pt"))
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert tensors_equal(loaded[name], tensor), name
        assert loaded[name].stride() == tensor.stride(), name


class _Untyped:
    def __init__(self, key: str, nbytes: int) -> None:
        self.key, self.nbytes = key, nbytes


class _V3:
    """A ``_rebuild_tensor_v3`` call as torch writes one, with the arguments the test chooses."""

    def __init__(self, storage: _Untyped, offset: int, size: tuple[int, ...], dtype: Any) -> None:
        self.storage, self.offset, self.size, self.dtype = storage, offset, size, dtype

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        stride = (1,) * len(self.size)
        return torch._utils._rebuild_tensor_v3, (self.storage, self.offset, self.size, stride, False, {}, self.dtype)


class _Pickler(pickle.Pickler):  # noqa: TID251 - making the hand-made file under test
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Untyped):
            return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.nbytes)
        return None


def v3_file(path: Path, value: Any, nbytes: int) -> Path:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(value)
    return torch_archive(path, buffer.getvalue(), {"0": bytes(range(nbytes))})


@pytest.mark.parametrize(
    ("offset", "size", "dtype", "says"),
    [
        (1, (2,), torch.uint32, "reaches element 3 of a storage of 2 elements"),  # 8 bytes: two uint32
        (0, (3,), torch.uint32, "reaches element 3 of a storage of 2 elements"),
        (0, (2,), "float32", "not one ckptstore reads"),
    ],
)
def test_an_untyped_storage_tensor_past_its_bytes_or_of_no_dtype_is_refused(
    tmp_path: Path, offset: int, size: tuple[int, ...], dtype: Any, says: str
) -> None:
    path = v3_file(tmp_path / "x.pt", {"w": _V3(_Untyped("0", 8), offset, size, dtype)}, 8)
    try:
        loaded = read_torch_file(path)
    except InvalidInputError as exc:
        assert says in str(exc)
    else:
        assert says in loaded["w"].reason


def test_an_untyped_storage_tensor_reads_its_bytes_as_its_dtype(tmp_path: Path) -> None:
    path = v3_file(tmp_path / "x.pt", {"w": _V3(_Untyped("0", 9), 1, (1,), torch.uint32)}, 9)
    with zipfile.ZipFile(path) as archive:
        assert archive.read("archive/data/0") == bytes(range(9))
    (value,) = read_torch_file(path)["w"].tolist()
    assert value == int.from_bytes(bytes(range(4, 8)), "little")  # element 1: bytes 4-7; byte 8 is no element
