"""Resume fidelity: K steps, save, K steps equals save, load into fresh objects, K steps — bitwise."""

from __future__ import annotations

import pytest
import torch

from ckptstore import client
from tests.client.models import OPTIMIZERS, TinyNet, tensors_equal, train

K = 4


def make_scheduler(optim: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=0.05, total_steps=4 * K)


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum", "adamw_fused", "prodigy"])
def test_resume_is_bitwise_identical(ckpt: client.Client, name: str) -> None:
    model = TinyNet(seed=0)
    optim = OPTIMIZERS[name](model)
    scheduler = make_scheduler(optim) if name != "prodigy" else None
    torch.manual_seed(123)
    train(model, optim, range(K), scheduler)
    ckpt.save(
        "resume",
        model,
        optim,
        scheduler=scheduler,
        extra={"rng": torch.get_rng_state(), "epoch": 1},
        step=K,
    )
    train(model, optim, range(K, 2 * K), scheduler)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = TinyNet(seed=99)
    fresh_optim = OPTIMIZERS[name](fresh)
    fresh_scheduler = make_scheduler(fresh_optim) if name != "prodigy" else None
    assert not all(tensors_equal(fresh.state_dict()[k], v) for k, v in expected.items())
    torch.manual_seed(999)  # a different RNG stream, restored from the checkpoint below
    result = ckpt.load("resume", model=fresh, optim=fresh_optim, scheduler=fresh_scheduler)
    torch.set_rng_state(result.extra["rng"])
    assert result.step == K and result.extra["epoch"] == 1
    train(fresh, fresh_optim, range(K, 2 * K), fresh_scheduler)

    for key, value in expected.items():
        assert tensors_equal(fresh.state_dict()[key], value), f"{name}: {key} differs after resume"
    if fresh_scheduler is not None:
        assert fresh_scheduler.state_dict() == scheduler.state_dict()


def test_param_groups_and_hyperparameters_round_trip(ckpt: client.Client) -> None:
    model = TinyNet()
    optim = torch.optim.AdamW(
        [
            {"params": list(model.body.parameters()), "lr": 1e-3, "betas": (0.8, 0.95)},
            {"params": [p for n, p in model.named_parameters() if not n.startswith("body.")], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    train(model, optim, range(2))
    ckpt.save("groups", model, optim)
    fresh = TinyNet(seed=5)
    # Parameters passed in another order inside each group: state is keyed by name, not index.
    fresh_optim = torch.optim.AdamW(
        [
            {"params": list(reversed(list(fresh.body.parameters()))), "lr": 5.0},
            {"params": [p for n, p in fresh.named_parameters() if not n.startswith("body.")]},
        ]
    )
    ckpt.load("groups", model=fresh, optim=fresh_optim)
    saved, loaded = optim.state_dict(), fresh_optim.state_dict()
    for group_saved, group_loaded in zip(saved["param_groups"], loaded["param_groups"], strict=True):
        assert {k: v for k, v in group_saved.items() if k != "params"} == {
            k: v for k, v in group_loaded.items() if k != "params"
        }
    assert isinstance(loaded["param_groups"][0]["betas"], tuple)
    names = {id(p): n for n, p in model.named_parameters()}
    fresh_params = dict(fresh.named_parameters())
    for param, state in optim.state.items():
        other = fresh_optim.state[fresh_params[names[id(param)]]]
        for key, value in state.items():
            assert tensors_equal(other[key], value), (names[id(param)], key)


def test_loaded_optimizer_tensors_never_share_memory(ckpt: client.Client) -> None:
    model = TinyNet()
    optim = OPTIMIZERS["adamw"](model)
    train(model, optim, range(2))  # every param's step is the same value: equal digests
    ckpt.save("alias", model, optim)
    fresh = TinyNet(seed=8)
    fresh_optim = OPTIMIZERS["adamw"](fresh)
    ckpt.load("alias", model=fresh, optim=fresh_optim)
    tensors = [v for s in fresh_optim.state.values() for v in s.values() if torch.is_tensor(v)]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False)), "aliased state"
