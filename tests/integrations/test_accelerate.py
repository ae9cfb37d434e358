"""Accelerate through save_state / load_state: bit-exact resume (AdamW with a scheduler, and
Prodigy keeping tensors in param_groups, and over epochs with gradient accumulation, the
version's step counting optimizer updates), placement on an accelerator (meta), refusals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")  # the .[accelerate] extra; installed in CI

from ckptstore import client  # noqa: E402
from ckptstore.client.integrations.accelerate import load_state, save_state  # noqa: E402
from tests.client.models import tensors_equal  # noqa: E402

META = torch.device("meta")
N, K = 8, 4


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Counter:
    """An object registered for checkpointing, as accelerate expects: state_dict / load_state_dict."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


def adamw(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return optim, torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=0.05, total_steps=N)


def prodigy(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    from prodigyplus import ProdigyPlusScheduleFree

    optim = ProdigyPlusScheduleFree(model.parameters(), lr=1.0)
    optim.train()
    return optim, None


Factory = Callable[[nn.Module], tuple[torch.optim.Optimizer, Any]]


def prepared(seed: int, factory: Factory, **accelerator_options: Any) -> tuple[Any, nn.Module, Any, Any, Counter]:
    accelerator = accelerate.Accelerator(cpu=True, **accelerator_options)
    model = Net(seed)
    optim, scheduler = factory(model)
    if scheduler is None:
        model, optim = accelerator.prepare(model, optim)
    else:
        model, optim, scheduler = accelerator.prepare(model, optim, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optim, scheduler, counter


def run(accelerator: Any, model: nn.Module, optim: Any, scheduler: Any, counter: Counter, steps: range) -> None:
    model.train()
    for _ in steps:
        x = torch.randn(8, 6)  # drawn from the global RNG, as dropout is
        optim.zero_grad()
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        accelerator.backward(loss)
        optim.step()
        if scheduler is not None:
            scheduler.step()
        counter.seen += 1


@pytest.mark.parametrize("factory", [adamw, prodigy], ids=["adamw-onecycle", "prodigy"])
def test_resume_is_bitwise_identical(ckpt: client.Client, factory: Factory) -> None:
    objects = prepared(0, factory)
    torch.manual_seed(1)
    run(*objects, range(K))
    result = save_state(objects[0], "acc", client=ckpt)
    assert result is not None and result.version == 1
    run(*objects, range(K, N))

    fresh = prepared(5, factory)
    torch.manual_seed(77)  # a different stream: load_state puts the saved one back
    loaded = load_state(fresh[0], "acc", client=ckpt)
    assert loaded.step == K and fresh[4].seen == K  # the optimizer updates made
    run(*fresh, range(K, N))

    for key, value in objects[1].state_dict().items():
        assert tensors_equal(fresh[1].state_dict()[key], value), f"{key} differs after resume"
    expected_groups = objects[2].optimizer.param_groups
    for group, expected in zip(fresh[2].optimizer.param_groups, expected_groups, strict=True):
        for name, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert tensors_equal(group[name], value), name
    if objects[3] is not None:
        assert fresh[3].scheduler.state_dict() == objects[3].scheduler.state_dict()


def test_prodigy_state_lands_on_the_accelerator_with_its_dtypes(store: client.Client) -> None:
    """Story 3 through Accelerate: Prodigy keeps tensors in param_groups and bf16 state. With meta
    standing in for the accelerator, every one of them must reach it, bf16 staying bf16."""
    objects = prepared(0, prodigy)
    run(*objects, range(3))
    save_state(objects[0], "prodigy", client=store)
    saved = objects[2].optimizer.state_dict()
    assert any(v.dtype == torch.bfloat16 for s in saved["state"].values() for v in s.values() if torch.is_tensor(v))

    accelerator = accelerate.Accelerator(cpu=True, device_placement=False)
    model = Net(9).to("meta")
    optim, _ = prodigy(model)
    model, optim = accelerator.prepare(model, optim)
    accelerator.register_for_checkpointing(Counter())
    load_state(accelerator, "prodigy", client=store)

    group = optim.optimizer.param_groups[0]
    for name in ("running_d_numerator", "running_d_denom"):
        assert group[name].device == META, f"{name} left on {group[name].device}"
    for param, original in zip(group["params"], saved["state"].values(), strict=True):
        state = optim.optimizer.state[param]
        for key, value in original.items():
            if torch.is_tensor(value):
                assert state[key].device == META and state[key].dtype == value.dtype, key


def test_several_models_are_stored_by_index_and_a_mismatch_is_refused(store: client.Client) -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    first, second = Net(0), Net(1)
    optim = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1, momentum=0.9)
    first, second, optim = accelerator.prepare(first, second, optim)
    x = torch.randn(4, 6)
    accelerator.backward((first(x) + second(x)).sum())
    optim.step()
    save_state(accelerator, "two", client=store, metrics={"loss": 1.5})
    keys = {e.key for e in store.transport.manifest("two").tensors}
    assert "model/0.body.0.weight" in keys and "model/1.body.3.bias" in keys
    assert "optim/state/1.body.0.weight/momentum_buffer" in keys
    assert store.versions("two")[0].metrics == {"loss": 1.5}

    other = accelerate.Accelerator(cpu=True)
    other.prepare(Net(2))
    with pytest.raises(client.StateMismatchError, match="missing keys"):
        load_state(other, "two", client=store)

    two_optimizers = accelerate.Accelerator(cpu=True)
    model = Net(3)
    two_optimizers.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters()))
    with pytest.raises(client.InvalidInputError, match="2 optimizers"):
        save_state(two_optimizers, "two", client=store)


def epochs(seed: int) -> tuple[Any, nn.Module, Any, Any]:
    """An accelerator accumulating gradients over 2 batches, on a loader of 5 batches: 3 optimizer
    updates an epoch (the last batch of an epoch always updates)."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = Net(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(10, 6, generator=torch.Generator().manual_seed(3)))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    return accelerator, *accelerator.prepare(model, optim, loader)


def train_epoch(accelerator: Any, model: nn.Module, optim: Any, loader: Any) -> None:
    model.train()
    for (x,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)))
            optim.step()
            optim.zero_grad()


def test_epoch_end_versions_count_optimizer_updates_across_epochs_and_resume(store: client.Client) -> None:
    full = epochs(0)
    torch.manual_seed(1)
    for _ in range(3):
        train_epoch(*full)
        assert full[0].step == 0  # Accelerate's accumulation counter starts over every epoch
        save_state(full[0], "epochs", client=store)
    assert [v.step for v in store.versions("epochs")] == [3, 6, 9]

    resumed = epochs(5)
    torch.manual_seed(77)
    assert not tensors_equal(resumed[1].state_dict()["body.0.weight"], full[1].state_dict()["body.0.weight"])
    assert load_state(resumed[0], "epochs", 1, client=store).step == 3
    for _ in range(2):
        train_epoch(*resumed)
        save_state(resumed[0], "resumed", client=store)
    assert [v.step for v in store.versions("resumed")] == [6, 9]  # counting on from the version's
    for key, value in full[1].state_dict().items():
        assert tensors_equal(resumed[1].state_dict()[key], value), f"{key} differs after resume"
    found = resumed[2].optimizer.state_dict()["state"]
    for index, state in full[2].optimizer.state_dict()["state"].items():
        assert all(tensors_equal(found[index][k], v) for k, v in state.items()), f"optimizer state {index}"
