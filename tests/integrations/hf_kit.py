"""Tiny causal language models built from configs (nothing downloaded), data and Trainer setup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = 64


def tiny_gpt2(seed: int) -> transformers.GPT2LMHeadModel:
    """A 2-layer GPT-2 of width 32 with dropout, so a resume depends on the RNG."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
    )
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Deterministic random token sequences, labels equal to inputs."""

    def __init__(self, count: int = 24, length: int = 8) -> None:
        generator = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, VOCAB, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def arguments(output: Path, **overrides: Any) -> transformers.TrainingArguments:
    """CPU training of a few steps, saving every 3, logging every step, reporting nowhere."""
    settings: dict[str, Any] = {
        "output_dir": str(output),
        "max_steps": 6,
        "save_steps": 3,
        "logging_steps": 1,
        "per_device_train_batch_size": 2,
        "learning_rate": 5e-3,
        "lr_scheduler_type": "linear",
        "warmup_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
    }
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def losses(trainer: transformers.Trainer) -> list[tuple[int, float]]:
    """The training losses the Trainer logged, by step."""
    return [(int(entry["step"]), entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's state_dict flattened to ``index/name`` -> value (tensors and numbers), and its groups."""
    state = optimizer.state_dict()
    flat: dict[str, Any] = {
        f"{index}/{name}": value for index, s in state["state"].items() for name, value in s.items()
    }
    flat["param_groups"] = state["param_groups"]
    return flat


def checkpoint_folder(output: Path, **overrides: Any) -> tuple[transformers.Trainer, Path]:
    """A tiny GPT-2 trained by the Trainer to ``output`` (6 steps, folders at 3 and 6); the trainer
    and its ``checkpoint-3`` folder, as ``Trainer`` wrote them."""
    trainer = transformers.Trainer(model=tiny_gpt2(seed=0), args=arguments(output, **overrides), train_dataset=Tokens())
    trainer.train()
    return trainer, output / "checkpoint-3"
