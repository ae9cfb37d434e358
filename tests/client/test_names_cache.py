"""A client walks a model's modules again only when its layout changed, and sees every change.

Each test builds a model, lets a :class:`NamesCache` remember it, changes the model one way
or several (hypothesis draws the sequence), and checks that the cache answers exactly what a
fresh walk answers: the same names, holding the same tensor objects.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrize

from ckptstore.client import Client
from ckptstore.client.names import ModelNames, NamesCache, model_names
from ckptstore.client.saving import hashing


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.BatchNorm1d(8),
        nn.ModuleList([nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)]),
        nn.ModuleDict({"head": nn.Linear(8, 2)}),
    )


def same(a: ModelNames, b: ModelNames) -> bool:
    """Equal names holding the very same tensor objects."""
    return (
        list(a.state_dict) == list(b.state_dict)
        and all(a.state_dict[k] is b.state_dict[k] for k in a.state_dict)
        and list(a.parameters) == list(b.parameters)
        and all(a.parameters[k] is b.parameters[k] for k in a.parameters)
    )


class Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _replace_parameter(model: nn.Module) -> None:
    model[0].weight = nn.Parameter(torch.ones(8, 4))


def _to_float64(model: nn.Module) -> None:
    model.to(torch.float64)  # keeps parameter objects, replaces the buffers with new tensors


def _new_buffer(model: nn.Module) -> None:
    model[0].register_buffer("scale", torch.ones(1))


def _non_persistent(model: nn.Module) -> None:
    model[1].register_buffer("running_mean", model[1].running_mean, persistent=False)


def _delete_parameter(model: nn.Module) -> None:
    del model[3]["head"].bias
    model[3]["head"].register_parameter("bias", None)


def _delete_from_list(model: nn.Module) -> None:
    del model[2][0]  # ModuleList rebuilds its dict without a registration hook


def _insert_into_list(model: nn.Module) -> None:
    model[2].insert(0, nn.Linear(8, 8))  # writes the dict directly


def _pop_from_dict(model: nn.Module) -> None:
    model[3].pop("head")
    model[3]["tail"] = nn.Linear(8, 2)


def _swap_children_directly(model: nn.Module) -> None:
    children = model[2]._modules
    children["0"], children["2"] = children["2"], children["0"]


def _state_dict_hook(model: nn.Module) -> None:
    model[0]._register_state_dict_hook(lambda module, state, prefix, local: None)


def _parametrize(model: nn.Module) -> None:
    parametrize.register_parametrization(model[2][2], "weight", Double())


def _rename_child(model: nn.Module) -> None:
    head = model[3]._modules.pop("head")
    model[3]._modules["renamed"] = head


def _freeze(model: nn.Module) -> None:
    model[0].requires_grad_(False)  # not a layout change: the flag is read at every save


CHANGES: dict[str, Callable[[nn.Module], None]] = {
    "replace a parameter": _replace_parameter,
    "model.to(float64)": _to_float64,
    "register a buffer": _new_buffer,
    "make a buffer non-persistent": _non_persistent,
    "delete a parameter": _delete_parameter,
    "delete from a ModuleList": _delete_from_list,
    "insert into a ModuleList": _insert_into_list,
    "pop from a ModuleDict": _pop_from_dict,
    "swap children in _modules": _swap_children_directly,
    "a state_dict hook": _state_dict_hook,
    "parametrize a weight": _parametrize,
    "rename a child in _modules": _rename_child,
    "freeze a layer": _freeze,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_way_of_changing_a_model_is_seen(change: str) -> None:
    model, cache = build(), NamesCache()
    first = cache.names(model)
    assert same(cache.names(model), first) and cache.hits == 1
    CHANGES[change](model)
    assert same(cache.names(model), model_names(model))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(sorted(CHANGES)), max_size=6))
def test_any_sequence_of_changes_is_seen(changes: list[str]) -> None:
    model, cache = build(), NamesCache()
    cache.names(model)
    for change in changes:
        try:
            CHANGES[change](model)
        except (KeyError, IndexError, AttributeError, RuntimeError, ValueError):
            continue  # the change does not apply to the model as an earlier one left it
        assert same(cache.names(model), model_names(model)), change
        assert same(cache.names(model), model_names(model))  # and again, from the cache


def test_an_unchanged_model_is_answered_from_the_cache() -> None:
    model, cache = build(), NamesCache()
    for _ in range(5):
        cache.names(model)
    assert cache.hits == 4


def test_a_model_with_a_state_dict_hook_is_walked_at_every_save() -> None:
    model, cache = build(), NamesCache()
    model[0]._register_state_dict_hook(lambda module, state, prefix, local: None)
    for _ in range(3):
        assert same(cache.names(model), model_names(model))
    assert cache.hits == 0


def test_a_class_that_writes_its_own_state_dict_is_walked_at_every_save() -> None:
    class Scaled(nn.Linear):
        def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:  # type: ignore[override]
            destination[prefix + "weight"] = self.weight * 2

    model, cache = nn.Sequential(Scaled(2, 2)), NamesCache()
    for _ in range(3):
        cache.names(model)
    assert cache.hits == 0


def test_the_cache_does_not_keep_a_model_alive() -> None:
    model, cache = build(), NamesCache()
    cache.names(model)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_background_saves_between_changes_store_the_model_as_it_is(tmp_path: Path) -> None:
    model = build()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with Client(home=tmp_path) as ckpt:
        changes = ["insert into a ModuleList", "model.to(float64)", "delete from a ModuleList", "pop from a ModuleDict"]
        for change in changes:
            ckpt.save("run", model, optim, blocking=False)
            CHANGES[change](model)
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            ckpt.save("run", model, optim, blocking=False).result()
            loaded = ckpt.load("run").state_dict
            assert loaded is not None
            expected = model.state_dict()
            assert list(loaded) == list(expected), change
            assert all(torch.equal(loaded[k], expected[k]) for k in expected), change


# -- samples of frozen tensors, gathered ------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.complex64,
          torch.float8_e4m3fn, torch.float64]  # fmt: skip


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 40), min_size=0, max_size=3))
    base = torch.randint(0, 100, shape).to(dtype)
    layout = draw(st.sampled_from(["plain", "transposed", "sliced", "conj"]))
    if layout == "transposed" and base.dim() >= 2:
        base = base.transpose(0, -1)
    elif layout == "sliced" and base.dim() >= 1:
        base = base[::2]
    elif layout == "conj" and dtype == torch.complex64:
        base = base.conj()
    return base


@settings(max_examples=200, deadline=None)
@given(st.lists(tensors(), max_size=8))
def test_gathered_samples_are_the_samples_taken_one_by_one(batch: list[torch.Tensor]) -> None:
    assert hashing.gathered_samples(batch) == [hashing.sample(t) for t in batch]
    assert hashing.samples(batch) == [hashing.sample(t) for t in batch]


def test_a_module_class_that_redefines_equality_is_walked_at_every_save() -> None:
    class Equal(nn.Linear):
        def __eq__(self, other: object) -> bool:
            return isinstance(other, nn.Linear)

        __hash__ = nn.Linear.__hash__

    model, cache = nn.Sequential(Equal(2, 2)), NamesCache()
    cache.names(model)
    model[0] = Equal(2, 2)
    assert same(cache.names(model), model_names(model))
    assert cache.hits == 0
