"""Odd state survives a round trip; values that are not JSON or tensors are refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from ckptstore import client
from ckptstore.client import jsonstate
from tests.client.models import TinyNet, tensors_equal

META = torch.device("meta")


def test_json_markers_round_trip() -> None:
    value = {
        "betas": (0.9, 0.999),
        "best": math.inf,
        "worst": -math.inf,
        "ints": {3: "a", (1, 2): "b"},
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "tricky": {"__tuple__": 1},
        "nested": [None, True, "s", [1, 2.5]],
    }
    encoded = jsonstate.encode(value, "extra", lambda t, p: p)
    decoded = jsonstate.decode(encoded, lambda key: torch.zeros(()))
    assert decoded == value
    nan = jsonstate.decode(jsonstate.encode(math.nan, "x", lambda t, p: p), lambda k: torch.zeros(()))
    assert math.isnan(nan)


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"fn": lambda: 1}, "extra/fn"),
        ({"deep": [{"x": object()}]}, "extra/deep/0/x"),
        ({"big": 2**70}, "extra/big"),
        ({"s": {1, 2}}, "extra/s"),
    ],
)
def test_values_that_are_not_json_are_refused_by_path(ckpt: client.Client, value: dict, path: str) -> None:
    with pytest.raises(client.StateEncodingError, match=path):
        ckpt.save("run", TinyNet(), extra=value)
    assert ckpt.runs() == [], "a refused save must not create anything"


def test_odd_tensors_round_trip_in_extra(ckpt: client.Client) -> None:
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    extra = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "flags": torch.tensor([True, False, True]),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "complex": torch.randn(3, dtype=torch.complex64),
        "fp8": torch.randn(4).to(torch.float8_e4m3fn),
        "uint": torch.tensor([1, 2**31 + 5], dtype=torch.uint32),
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "negated": torch.randn(3, dtype=torch.complex64).conj(),
        "rng": torch.get_rng_state(),
        "shared": [base, base],
    }
    ckpt.save("odd", TinyNet(), extra=extra)
    loaded = ckpt.load("odd").extra
    for key, value in extra.items():
        if isinstance(value, list):
            assert all(tensors_equal(a, b.contiguous()) for a, b in zip(loaded[key], value, strict=True))
        else:
            assert tensors_equal(loaded[key], value.resolve_conj().contiguous()), key
    assert loaded["rng"].device.type == "cpu"


class OddOptimizer(torch.optim.Optimizer):
    """Third-party-style state: strided views, 0-d and bf16 tensors, lists, param_group tensors."""

    def __init__(self, params, lr: float = 0.1) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr, "scale": torch.tensor(1.0), "window": (2, 3)})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            group["scale"] = group["scale"] * 0.5
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    wide = torch.zeros(p.numel() * 2)
                    state["view"] = wide[::2]  # a view with stride 2 into a larger storage
                    state["count"] = torch.tensor(0, dtype=torch.int32)
                    state["ema"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["history"] = [torch.zeros(2), torch.ones(2)]
                    state["name"] = "odd"
                state["view"].add_(p.grad.reshape(-1))
                state["count"] += 1
                state["ema"].mul_(0.9).add_(p.grad.to(torch.bfloat16))
                p.add_(p.grad, alpha=-group["lr"] * float(group["scale"]))
        return None


def test_third_party_optimizer_state_round_trips_and_is_placed(ckpt: client.Client) -> None:
    model = torch.nn.Linear(4, 3)
    optim = OddOptimizer(model.parameters())
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
    ckpt.save("odd", model, optim)

    fresh = torch.nn.Linear(4, 3)
    fresh_optim = OddOptimizer(fresh.parameters())
    ckpt.load("odd", model=fresh, optim=fresh_optim)
    for p_saved, p_loaded in zip(model.parameters(), fresh.parameters(), strict=True):
        saved, loaded = optim.state[p_saved], fresh_optim.state[p_loaded]
        assert tensors_equal(loaded["view"], saved["view"].contiguous())
        assert tensors_equal(loaded["count"], saved["count"])
        assert loaded["ema"].dtype == torch.bfloat16 and tensors_equal(loaded["ema"], saved["ema"])
        assert all(tensors_equal(a, b) for a, b in zip(loaded["history"], saved["history"], strict=True))
        assert loaded["name"] == "odd"
    assert tensors_equal(fresh_optim.param_groups[0]["scale"], optim.param_groups[0]["scale"])
    assert fresh_optim.param_groups[0]["window"] == (2, 3)

    on_meta = torch.nn.Linear(4, 3)
    meta_optim = OddOptimizer(on_meta.parameters())
    ckpt.load("odd", model=on_meta, optim=meta_optim, device="meta")
    assert meta_optim.param_groups[0]["scale"].device == META
    for p in on_meta.parameters():
        state = meta_optim.state[p]
        assert state["view"].device == META and state["ema"].dtype == torch.bfloat16
        assert all(t.device == META for t in state["history"])


def test_meta_tensors_cannot_be_saved(ckpt: client.Client) -> None:
    with pytest.raises(client.StateEncodingError, match="meta tensor"):
        ckpt.save("run", torch.nn.Linear(2, 2, device="meta"))
