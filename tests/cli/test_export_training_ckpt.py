"""``ckptstore export --format ckpt``: a Lightning ``.ckpt`` that ``Trainer.fit(ckpt_path=...)`` resumes
from bit for bit, as from the file the version came from; and a version ``client.save`` stored written
in Lightning's layout from its parts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")  # the .[lightning] extra; installed in CI

from ckptstore.client.integrations.lightning import CkptstoreCheckpointIO, ResumeStateCallback  # noqa: E402
from tests.cli.conftest import Cli  # noqa: E402
from tests.cli.test_import_lightning import assert_same, resumed, written_ckpt  # noqa: E402
from tests.integrations.lightning_kit import TinyModule, loaders, trainer  # noqa: E402


def test_an_imported_ckpt_exported_again_resumes_as_the_original_file(cli: Cli, tmp_path: Path) -> None:
    path = written_ckpt(tmp_path / "first")
    from_file, file_losses = resumed(tmp_path / "a", str(path), plugins=[])

    cli.ok("import", path, "run")
    out = tmp_path / "exported" / "again.ckpt"
    assert "as ckpt" in cli.ok("export", "run", out, "--format", "ckpt")
    from_export, export_losses = resumed(tmp_path / "b", str(out), plugins=[])

    assert from_file["global_step"] == from_export["global_step"] == 20
    assert len(export_losses) == 12
    assert_same(export_losses, file_losses, "losses")
    assert_same(from_export, from_file, "state")
    original = torch.load(path, weights_only=False)  # noqa: TID251 - Lightning's own file, written above
    exported = torch.load(out, weights_only=True)  # noqa: TID251 - reading the file as its tool does
    assert set(exported) == set(original)
    assert_same(exported["state_dict"], original["state_dict"], "state_dict")
    assert_same(exported["optimizer_states"], original["optimizer_states"], "optimizer_states")
    assert exported["loops"] == original["loops"]
    assert exported["hyper_parameters"] == dict(original["hyper_parameters"])


def test_a_plug_in_version_exports_as_a_ckpt_lightning_resumes(cli: Cli, tmp_path: Path) -> None:
    torch.manual_seed(0)
    io_plugin = CkptstoreCheckpointIO("run", client=cli.client)
    fit = trainer(tmp_path / "first", epochs=2, plugins=[io_plugin], callbacks=[ResumeStateCallback()])
    fit.fit(TinyModule(), *loaders())
    fit.save_checkpoint("ckptstore://run@trained")
    from_store, store_losses = resumed(tmp_path / "a", "ckptstore://run@trained", plugins=[io_plugin])

    cli.ok("export", "run@trained", tmp_path / "trained.ckpt", "--format", "ckpt")
    from_export, export_losses = resumed(tmp_path / "b", str(tmp_path / "trained.ckpt"), plugins=[])
    assert from_export["global_step"] == 20
    assert_same(export_losses, store_losses, "losses")
    assert_same(from_export, from_store, "state")


def test_a_saved_version_is_written_in_lightnings_layout(cli: Cli, tmp_path: Path) -> None:
    module = TinyModule()
    optim = torch.optim.Adam(module.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    module.net(torch.randn(2, 4)).sum().backward()
    optim.step()
    sched.step()
    cli.client.save("saved", module, optim, scheduler=sched, step=7, extra={"epoch": 1})
    cli.ok("export", "saved", tmp_path / "saved.ckpt", "--format", "ckpt")
    checkpoint = torch.load(tmp_path / "saved.ckpt", weights_only=True)  # noqa: TID251 - reading the file as its tool does
    assert (checkpoint["epoch"], checkpoint["global_step"]) == (1, 7)
    assert checkpoint["pytorch-lightning_version"] == pl.__version__
    assert_same(checkpoint["state_dict"], dict(module.state_dict()), "state_dict")
    assert_same(checkpoint["optimizer_states"], [optim.state_dict()], "optimizer_states")
    assert checkpoint["lr_schedulers"] == [sched.state_dict()]
    # Lightning loads it: weights, optimizer and scheduler (its loops start again, as documented)
    fresh = TinyModule()
    fit = trainer(tmp_path / "fit", epochs=2, plugins=[], callbacks=[])
    fit.fit(fresh, *loaders(), ckpt_path=str(tmp_path / "saved.ckpt"))
    assert fit.current_epoch == 2
