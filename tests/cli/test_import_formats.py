"""``ckptstore import`` of the checkpoints users already have: torch.save files, Lightning
``.ckpt``, DCP folders and Hugging Face Trainer folders, each written by the real library, and
resumed through ``client.load`` bitwise, optimizer state included."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests.cli.conftest import Cli
from tests.client.models import TinyNet, tensors_equal
from tests.client.wrapping import assert_bitwise, state_by_name, trained


@dataclass
class TrainingConfig:
    """A user's own class inside a checkpoint: only a full unpickler could rebuild it."""

    lr: float


def _save(value: object, path: Path) -> None:
    """Write a file as a user's training script would (the store itself never pickles)."""
    torch.save(value, path)  # noqa: TID251 - making the user's file under test


@pytest.mark.parametrize("layout", ["plain", "state_dict", "model_state_dict"])
@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_torch_save_files_import_bitwise(cli: Cli, tmp_path: Path, layout: str, suffix: str) -> None:
    model, _ = trained()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    source = tmp_path / f"weights{suffix}"
    _save(state if layout == "plain" else {layout: state, "epoch": 3}, source)
    cli.ok("import", source, "run")
    fresh = TinyNet(seed=4)
    cli.client.load("run", model=fresh)
    assert_bitwise({k: v.detach() for k, v in fresh.state_dict().items()}, state)


def test_files_that_need_full_unpickling_are_refused_naming_the_type(cli: Cli, tmp_path: Path) -> None:
    source = tmp_path / "model.pt"
    _save({"state_dict": TinyNet().state_dict(), "config": TrainingConfig(lr=0.1)}, source)
    failed = cli("import", source, "run")
    assert failed.exit_code != 0
    assert "needs full unpickling" in failed.stderr and "tests.cli.test_import_formats.TrainingConfig" in failed.stderr
    assert cli.client.runs() == []


def test_a_dcp_folder_imports_with_its_optimizer(cli: Cli, tmp_path: Path) -> None:
    model, optim = trained()
    expected = state_by_name(model, optim)
    model_state, optim_state = get_state_dict(model, optim)
    folder = tmp_path / "dcp"
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder, no_dist=True)
    cli.ok("import", folder, "run")
    fresh = TinyNet(seed=8)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    cli.client.load("run", model=fresh, optim=fresh_optim)
    assert_bitwise(state_by_name(fresh, fresh_optim), expected)
    assert fresh_optim.state[fresh.embed.weight]["step"].device.type == "cpu"


def test_dcp_metadata_naming_another_global_is_refused(cli: Cli, tmp_path: Path) -> None:
    folder = tmp_path / "dcp"
    folder.mkdir()
    # A pickle whose only global is os.system: the metadata reader must refuse before calling it.
    (folder / ".metadata").write_bytes(b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.")
    failed = cli("import", folder, "run")
    assert failed.exit_code != 0 and "os.system" in failed.stderr


def test_a_lightning_ckpt_imports_its_weights(cli: Cli, tmp_path: Path) -> None:
    from tests.integrations.lightning_kit import TinyModule, loaders, trainer

    module = TinyModule()
    fit = trainer(tmp_path, epochs=1, plugins=[], callbacks=[])
    fit.fit(module, *loaders())
    path = tmp_path / "last.ckpt"
    fit.save_checkpoint(path)
    cli.ok("import", path, "run")
    fresh = TinyModule()
    cli.client.load("run", model=fresh)
    assert all(tensors_equal(fresh.state_dict()[k], v) for k, v in module.state_dict().items())
    assert cli.client.versions("run")[0].step == fit.global_step > 0


def test_a_trainer_checkpoint_folder_resumes_bitwise(cli: Cli, tmp_path: Path) -> None:
    """A folder written by transformers.Trainer: weights, optimizer.pt named by the Trainer's own
    grouping, scheduler.pt, trainer_state.json and rng_state.pth all come back."""
    import transformers

    from tests.integrations.hf_kit import Tokens, arguments, tiny_gpt2

    trainer = transformers.Trainer(
        model=tiny_gpt2(seed=0), args=arguments(tmp_path / "out", max_steps=2, save_steps=2), train_dataset=Tokens()
    )
    trainer.train()
    folder = tmp_path / "out" / "checkpoint-2"
    assert {"optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth"} <= {p.name for p in folder.iterdir()}
    cli.ok("import", folder, "gpt2")

    resumed = transformers.Trainer(model=tiny_gpt2(seed=1), args=arguments(tmp_path / "again"), train_dataset=Tokens())
    resumed.create_optimizer_and_scheduler(num_training_steps=6)
    loaded = cli.client.load("gpt2", model=resumed.model, optim=resumed.optimizer, scheduler=resumed.lr_scheduler)
    assert loaded.step == 2
    assert_bitwise(state_by_name(resumed.model, resumed.optimizer), state_by_name(trainer.model, trainer.optimizer))
    assert resumed.lr_scheduler.state_dict()["last_epoch"] == trainer.lr_scheduler.state_dict()["last_epoch"] == 2
    assert loaded.extra["trainer_state"]["global_step"] == 2
    assert tensors_equal(loaded.extra["rng_state"]["rng_state"]["cpu"], trainer_rng(folder)["cpu"])


def trainer_rng(folder: Path) -> dict[str, torch.Tensor]:
    """The RNG state as transformers reads it back."""
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():
        return torch.load(folder / "rng_state.pth", weights_only=True)  # noqa: TID251 - the file under test


def test_training_goes_on_from_an_imported_dcp_folder_as_from_dcp_load(cli: Cli, tmp_path: Path) -> None:
    """dcp.load + set_state_dict of the folder, and client.load of its import, train on bitwise alike."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from tests.client.models import train

    model, optim = trained()
    model_state, optim_state = get_state_dict(model, optim)
    folder = tmp_path / "dcp"
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder, no_dist=True)
    cli.ok("import", folder, "run")

    theirs = TinyNet(seed=8)
    their_optim = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    blank_model, blank_optim = get_state_dict(theirs, their_optim)
    dcp.load({"model": blank_model, "optim": blank_optim}, checkpoint_id=folder, no_dist=True)
    set_state_dict(theirs, their_optim, model_state_dict=blank_model, optim_state_dict=blank_optim)
    ours = TinyNet(seed=9)
    our_optim = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    cli.client.load("run", model=ours, optim=our_optim)

    for net, opt in ((theirs, their_optim), (ours, our_optim)):
        torch.manual_seed(3)  # the same dropout draws on both sides
        train(net, opt, range(3, 6))
    assert_bitwise(state_by_name(ours, our_optim), state_by_name(theirs, their_optim))
