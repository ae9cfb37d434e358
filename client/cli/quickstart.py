"""A two-minute tour: save a frozen base plus an adapter three times, then load it back."""

from __future__ import annotations

import torch
from torch import nn

from ckptstore.client.api import Client
from ckptstore.client.cli.common import echo
from ckptstore.client.cli.counts import counted
from ckptstore.client.connection import default_home

RUN_ID = "quickstart"


class AdaptedMLP(nn.Module):
    """A frozen base MLP (about 8 MiB) with a small trainable low-rank adapter."""

    def __init__(self, width: int = 1024, rank: int = 8) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU())
        self.base.requires_grad_(False)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _mib(n: int) -> str:
    return f"{n / 2**20:8.2f} MiB"


def run() -> None:
    """Run the tour on the embedded store and print what was stored."""
    torch.manual_seed(0)
    model = AdaptedMLP()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    home = default_home()
    echo(f"embedded store: {home}")
    with Client(home=home) as store:
        echo(f"{'version':>7}  {'logical':>12}  {'new bytes':>12}  {'dedup':>6}  {'seconds':>7}")
        for round_ in range(3):
            for _ in range(5):
                optim.zero_grad()
                model(torch.randn(16, 1024)).pow(2).mean().backward()
                optim.step()
            saved = store.save(RUN_ID, model, optim, step=(round_ + 1) * 5, metrics={"round": float(round_)})
            echo(
                f"{saved.version:>7}  {_mib(saved.bytes_total)}  {_mib(saved.bytes_new)}  "
                f"{saved.dedup_ratio:>6.1%}  {saved.seconds:>7.3f}"
            )
        fresh = AdaptedMLP()
        fresh_optim = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
        loaded = store.load(RUN_ID, model=fresh, optim=fresh_optim)
        same = all(
            torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
        )
        step_device = fresh_optim.state[fresh.up.weight]["step"].device
        echo(
            f"loaded version {loaded.version} (step {loaded.step}) strictly in {loaded.seconds:.3f}s: "
            f"{'identical' if same else 'DIFFERENT'} weights; Adam's step on {step_device}"
        )
        versions = store.versions(RUN_ID)
        echo(f"run {RUN_ID!r} now has {counted(len(versions), 'version')} in {home}")
    if not same:
        raise SystemExit(1)
