"""Where loaded optimizer state lands, with ``meta`` standing in for an accelerator.

PyTorch's own optimizer loading treats meta like cuda, so a tensor that reaches ``meta``
here would reach ``cuda`` on a GPU machine, and one that stays on the CPU would stay there.
"""

from __future__ import annotations

import pytest
import torch

from ckptstore import client
from tests.client.models import OPTIMIZERS, TinyNet, train

META = torch.device("meta")
CPU = torch.device("cpu")


def saved_and_fresh(
    ckpt: client.Client, name: str, capturable: bool = False
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """Train and save with optimizer ``name``; return a fresh model/optimizer and the saved state.

    ``capturable`` marks the groups capturable after training (capturable Adam cannot step
    on a CPU), which is what a checkpoint written on a GPU with capturable=True records.
    """
    model = TinyNet(seed=0)
    optim = OPTIMIZERS[name](model)
    train(model, optim, range(3))
    for group in optim.param_groups:
        group["capturable"] = capturable or group.get("capturable", False)
    ckpt.save("run", model, optim)
    saved = {k: v for k, v in optim.state_dict()["state"].items()}
    fresh = TinyNet(seed=1)
    return fresh, OPTIMIZERS[name](fresh), saved


def per_param_state(optim: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [optim.state[p] for group in optim.param_groups for p in group["params"] if p in optim.state]


def test_adamw_step_stays_on_host_and_moments_follow_params(ckpt: client.Client) -> None:
    model, optim, saved = saved_and_fresh(ckpt, "adamw")
    ckpt.load("run", model=model, optim=optim, device="meta")
    assert all(p.device == META for p in model.parameters())
    states = per_param_state(optim)
    assert len(states) == len(list(model.parameters()))
    for state, original in zip(states, saved.values(), strict=True):
        assert state["step"].device == CPU, "story 1: step must not be dragged to the accelerator"
        assert state["step"].dtype == original["step"].dtype
        assert state["exp_avg"].device == META and state["exp_avg_sq"].device == META
        assert state["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize(("name", "capturable"), [("adamw_fused", False), ("adamw", True)])
def test_fused_or_capturable_step_is_float32_on_the_param_device(
    ckpt: client.Client, name: str, capturable: bool
) -> None:
    model, optim, _ = saved_and_fresh(ckpt, name, capturable)
    ckpt.load("run", model=model, optim=optim, device="meta")
    for state in per_param_state(optim):
        assert state["step"].device == META
        assert state["step"].dtype == torch.float32
        assert state["exp_avg"].device == META


def test_sgd_momentum_buffers_follow_params(ckpt: client.Client) -> None:
    model, optim, _ = saved_and_fresh(ckpt, "sgd_momentum")
    ckpt.load("run", model=model, optim=optim, device="meta")
    states = per_param_state(optim)
    assert states and all(s["momentum_buffer"].device == META for s in states)


def test_prodigy_param_group_tensors_move_and_bf16_state_stays_bf16(ckpt: client.Client) -> None:
    model, optim, saved = saved_and_fresh(ckpt, "prodigy")
    assert any(v.dtype == torch.bfloat16 for s in saved.values() for v in s.values() if torch.is_tensor(v))
    ckpt.load("run", model=model, optim=optim, device="meta")
    group = optim.param_groups[0]
    for name in ("running_d_numerator", "running_d_denom"):
        assert torch.is_tensor(group[name]), name
        assert group[name].device == META, f"story 3: {name} left behind on {group[name].device}"
    bf16 = 0
    for state, original in zip(per_param_state(optim), saved.values(), strict=True):
        for key, value in original.items():
            if torch.is_tensor(value):
                assert state[key].dtype == value.dtype, f"{key} came back {state[key].dtype}"
                assert state[key].device == META
                bf16 += value.dtype == torch.bfloat16
    assert bf16 > 0


def test_state_follows_each_parameter_when_the_model_spans_devices(ckpt: client.Client) -> None:
    model, optim, _ = saved_and_fresh(ckpt, "prodigy")
    # Half the model on the "accelerator", half on the host: state must follow each param.
    model.body.to("meta")
    optim = OPTIMIZERS["prodigy"](model)
    ckpt.load("run", model=model, optim=optim)
    for p in model.parameters():
        for value in optim.state[p].values():
            if torch.is_tensor(value):
                assert value.device == p.device
    first_param = optim.param_groups[0]["params"][0]
    assert optim.param_groups[0]["running_d_denom"].device == first_param.device


def test_loading_into_a_model_already_on_the_device(ckpt: client.Client) -> None:
    model, _, _ = saved_and_fresh(ckpt, "adamw")
    model.to("meta")
    model.head.weight = model.embed.weight  # Module.to("meta") replaces parameters and unties them
    optim = OPTIMIZERS["adamw"](model)
    ckpt.load("run", model=model, optim=optim)
    for state in per_param_state(optim):
        assert state["step"].device == CPU and state["exp_avg"].device == META


def test_device_move_keeps_parameter_identity(ckpt: client.Client) -> None:
    model, optim, _ = saved_and_fresh(ckpt, "adamw")
    before = [id(p) for p in model.parameters()]
    ckpt.load("run", model=model, optim=optim, device="meta")
    assert [id(p) for p in model.parameters()] == before
    assert [id(p) for p in optim.param_groups[0]["params"]] == before


def test_manifest_records_placement_and_parameter_names(ckpt: client.Client) -> None:
    for name in ("adamw", "adamw_fused"):
        model = TinyNet()
        optim = OPTIMIZERS[name](model)
        train(model, optim, range(1))
        ckpt.save(name, model, optim)
    plain = {e.key: e for e in ckpt.transport.manifest("adamw").tensors}
    fused = {e.key: e for e in ckpt.transport.manifest("adamw_fused").tensors}
    assert plain["optim/state/body.0.weight/step"].placement == "host"
    assert fused["optim/state/body.0.weight/step"].placement == "param"
    assert plain["optim/state/body.0.weight/exp_avg"].param == "body.0.weight"
    assert plain["model/body.0.weight"].trainable is True
    assert plain["model/bn.running_mean"].trainable is False
    assert plain["model/bn.num_batches_tracked"].dtype_class == "integer"


def test_state_dict_without_a_model_lands_on_the_requested_device(ckpt: client.Client) -> None:
    model, _, _ = saved_and_fresh(ckpt, "adamw")
    result = ckpt.load("run", device="meta")
    assert result.state_dict is not None
    assert set(result.state_dict) == set(model.state_dict())
    assert all(t.device == META for t in result.state_dict.values())
