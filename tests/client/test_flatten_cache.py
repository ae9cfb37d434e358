"""A client reuses the flattened model and optimizer state of its last save only while it holds.

Each test flattens a model and its optimizer through a :class:`FlattenCache`, changes them one
way or several (hypothesis draws the sequence), and checks that the cache's answer is exactly
what flattening from scratch gives: the same keys, holding the same tensor objects, with the
same placement, owner and trainable flag, and the same JSON.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ckptstore.client import Client
from ckptstore.client.state import FlatState, FlattenCache, flatten

Setup = tuple[nn.Module, torch.optim.Optimizer]


def build() -> Setup:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model[0].requires_grad_(False)  # a frozen base
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    step(model, optim)
    return model, optim


def step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    x = torch.randn(5, 4)
    for layer in model:  # each layer in its own dtype (a change may give one another)
        x = layer(x.to(layer.weight.dtype))
    x.pow(2).mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def described(flat: FlatState) -> tuple[list[tuple[object, ...]], dict[str, object]]:
    """What a save stores of ``flat``: each record (the tensor by identity) and the JSON."""
    records = [(r.key, id(r.tensor), r.placement, r.param, r.trainable) for r in flat.records]
    return records, flat.state


def _step(setup: Setup) -> None:
    step(*setup)  # moves the tensors' values and version counters, nothing else


def _schedule(setup: Setup) -> None:
    setup[1].param_groups[0]["lr"] *= 0.5


def _unfreeze(setup: Setup) -> None:
    setup[0][0].weight.requires_grad_(True)


def _freeze(setup: Setup) -> None:
    setup[0][2].bias.requires_grad_(False)


def _double_in_place(setup: Setup) -> None:
    for param in setup[0][0].parameters():  # the same objects, of another dtype
        param.data = param.data.double() if param.dtype == torch.float32 else param.data.float()


def _replace_moment(setup: Setup) -> None:
    state = setup[1].state[setup[0][2].weight]
    state["exp_avg"] = state["exp_avg"].clone()


def _new_state_key(setup: Setup) -> None:
    setup[1].state[setup[0][2].weight]["max_exp_avg_sq"] = torch.zeros(2, 8)


def _scalar_state(setup: Setup) -> None:
    state = setup[1].state[setup[0][2].bias]
    state["seen"] = state.get("seen", 0) + 1  # a new int object each time


def _list_in_state(setup: Setup) -> None:
    state = setup[1].state[setup[0][2].bias]
    state.setdefault("history", []).append(len(state.get("history", [])))  # changes inside


def _fused(setup: Setup) -> None:
    group = setup[1].param_groups[0]
    group["fused"] = not group.get("fused", False)  # keeps ``step`` on the device


def _new_group(setup: Setup) -> None:
    model, optim = setup
    if all(model[0].weight is not p for g in optim.param_groups for p in g["params"]):
        optim.add_param_group({"params": [model[0].weight], "lr": 1e-4})


def _regroup(setup: Setup) -> None:
    """The same parameters in the same order, split into groups differently."""
    optim = setup[1]
    params = [p for g in optim.param_groups for p in g["params"]]
    if len(optim.param_groups) == 1 and len(params) > 1:
        first = optim.param_groups[0]
        optim.param_groups[:] = [{**first, "params": params[:1]}, {**first, "params": params[1:]}]


def _replace_layer(setup: Setup) -> None:
    setup[0][2] = nn.Linear(8, 2)  # the optimizer no longer holds the model's parameters


def _tensor_in_group(setup: Setup) -> None:
    setup[1].param_groups[0]["d"] = torch.tensor(float(len(setup[1].param_groups)))  # Prodigy-like


CHANGES: dict[str, Callable[[Setup], None]] = {
    f.__name__.lstrip("_"): f
    for f in (
        _step,
        _schedule,
        _unfreeze,
        _freeze,
        _double_in_place,
        _replace_moment,
        _new_state_key,
        _scalar_state,
        _list_in_state,
        _fused,
        _new_group,
        _regroup,
        _tensor_in_group,
    )
}


def check(setup: Setup, cache: FlattenCache) -> None:
    """The cache's flatten of ``setup`` is what a flatten from scratch gives."""
    assert described(flatten(*setup, reuse=cache)) == described(flatten(*setup))


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_way_of_changing_the_state_is_seen(change: str) -> None:
    setup, cache = build(), FlattenCache()
    check(setup, cache)
    CHANGES[change](setup)
    check(setup, cache)
    CHANGES[change](setup)
    check(setup, cache)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(sorted(CHANGES)), max_size=6))
def test_any_sequence_of_changes_is_seen(changes: list[str]) -> None:
    setup, cache = build(), FlattenCache()
    check(setup, cache)
    for change in changes:
        CHANGES[change](setup)
        check(setup, cache)


def test_an_unchanged_state_is_answered_from_the_cache() -> None:
    setup, cache = build(), FlattenCache()
    first = flatten(*setup, reuse=cache)
    for _ in range(3):
        step(*setup)
        again = flatten(*setup, reuse=cache)
        assert described(again) == described(first)
    assert cache.hits == 6  # the model's part and the optimizer's, three times


def test_a_list_in_the_optimizer_state_is_encoded_at_every_save() -> None:
    setup, cache = build(), FlattenCache()
    _list_in_state(setup)
    flatten(*setup, reuse=cache)
    _list_in_state(setup)
    assert flatten(*setup, reuse=cache).state["optim"]["state"]["2.bias"]["history"] == [0, 1]
    assert cache.hits == 1  # the model's part only


def test_a_parameter_the_model_no_longer_holds_is_still_refused() -> None:
    setup, cache = build(), FlattenCache()
    flatten(*setup, reuse=cache)
    _replace_layer(setup)
    with pytest.raises(Exception, match="not a parameter of the model"):
        flatten(*setup, reuse=cache)


def test_the_cache_keeps_neither_model_nor_optimizer_alive() -> None:
    setup, cache = build(), FlattenCache()
    flatten(*setup, reuse=cache)
    model_ref, optim_ref = weakref.ref(setup[0]), weakref.ref(setup[1])
    del setup
    gc.collect()
    assert model_ref() is None and optim_ref() is None


def test_the_cache_keeps_no_optimizer_state_the_optimizer_let_go() -> None:
    model, optim = build()
    cache = FlattenCache()
    flatten(model, optim, reuse=cache)
    flatten(model, optim, reuse=cache)  # a hit: made again from the live state
    state = optim.state[model[2].weight]
    replaced = weakref.ref(state["exp_avg"])
    state["exp_avg"] = state["exp_avg"].clone()
    del state
    loaded = [weakref.ref(v) for s in optim.state.values() for v in s.values()]
    optim.load_state_dict(copy.deepcopy(optim.state_dict()))  # new tensors for every state value
    gc.collect()
    assert replaced() is None and all(ref() is None for ref in loaded)
    check((model, optim), cache)


def test_nothing_is_kept_of_a_model_whose_state_dict_is_made_at_every_save() -> None:
    model, optim = build()
    made: list[weakref.ref[torch.Tensor]] = []

    def scaled(module: nn.Module, state: dict[str, torch.Tensor], prefix: str, local: object) -> None:
        state[prefix + "weight"] = module.weight.detach() * 2  # a tensor made by each state_dict call
        made.append(weakref.ref(state[prefix + "weight"]))

    model[0]._register_state_dict_hook(scaled)
    cache = FlattenCache()
    for _ in range(3):
        step(model, optim)
        cached, fresh = flatten(model, optim, reuse=cache), flatten(model, optim)
        assert [r.key for r in cached.records] == [r.key for r in fresh.records]
        assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(cached.records, fresh.records, strict=True))
        assert cached.state == fresh.state
        del cached, fresh
    gc.collect()
    assert made and all(ref() is None for ref in made)  # no part holds them
    assert cache.hits == 0


def test_background_saves_between_changes_store_the_state_as_it_is(tmp_path: Path) -> None:
    model, optim = build()
    with Client(home=tmp_path) as ckpt:
        ckpt.save("r", model, optim, blocking=False).result()
        for change in ("step", "replace_moment", "new_state_key", "schedule", "double_in_place", "unfreeze", "step"):
            CHANGES[change]((model, optim))
            ckpt.save("r", model, optim, blocking=False).result()
            twin, twin_optim = copy.deepcopy((model, optim))  # the same layout, its values then wiped
            with torch.no_grad():
                for tensor in [*twin.state_dict().values(), *values(twin_optim)]:
                    tensor.zero_()
            twin_optim.param_groups[0]["lr"] = 0.0
            ckpt.load("r", model=twin, optim=twin_optim)
            for key, value in model.state_dict().items():
                assert torch.equal(twin.state_dict()[key], value) and twin.state_dict()[key].dtype == value.dtype, key
            assert twin_optim.state_dict()["param_groups"] == optim.state_dict()["param_groups"]
            assert [v.tolist() for v in values(twin_optim)] == [v.tolist() for v in values(optim)], change


def values(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of ``optim``'s state, in its state_dict's order."""
    return [v for state in optim.state_dict()["state"].values() for v in state.values() if isinstance(v, torch.Tensor)]
