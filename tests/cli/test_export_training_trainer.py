"""``ckptstore export --format trainer``: a Hugging Face Trainer ``checkpoint-N`` folder that
``trainer.train(resume_from_checkpoint=folder)`` resumes from bit for bit, as from the folder the version
came from (or as the plug-in's own resume), every file readable with ``torch.load(weights_only=True)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the .[transformers] extra; installed in CI

from transformers.trainer_utils import set_seed  # noqa: E402

from ckptstore.client.integrations.transformers import CkptstoreCallback  # noqa: E402
from tests.cli.conftest import Cli  # noqa: E402
from tests.cli.test_import_trainer import assert_same_run, continuing  # noqa: E402
from tests.client.test_lora import lora_llama  # noqa: E402
from tests.integrations.hf_kit import Tokens, arguments, checkpoint_folder, losses, tiny_gpt2  # noqa: E402

WRITTEN = ["config.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The uninterrupted run (6 steps) and its ``checkpoint-3`` folder."""
    return checkpoint_folder(tmp_path_factory.mktemp("trainer") / "out")


def test_an_imported_trainer_folder_exported_again_resumes_as_the_original(
    cli: Cli, tmp_path: Path, trained: tuple[Any, Path]
) -> None:
    full, folder = trained
    from_folder = continuing(tmp_path / "a")
    from_folder.train(resume_from_checkpoint=str(folder))

    cli.ok("import", folder, "run")
    out = tmp_path / "exported" / "checkpoint-3"
    assert "as trainer" in cli.ok("export", "run", out, "--format", "trainer")
    kept = [name for name in ("generation_config.json",) if (folder / name).exists()]  # where the import kept it
    assert sorted(p.name for p in out.iterdir()) == sorted(WRITTEN + kept)
    for name in ("optimizer.pt", "scheduler.pt"):
        torch.load(out / name, weights_only=True)  # noqa: TID251 - reading the file as its tool does
    from_export = continuing(tmp_path / "b")
    from_export.train(resume_from_checkpoint=str(out))

    assert from_export.state.global_step == 6
    assert [step for step, _ in losses(from_export)] == [1, 2, 3, 4, 5, 6]
    assert_same_run(from_export, from_folder)
    assert_same_run(from_export, full)


def test_a_plug_in_version_exports_as_a_folder_the_trainer_resumes(cli: Cli, tmp_path: Path) -> None:
    set_seed(0)
    callback = CkptstoreCallback("plug", client=cli.client)
    args = arguments(tmp_path / "first")
    full = transformers.Trainer(model=tiny_gpt2(seed=0), args=args, train_dataset=Tokens(), callbacks=[callback])
    full.train()
    first = cli.client.versions("plug")[0].version  # the version at step 3
    out = tmp_path / "checkpoint-3"
    cli.ok("export", f"plug@{first}", out, "--format", "trainer")
    assert sorted(p.name for p in out.iterdir() if p.name != "generation_config.json") == WRITTEN  # that one if kept
    from_export = continuing(tmp_path / "b")
    from_export.train(resume_from_checkpoint=str(out))
    assert from_export.state.global_step == 6
    assert_same_run(from_export, full)


def test_a_version_without_a_trainer_state_is_refused_in_one_line(cli: Cli, tmp_path: Path) -> None:
    cli.client.save("plain", torch.nn.Linear(2, 2))
    result = cli("export", "plain", tmp_path / "out", "--format", "trainer")
    assert result.exit_code != 0
    assert "holds no TrainerState" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_peft_plug_in_version_exports_the_adapter_the_trainer_resumes(cli: Cli, tmp_path: Path) -> None:
    set_seed(0)
    args = arguments(tmp_path / "first")
    callbacks = [CkptstoreCallback("lora", client=cli.client)]
    full = transformers.Trainer(model=lora_llama(seed=0), args=args, train_dataset=Tokens(), callbacks=callbacks)
    full.train()
    out = tmp_path / "checkpoint-3"
    cli.ok("export", f"lora@{cli.client.versions('lora')[0].version}", out, "--format", "trainer")
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt",
        "trainer_state.json",
    ]  # fmt: skip
    model = lora_llama(seed=0)  # the same base (the folder holds the adapter only), the adapter drawn anew
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_()
    resumed = transformers.Trainer(model=model, args=arguments(tmp_path / "b"), train_dataset=Tokens())
    resumed.train(resume_from_checkpoint=str(out))
    assert resumed.state.global_step == 6
    assert_same_run(resumed, full)
