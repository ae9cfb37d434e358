"""A small model trained with FSDP2 on CPU gloo ranks, for the sharded checkpoint tests."""

from __future__ import annotations

from typing import Any

import torch


class Net(torch.nn.Module):
    """Three linear layers whose row counts do not divide evenly over 2 or 4 ranks (the last
    leaves one rank of four an empty shard), and a bfloat16 buffer."""

    def __init__(self, frozen_base: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(16, 34)
        self.hidden = torch.nn.Linear(34, 30)
        self.head = torch.nn.Linear(30, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3).to(torch.bfloat16))
        if frozen_base:
            for layer in (self.embed, self.hidden):
                layer.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(torch.relu(self.embed(x))))) * self.scale


def open_client(store: str) -> Any:
    """A client on a server (``store`` is its URL) or on the embedded store in folder ``store``."""
    from ckptstore import client

    return client.Client(store) if store.startswith("http") else client.Client(home=store)


def sharded(world: int, *, frozen_base: bool = False) -> tuple[Net, torch.optim.Optimizer]:
    """The model sharded over ``world`` ranks with a bf16 compute policy, and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    net = Net(frozen_base)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (net.embed, net.hidden, net.head):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    optim = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    return net, optim


def train(net: torch.nn.Module, optim: torch.optim.Optimizer, rank: int, steps: range) -> None:
    """Steps of training on batches fixed by (step, rank), so a resumed run sees the same data."""
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        inputs = torch.randn(8, 16, generator=generator)
        target = torch.randn(8, 3, generator=generator)
        loss = torch.nn.functional.mse_loss(net(inputs).float(), target)
        loss.backward()
        optim.step()
        optim.zero_grad()


def full_state(net: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer tensor gathered whole (call on every rank)."""
    from torch.distributed.tensor import DTensor

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()

    names = {id(p): name for name, p in net.named_parameters()}
    found = {f"model/{name}": whole(value) for name, value in net.state_dict().items()}
    for param, state in optim.state.items():
        for key, value in state.items():
            found[f"optim/{names[id(param)]}/{key}"] = whole(value)
    return found


def placements(optim: torch.optim.Optimizer) -> set[tuple[str, str]]:
    """(state key, device type) of every optimizer tensor's local data."""
    from torch.distributed.tensor import DTensor

    found = set()
    for state in optim.state.values():
        for key, value in state.items():
            local: Any = value.to_local() if isinstance(value, DTensor) else value
            found.add((key, local.device.type))
    return found
