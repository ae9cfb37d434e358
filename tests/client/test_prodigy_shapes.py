"""The real prodigy-plus-schedule-free on models whose shapes give it odd state tensors.

For a parameter of a few elements it keeps bf16 state (``p0``, ``s``) of shape ``(1,)`` with
stride ``(11,)``: ``is_contiguous()`` says True, yet ``view(torch.uint8)`` refuses it. Each
model here is trained, saved, loaded on ``meta`` (where an accelerator would be) and resumed
on the CPU bit for bit, with shapes and optimizer options drawn beyond the first example.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from prodigyplus import ProdigyPlusScheduleFree
from torch import nn

from ckptstore import client
from tests.client.models import tensors_equal

pytestmark = pytest.mark.slow  # hypothesis draws of model widths and optimizer options

META = torch.device("meta")
STEPS = 3


def mlp(*widths: int) -> Callable[[], nn.Module]:
    """A ReLU MLP with the given layer widths (the first is the input)."""

    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for inputs, outputs in zip(widths, widths[1:], strict=False):
            layers += [nn.Linear(inputs, outputs), nn.ReLU()]
        return nn.Sequential(*layers[:-1])

    return build


def conv_net() -> nn.Module:
    """Conv weights (4-d), a one-channel conv and a one-output head."""
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 1, 1), nn.Flatten(), nn.Linear(36, 1))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp-16-32-4": (mlp(16, 32, 4), (8, 16)),  # the 4-element bias gets (1,) state of stride (11,)
    "mlp-5-1": (mlp(5, 3, 1), (8, 5)),  # a (1, 3) weight and a (1,) bias
    "mlp-2-7-2": (mlp(2, 7, 2), (8, 2)),
    "conv": (conv_net, (4, 3, 8, 8)),
}


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range, inputs: tuple[int, ...]) -> None:
    for step in steps:
        batch = torch.randn(inputs, generator=torch.Generator().manual_seed(step))
        optim.zero_grad(set_to_none=True)
        model(batch).pow(2).mean().backward()
        optim.step()


def _prodigy(model: nn.Module, **options: bool) -> ProdigyPlusScheduleFree:
    optim = ProdigyPlusScheduleFree(model.parameters(), lr=1.0, **options)
    optim.train()
    return optim


def _tensors(value: object, path: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a state value (a tensor, or tuples and lists of them), with its path."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, (tuple, list)):
        return [found for i, item in enumerate(value) for found in _tensors(item, f"{path}/{i}")]
    return []


def _state_tensors(optim: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """``param/key[/index]`` -> tensor for every tensor of the optimizer's per-parameter state."""
    return {
        path: tensor
        for name, param in model.named_parameters()
        for key, value in optim.state[param].items()
        for path, tensor in _tensors(value, f"{name}/{key}")
    }


def _odd_state(optim: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """State tensors whose strides are not the row-major ones (size-1 dims included)."""
    return [
        f"{path}{tuple(t.shape)}{t.stride()}"
        for path, t in _state_tensors(optim, model).items()
        if t.dim() and t.stride() != torch.empty(t.shape).stride()
    ]


def _resume_matches(
    ckpt: client.Client, run: str, build: Callable[[], nn.Module], inputs: tuple[int, ...], **options: bool
) -> list[str]:
    """Train, save, train on; load into fresh objects on meta and on the CPU; resume; compare bitwise.

    Returns the odd-strided state tensors the optimizer held when it was saved.
    """
    torch.manual_seed(0)
    model = build()
    optim = _prodigy(model, **options)
    _train(model, optim, range(STEPS), inputs)
    odd = _odd_state(optim, model)
    ckpt.save(run, model, optim)
    saved_state = {path: t.clone() for path, t in _state_tensors(optim, model).items()}
    _train(model, optim, range(STEPS, 2 * STEPS), inputs)

    on_meta = build().to(META)
    meta_optim = _prodigy(on_meta, **options)
    ckpt.load(run, model=on_meta, optim=meta_optim, device=META)
    on_meta_state = _state_tensors(meta_optim, on_meta)
    assert on_meta_state.keys() == saved_state.keys()
    for path, value in on_meta_state.items():
        expected = saved_state[path]
        assert value.device == (torch.device("cpu") if path.endswith("/step") else META), f"{path} on {value.device}"
        assert (value.dtype, value.shape) == (expected.dtype, expected.shape), path
    for key in ("running_d_numerator", "running_d_denom"):
        assert meta_optim.param_groups[0][key].device == META, key

    torch.manual_seed(7)
    fresh = build()
    fresh_optim = _prodigy(fresh, **options)
    ckpt.load(run, model=fresh, optim=fresh_optim)
    restored = _state_tensors(fresh_optim, fresh)
    assert restored.keys() == saved_state.keys()
    for path, value in restored.items():
        assert tensors_equal(value, saved_state[path]), f"{path} not restored bit for bit"
    _train(fresh, fresh_optim, range(STEPS, 2 * STEPS), inputs)
    for (name, want), got in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert tensors_equal(got, want), f"{name} differs after resume"
    resumed = _state_tensors(fresh_optim, fresh)
    for path, value in _state_tensors(optim, model).items():
        assert tensors_equal(resumed[path], value), f"state {path} differs after resume"
    return odd


@pytest.mark.parametrize("name", list(MODELS))
def test_prodigy_state_of_every_shape_saves_loads_on_meta_and_resumes_bitwise(ckpt: client.Client, name: str) -> None:
    build, inputs = MODELS[name]
    odd = _resume_matches(ckpt, name, build, inputs)
    if name == "mlp-16-32-4":
        assert any("/p0(1,)" in entry for entry in odd), f"the odd-strided state this guards is gone: {odd}"


@seed(20261124)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    batch=st.integers(1, 5),
    factored=st.booleans(),
    split_groups=st.booleans(),
    use_bias_correction=st.booleans(),
    use_adopt=st.booleans(),
)
def test_prodigy_resumes_bitwise_for_drawn_widths_and_options(
    widths: list[int], batch: int, factored: bool, split_groups: bool, use_bias_correction: bool, use_adopt: bool
) -> None:
    with tempfile.TemporaryDirectory() as home, client.Client(home=home) as ckpt:
        _resume_matches(
            ckpt,
            "drawn",
            mlp(*widths),
            (batch, widths[0]),
            factored=factored,
            split_groups=split_groups,
            use_bias_correction=use_bias_correction,
            use_adopt=use_adopt,
        )
