"""A Hugging Face Trainer ``checkpoint-N`` folder imported with ``ckptstore import`` resumes through
``resume()`` exactly as ``trainer.train(resume_from_checkpoint=folder)`` would, keeps its
``config.json`` for ``ckptstore export``, and a version without RNG state is refused before
anything loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the .[transformers] extra; installed in CI

from ckptstore import client  # noqa: E402
from ckptstore.client.integrations.transformers import resume  # noqa: E402
from tests.cli.conftest import Cli  # noqa: E402
from tests.client.models import tensors_equal  # noqa: E402
from tests.integrations.hf_kit import (  # noqa: E402
    Tokens,
    arguments,
    checkpoint_folder,
    losses,
    optimizer_tensors,
    tiny_gpt2,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The uninterrupted run (6 steps) and its ``checkpoint-3`` folder."""
    return checkpoint_folder(tmp_path_factory.mktemp("trainer") / "out")


def continuing(output: Path) -> Any:
    """A fresh Trainer with the same arguments and data, on weights of another seed."""
    return transformers.Trainer(model=tiny_gpt2(seed=7), args=arguments(output), train_dataset=Tokens())


def assert_same_run(found: Any, expected: Any) -> None:
    """Weights, optimizer state, scheduler state and logged losses, bitwise."""
    weights = found.model.state_dict()
    for key, value in expected.model.state_dict().items():
        assert tensors_equal(weights[key], value), f"{key} differs"
    optimizer, wanted = optimizer_tensors(found.optimizer), optimizer_tensors(expected.optimizer)
    assert optimizer.keys() == wanted.keys()
    for key, value in wanted.items():
        same = tensors_equal(optimizer[key], value) if isinstance(value, torch.Tensor) else optimizer[key] == value
        assert same, f"optimizer {key} differs"
    assert found.lr_scheduler.state_dict() == expected.lr_scheduler.state_dict()
    assert losses(found) == losses(expected)


def test_an_imported_trainer_folder_resumes_as_the_trainer_resumes_it(
    cli: Cli, tmp_path: Path, trained: tuple[Any, Path]
) -> None:
    full, folder = trained
    by_transformers = continuing(tmp_path / "a")
    by_transformers.train(resume_from_checkpoint=str(folder))

    cli.ok("import", folder, "run")
    by_store = continuing(tmp_path / "b")
    assert not tensors_equal(by_store.model.state_dict()["lm_head.weight"], full.model.state_dict()["lm_head.weight"])
    resume(by_store, "run", client=cli.client)

    assert by_store.state.global_step == by_transformers.state.global_step == 6
    assert [step for step, _ in losses(by_store)] == [1, 2, 3, 4, 5, 6]
    assert_same_run(by_store, by_transformers)
    assert_same_run(by_store, full)  # and both continue the uninterrupted run


@pytest.mark.parametrize("rng_files", [[], ["rng_state_0.pth", "rng_state_1.pth"]], ids=["none", "per-process"])
def test_a_version_without_this_processs_rng_state_is_refused_before_loading(
    cli: Cli, tmp_path: Path, trained: tuple[Any, Path], rng_files: list[str]
) -> None:
    _, folder = trained
    copy = tmp_path / "checkpoint-3"
    shutil.copytree(folder, copy)
    for name in rng_files:
        shutil.copy(copy / "rng_state.pth", copy / name)
    (copy / "rng_state.pth").unlink()
    cli.ok("import", copy, "run")

    trainer = continuing(tmp_path / "out")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    expected = "rng_state.pth" if rng_files else "no random number generator state"
    with pytest.raises(client.StateMismatchError, match=expected) as refused:
        resume(trainer, "run", client=cli.client)
    assert "\n" not in str(refused.value)
    assert trainer.state.global_step == 0 and trainer.optimizer is None
    assert all(tensors_equal(trainer.model.state_dict()[k], v) for k, v in before.items()), "weights were loaded"


def test_an_imported_trainer_folder_exports_a_folder_from_pretrained_loads(
    cli: Cli, tmp_path: Path, trained: tuple[Any, Path]
) -> None:
    _, folder = trained
    cli.ok("import", folder, "run")
    out = tmp_path / "export"
    text = cli.ok("export", "run", out)
    assert "config.json" in text
    assert json.loads((out / "config.json").read_text()) == json.loads((folder / "config.json").read_text())

    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    original = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(exported) is type(original) is transformers.GPT2LMHeadModel
    found, expected = exported.state_dict(), original.state_dict()
    assert found.keys() == expected.keys()
    assert all(tensors_equal(found[k], v) for k, v in expected.items())
