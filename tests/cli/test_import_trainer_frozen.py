"""A Trainer ``checkpoint-N`` folder of a model with frozen parameters imports and resumes bit for bit:
the Trainer's optimizer holds only the parameters that require grad (in its decay and no-decay
groups), and the import keeps its state by position for the optimizer the resumed Trainer builds
the same way, never by the model's own grouping of every parameter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")  # the .[transformers] extra; installed in CI

from ckptstore.client.integrations.transformers import resume  # noqa: E402
from tests.cli.conftest import Cli  # noqa: E402
from tests.cli.test_import_trainer import assert_same_run  # noqa: E402
from tests.integrations.hf_kit import Tokens, arguments, losses, tiny_gpt2  # noqa: E402

#: Frozen: the position embeddings and the first block (its LayerNorms hold no-decay parameters).
FROZEN = ("transformer.wpe.", "transformer.h.0.")


def partly_frozen(seed: int) -> Any:
    model = tiny_gpt2(seed)
    for name, param in model.named_parameters():
        if name.startswith(FROZEN):
            param.requires_grad_(False)
    return model


def trainer(output: Path, seed: int) -> Any:
    return transformers.Trainer(model=partly_frozen(seed), args=arguments(output), train_dataset=Tokens())


def test_a_trainer_folder_with_frozen_parameters_resumes_as_the_trainer_resumes_it(cli: Cli, tmp_path: Path) -> None:
    full = trainer(tmp_path / "full", seed=0)
    full.train()
    model = full.model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    decay = set(full.get_decay_parameter_names(model))
    groups = [len(g["params"]) for g in full.optimizer.param_groups]
    assert groups == [len([n for n in trainable if n in decay]), len([n for n in trainable if n not in decay])]
    assert sum(groups) < len(list(model.parameters()))  # the frozen ones are in no group
    folder = tmp_path / "full" / "checkpoint-3"

    by_transformers = trainer(tmp_path / "a", seed=7)
    by_transformers.train(resume_from_checkpoint=str(folder))
    cli.ok("import", folder, "frozen")
    by_store = trainer(tmp_path / "b", seed=7)
    resume(by_store, "frozen", client=cli.client)

    assert [step for step, _ in losses(by_store)] == [1, 2, 3, 4, 5, 6]
    assert_same_run(by_store, by_transformers)
    assert_same_run(by_store, full)
