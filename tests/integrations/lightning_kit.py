"""A tiny LightningModule, its data and a trainer factory for the Lightning plug-in tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: The validation score each epoch reports, so top-k keeps a known set (epochs 3 and 1).
VAL_SCORES = [3.0, 1.0, 2.0, 0.5, 4.0]


class TinyModule(pl.LightningModule):
    """Two linear layers with dropout (so resumes depend on the RNG), Adam and a step schedule."""

    def __init__(self, width: int = 8, lr: float = 1e-2, scripted_val: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.hparams["scripted_val"]:
            loss = torch.tensor(VAL_SCORES[self.current_epoch % len(VAL_SCORES)])
        self.log("val_loss", loss)

    def configure_optimizers(self) -> Any:
        optim = torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
        return {"optimizer": optim, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)}


def loaders() -> tuple[DataLoader, DataLoader]:
    """Shuffled training data (the sampler draws from torch's RNG) and fixed validation data."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    return train, DataLoader(TensorDataset(x[:8], y[:8]), batch_size=8)


def trainer(root: Path, *, epochs: int, plugins: list[Any], callbacks: list[Any]) -> pl.Trainer:
    """A quiet CPU trainer writing nothing but what its plug-ins and callbacks write."""
    return pl.Trainer(
        default_root_dir=root,
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
        plugins=plugins,
        callbacks=callbacks,
    )


class LossRecorder(pl.Callback):
    """Keeps the loss of every training step, as the step returned it."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].detach().clone())


def training_state(fit: pl.Trainer) -> dict[str, Any]:
    """What a resumed run must match bitwise: weights, optimizer state, scheduler state, step."""
    module = fit.lightning_module
    return {
        "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "optimizer": fit.optimizers[0].state_dict()["state"],
        "scheduler": fit.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": fit.global_step,
    }
