"""Canonical names with the wrappers that need a process group, on 2 real gloo ranks: DDP around
torch.compile (and the reverse direction), FSDP2 with activation checkpointing, FSDP1; every
round trip bitwise, optimizer state included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import client
from tests.client.models import TinyNet
from tests.client.wrapping import assert_bitwise, checkpointed, compiled, state_by_name, trained
from tests.distributed.fsdp_model import Net, open_client, train
from tests.distributed.ranks import run_ranks

pytestmark = pytest.mark.slow  # spawns gloo ranks (about 15 s)


def _gathered(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``state_by_name`` with every DTensor gathered whole (call on every rank)."""
    from torch.distributed.tensor import DTensor

    found = state_by_name(model, optim)
    return {k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone() for k, v in found.items()}


def _fsdp2_checkpointed(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    net = checkpointed(Net())
    for layer in (net.embed, net.hidden, net.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def _ranks(rank: int, world: int, home: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    from ckptstore.client import names

    store = open_client(home)
    answers: dict[str, Any] = {}

    # DDP(torch.compile(m)) saved on rank 0; the plain version saved by the test loads into it on every rank.
    model, optim = trained()
    wrapped = DistributedDataParallel(compiled(model))  # a collective: on every rank
    if rank == 0:
        answers["ddp_saved"] = store.save("ddp", wrapped, optim).version
        answers["ddp_state"] = state_by_name(model, optim)  # this process's training: threads may round apart
    target = DistributedDataParallel(compiled(TinyNet(seed=5)))
    target_optim = torch.optim.AdamW(target.parameters(), lr=1e-2)
    store.load("plain", model=target, optim=target_optim)
    answers["ddp_loaded"] = state_by_name(target, target_optim)

    # FSDP2 over activation-checkpointed layers: get_state_dict's FQNs are the canonical names.
    net, net_optim = _fsdp2_checkpointed(world)
    train(net, net_optim, rank, range(2))
    model_state, optim_state = get_state_dict(net, net_optim)
    answers["fsdp2_names_agree"] = set(model_state) == set(names.state_dict(net)) and set(optim_state["state"]) == set(
        names.parameters(net)
    )
    store.save("fsdp2", net, net_optim)
    answers["fsdp2_saved"] = _gathered(net, net_optim)
    fresh, fresh_optim = _fsdp2_checkpointed(world)
    store.load("net-plain", model=fresh, optim=fresh_optim)
    answers["fsdp2_loaded"] = _gathered(fresh, fresh_optim)

    # FSDP1 (a wrapper module): its full state_dict and its wrapped parameter names unwrap alike.
    fsdp1 = FullyShardedDataParallel(Net(), device_id=torch.device("cpu"), use_orig_params=True)
    answers["fsdp1_paths"] = sorted(names.wrapper_paths(fsdp1))
    answers["fsdp1_names"] = sorted(names.state_dict(fsdp1))
    answers["fsdp1_params"] = sorted(names.parameters(fsdp1))
    dist.barrier()
    return answers


def test_wrapped_and_sharded_models_cross_load(tmp_path: Path) -> None:
    home = tmp_path / "store"
    with client.Client(home=home) as ckpt:
        model, optim = trained()
        plain = state_by_name(model, optim)
        ckpt.save("plain", model, optim)
        net = Net()
        net_optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
        train(net, net_optim, 0, range(2))
        net_plain = state_by_name(net, net_optim)
        ckpt.save("net-plain", net, net_optim)

    answers = run_ranks(2, tmp_path, _ranks, str(home))

    with client.Client(home=home) as ckpt:
        # DDP(compile(m)) -> plain m, strictly, optimizer included
        assert answers[0]["ddp_saved"] == 1
        fresh = TinyNet(seed=3)
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        ckpt.load("ddp", model=fresh, optim=fresh_optim)
        assert_bitwise(state_by_name(fresh, fresh_optim), answers[0]["ddp_state"])
        # FSDP2 + checkpointing -> plain Net
        net = Net()
        net_optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
        ckpt.load("fsdp2", model=net, optim=net_optim)
        assert_bitwise(state_by_name(net, net_optim), answers[0]["fsdp2_saved"])
    for rank in range(2):
        assert_bitwise(answers[rank]["ddp_loaded"], plain)  # plain m -> DDP(compile(m))
        assert answers[rank]["fsdp2_names_agree"]
        assert_bitwise(answers[rank]["fsdp2_loaded"], net_plain)  # plain Net -> FSDP2 + checkpointing
        assert answers[rank]["fsdp1_paths"] == ["_fsdp_wrapped_module"]
        assert answers[rank]["fsdp1_names"] == sorted(Net().state_dict())
        assert answers[rank]["fsdp1_params"] == sorted(dict(Net().named_parameters()))
