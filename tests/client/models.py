"""Small models, optimizers and training loops shared by the client tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class TinyNet(nn.Module):
    """Linear layers, a layer norm, dropout, a BatchNorm (integer buffer) and a tied pair."""

    def __init__(self, seed: int = 0, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(32, width)
        self.body = nn.Sequential(nn.Linear(width, width * 2), nn.GELU(), nn.Dropout(0.1), nn.Linear(width * 2, width))
        self.norm = nn.LayerNorm(width)
        self.bn = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 32, bias=False)
        self.head.weight = self.embed.weight  # tied weights appear twice in the state_dict

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.bn(self.norm(self.body(self.embed(tokens))))
        return self.head(hidden)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch for ``step`` that does not touch the global RNG."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 32, (8,), generator=generator)
    targets = torch.randint(0, 32, (8,), generator=generator)
    return tokens, targets


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range, scheduler: object = None) -> None:
    """Run ``steps`` of training with cross-entropy on deterministic batches."""
    model.train()
    for step in steps:
        tokens, targets = batch(step)
        optim.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(tokens), targets)
        loss.backward()
        optim.step()
        if scheduler is not None:
            scheduler.step()  # type: ignore[attr-defined]


OptimFactory = Callable[[nn.Module], torch.optim.Optimizer]


def prodigy(model: nn.Module) -> torch.optim.Optimizer:
    """prodigy-plus-schedule-free in training mode (keeps tensors in param_groups, bf16 state)."""
    from prodigyplus import ProdigyPlusScheduleFree

    optim = ProdigyPlusScheduleFree(model.parameters(), lr=1.0)
    optim.train()
    return optim


OPTIMIZERS: dict[str, OptimFactory] = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
    "adamw_fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True),
    "prodigy": prodigy,
}


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, dtype and shape included (NaNs with equal bits compare equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bytes_of(a), _bytes_of(b))


def state_copy(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of every model tensor and optimizer state tensor, by ``model/<name>`` and
    ``optim/<parameter name>/<state key>``."""
    state = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, values in optim.state.items():
        state.update({f"optim/{names[id(param)]}/{k}": v.clone() for k, v in values.items()})
    return state


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two :func:`state_copy` results hold the same keys and bitwise equal tensors."""
    return a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)


def trained_tiny() -> tuple[TinyNet, torch.optim.Optimizer]:
    """A TinyNet and its AdamW after two steps (every state tensor exists)."""
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    return model, optim


def loaded_tiny(ckpt: Any, version: int, run_id: str = "run") -> dict[str, torch.Tensor]:
    """:func:`state_copy` of a fresh TinyNet and AdamW loaded from ``version`` of ``run_id`` through ``ckpt``."""
    model = TinyNet(seed=7)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt.load(run_id, version, model=model, optim=optim)
    return state_copy(model, optim)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes, in row-major order, whatever its strides (size-1 dims included)."""
    values = tensor.detach().cpu().resolve_conj().resolve_neg()
    return torch.empty(values.shape, dtype=values.dtype).copy_(values).reshape(-1).view(torch.uint8)


class Adapter(nn.Module):
    """A frozen base of cacheable size (256 KiB) and a small trainable head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(256, 256)
        self.base.requires_grad_(False)
        self.head = nn.Linear(256, 8)
