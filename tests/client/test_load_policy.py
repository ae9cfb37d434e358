"""Strict loading reports and the precision policy (dtype= casts floating model tensors only)."""

from __future__ import annotations

import pytest
import torch

from ckptstore import client
from tests.client.models import OPTIMIZERS, TinyNet, tensors_equal, train


class Wider(TinyNet):
    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.extra_head = torch.nn.Linear(16, 4)


def saved_run(ckpt: client.Client) -> tuple[TinyNet, torch.optim.Optimizer]:
    model = TinyNet(seed=0)
    optim = OPTIMIZERS["adamw"](model)
    train(model, optim, range(2))
    ckpt.save("run", model, optim)
    return model, optim


def test_missing_keys_raise_and_leave_the_model_untouched(ckpt: client.Client) -> None:
    saved_run(ckpt)
    target = Wider(seed=7)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(client.StateMismatchError) as caught:
        ckpt.load("run", model=target)
    assert caught.value.missing_keys == ["extra_head.bias", "extra_head.weight"]
    assert "extra_head.weight" in str(caught.value)
    assert all(tensors_equal(v, before[k]) for k, v in target.state_dict().items())


def test_strict_false_loads_the_rest_and_reports(ckpt: client.Client) -> None:
    model, _ = saved_run(ckpt)
    target = Wider(seed=7)
    result = ckpt.load("run", model=target, strict=False)
    assert result.missing_keys == ["extra_head.bias", "extra_head.weight"]
    assert result.unexpected_keys == []
    assert tensors_equal(target.body[0].weight, model.body[0].weight)


def test_unexpected_keys_are_named(ckpt: client.Client) -> None:
    ckpt.save("wide", Wider())
    with pytest.raises(client.StateMismatchError) as caught:
        ckpt.load("wide", model=TinyNet())
    assert caught.value.unexpected_keys == ["extra_head.bias", "extra_head.weight"]


def test_shape_mismatch_is_refused_before_writing(ckpt: client.Client) -> None:
    ckpt.save("small", TinyNet(width=16))
    target = TinyNet(width=8, seed=3)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(client.StateMismatchError, match="shape mismatch"):
        ckpt.load("small", model=target)
    assert all(tensors_equal(v, before[k]) for k, v in target.state_dict().items())


def test_dtype_casts_the_model_but_not_the_optimizer_state(ckpt: client.Client) -> None:
    model, optim = saved_run(ckpt)
    fresh = TinyNet(seed=4)
    fresh_optim = OPTIMIZERS["adamw"](fresh)
    result = ckpt.load("run", model=fresh, optim=fresh_optim, dtype=torch.bfloat16)
    assert fresh.body[0].weight.dtype == torch.bfloat16
    assert torch.equal(fresh.body[0].weight, model.body[0].weight.to(torch.bfloat16))
    assert fresh.bn.num_batches_tracked.dtype == torch.int64, "integer buffers are never cast"
    assert fresh_optim.param_groups[0]["params"][0] is fresh.embed.weight
    for state in fresh_optim.state.values():
        assert state["exp_avg"].dtype == torch.float32
        assert state["step"].dtype == torch.float32
    assert "model/body.0.weight: float32 -> bfloat16" in result.casts
    assert not any("num_batches_tracked" in c for c in result.casts)


def test_dtype_casts_a_returned_state_dict(ckpt: client.Client) -> None:
    saved_run(ckpt)
    result = ckpt.load("run", dtype=torch.float16)
    assert result.state_dict is not None
    assert result.state_dict["norm.weight"].dtype == torch.float16
    assert result.state_dict["bn.num_batches_tracked"].dtype == torch.int64


def test_saved_bf16_model_loads_into_fp32_model_with_a_reported_cast(ckpt: client.Client) -> None:
    ckpt.save("bf16", TinyNet().to(torch.bfloat16))
    target = TinyNet(seed=2)
    result = ckpt.load("bf16", model=target)
    assert target.body[0].weight.dtype == torch.float32
    assert "model/body.0.weight: bfloat16 -> float32" in result.casts
    plain = ckpt.load("bf16")
    assert plain.state_dict is not None and plain.state_dict["body.0.weight"].dtype == torch.bfloat16


def test_optimizer_without_model_is_refused(ckpt: client.Client) -> None:
    model, optim = saved_run(ckpt)
    with pytest.raises(client.InvalidInputError, match="needs the model"):
        ckpt.load("run", optim=optim)


def test_optimizer_missing_from_the_version_is_reported(ckpt: client.Client) -> None:
    ckpt.save("weights-only", TinyNet())
    model = TinyNet()
    with pytest.raises(client.StateMismatchError, match="no optimizer state"):
        ckpt.load("weights-only", model=model, optim=OPTIMIZERS["adamw"](model))


def test_versions_by_number_latest_and_tag(ckpt: client.Client) -> None:
    first = TinyNet(seed=0)
    ckpt.save("run", first, tags=["best"], metrics={"loss": 1.5}, step=10)
    ckpt.save("run", TinyNet(seed=1), step=20)
    assert ckpt.load("run").step == 20
    assert ckpt.load("run", "best").version == 1
    assert ckpt.load("run", 1).metrics == {"loss": 1.5}
    with pytest.raises(client.NotFoundError, match="no version 3"):
        ckpt.load("run", 3)
    with pytest.raises(client.NotFoundError, match="does not exist"):
        ckpt.load("nope")
    with pytest.raises(client.InvalidNameError):
        ckpt.load("../etc")


def test_many_small_shards_round_trip(ckpt: client.Client) -> None:
    ckpt.shard_bytes = 2048
    model = TinyNet(seed=0)
    optim = OPTIMIZERS["adamw"](model)
    train(model, optim, range(2))
    result = ckpt.save("run", model, optim)
    manifest = ckpt.transport.manifest("run")
    distinct = {e.digest: e.nbytes for e in manifest.tensors}
    assert result.shards >= 5 and result.bytes_new == sum(distinct.values()) < result.bytes_total
    assert ckpt.versions("run")[-1].bytes_new == result.bytes_new
    assert ckpt.save("run-again", model, optim).shards == 0, "every tensor is already stored"
    fresh = TinyNet(seed=9)
    fresh_optim = OPTIMIZERS["adamw"](fresh)
    ckpt.load("run-again", model=fresh, optim=fresh_optim)
    assert all(
        tensors_equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )
