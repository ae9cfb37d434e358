"""Hugging Face Trainer through CkptstoreCallback and resume(): versions at save steps with
metrics and the model's configs, save_total_limit as retention, bit-exact resume, PEFT adapters
stored by their new bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the .[transformers] extra; installed in CI

from ckptstore import client  # noqa: E402
from ckptstore.client.integrations.transformers import CkptstoreCallback, model_configs, resume  # noqa: E402
from tests.client.models import tensors_equal  # noqa: E402
from tests.integrations.hf_kit import Tokens, arguments, tiny_gpt2  # noqa: E402

META = torch.device("meta")


def train(model: Any, args: Any, store: client.Client, run: str, evaluate: bool = False) -> tuple[Any, Any]:
    """A Trainer on the token data (and 4 evaluation sequences with ``evaluate``) saving to ``run``."""
    callback = CkptstoreCallback(run, client=store)
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        eval_dataset=Tokens(count=4) if evaluate else None,
        callbacks=[callback],
    )
    return trainer, callback


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for key, value in a.state_dict().items():
        assert tensors_equal(b.state_dict()[key], value), f"{key} differs"


def test_versions_at_save_steps_with_metrics_and_no_folders(ckpt: client.Client, tmp_path: Path) -> None:
    trainer, callback = train(tiny_gpt2(0), arguments(tmp_path / "out"), ckpt, "gpt2")
    trainer.train()
    versions = ckpt.versions("gpt2")
    assert [v.step for v in versions] == [3, 6] and callback.saved == [1, 2]
    assert {"loss", "learning_rate", "grad_norm"} <= set(versions[0].metrics)
    logged = next(e for e in trainer.state.log_history if e.get("step") == 3)
    assert versions[0].metrics["loss"] == logged["loss"]
    assert not list((tmp_path / "out").glob("checkpoint-*")), "the Trainer wrote no checkpoint folder"
    manifest = ckpt.transport.manifest("gpt2", 1)
    assert manifest.state["extra"]["trainer_state"]["global_step"] == 3
    # The config save_pretrained would write as config.json, every field.
    config = json.loads(trainer.model.config.to_json_string(use_diff=False))
    assert manifest.state["extra"]["model_config"] == config and "peft_config" not in manifest.state["extra"]
    assert any(e.key.startswith("optim/state/transformer.h.0.attn.c_attn.weight/exp_avg") for e in manifest.tensors)


def test_resume_from_the_store_is_bitwise_identical(ckpt: client.Client, tmp_path: Path) -> None:
    full, _ = train(tiny_gpt2(0), arguments(tmp_path / "a"), ckpt, "full")
    full.train()

    fresh = tiny_gpt2(99)
    resumed, _ = train(fresh, arguments(tmp_path / "b"), ckpt, "resumed")
    assert not tensors_equal(fresh.state_dict()["lm_head.weight"], full.model.state_dict()["lm_head.weight"])
    resume(resumed, "full", 1, client=ckpt)  # the version of step 3 (mid-epoch: data is fast-forwarded)

    assert resumed.state.global_step == 6
    assert_same_weights(full.model, resumed.model)
    full_optim, resumed_optim = full.optimizer.state_dict(), resumed.optimizer.state_dict()
    for index, state in full_optim["state"].items():
        for name, value in state.items():
            assert tensors_equal(resumed_optim["state"][index][name], value), f"optimizer {index}/{name}"
    assert resumed.lr_scheduler.state_dict() == full.lr_scheduler.state_dict()
    assert [v.step for v in ckpt.versions("resumed")] == [6]
    assert ckpt.versions("resumed")[0].metrics["loss"] == ckpt.versions("full")[1].metrics["loss"]


def test_epoch_saves_are_taken_at_each_epochs_end(store: client.Client, tmp_path: Path) -> None:
    args = arguments(tmp_path / "out", max_steps=-1, num_train_epochs=2, save_strategy="epoch")
    trainer, _ = train(tiny_gpt2(0), args, store, "epochs")
    trainer.train()
    versions = store.versions("epochs")
    assert [v.step for v in versions] == [12, 24]  # 24 sequences in batches of 2
    assert [v.metrics["epoch"] for v in versions] == [1.0, 2.0]


def test_save_total_limit_keeps_the_last_versions_and_the_best(store: client.Client, tmp_path: Path) -> None:
    args = arguments(
        tmp_path / "out",
        max_steps=8,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=2,
        metric_for_best_model="loss",
    )
    trainer, _ = train(tiny_gpt2(0), args, store, "limited", evaluate=True)
    trainer.train()
    evaluated = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    assert sorted(evaluated) == [2, 4, 6, 8]
    best_step = min(evaluated, key=lambda step: evaluated[step])
    versions = store.versions("limited")
    policy = store.retention("limited")
    assert (policy.keep_last, policy.keep_best, policy.metric, policy.mode) == (2, 1, "eval_loss", "min")
    # Four versions were saved; the last two and the best by eval_loss remain.
    assert [v.step for v in versions] == sorted({6, 8, best_step})
    assert all(v.metrics["eval_loss"] == evaluated[v.step] for v in versions)


def test_best_strategy_is_refused_before_training(store: client.Client, tmp_path: Path) -> None:
    args = arguments(tmp_path / "out", save_strategy="best", eval_strategy="steps", metric_for_best_model="loss")
    trainer, _ = train(tiny_gpt2(0), args, store, "best", evaluate=True)
    with pytest.raises(client.InvalidInputError, match="save_strategy='best'"):
        trainer.train()


def test_stored_optimizer_state_loads_onto_the_accelerator_by_the_rules(store: client.Client, tmp_path: Path) -> None:
    trainer, _ = train(tiny_gpt2(0), arguments(tmp_path / "out", max_steps=3), store, "placed")
    trainer.train()
    model = tiny_gpt2(1)
    optim = transformers.Trainer(model=model, args=arguments(tmp_path / "fresh")).create_optimizer()  # 2 groups
    store.load("placed", model=model, optim=optim, device="meta")
    # The Trainer's default AdamW is fused: its step lives on the parameter's device, as float32.
    assert all(group["fused"] for group in optim.param_groups)
    states = [optim.state[p] for p in model.parameters() if p in optim.state]
    assert len(states) == len(list(model.parameters()))
    assert all(s["step"].device == META and s["step"].dtype == torch.float32 for s in states)
    assert all(s["exp_avg"].device == META and s["exp_avg_sq"].device == META for s in states)

    weights = store.load("placed", device="meta").state_dict
    assert weights is not None and all(t.device == META for t in weights.values())


peft = pytest.importorskip("peft")
from tests.client.test_lora import lora_llama  # noqa: E402  (a small Llama with a LoRA adapter)


def test_peft_versions_store_the_adapters_new_bytes_and_resume_bitwise(store: client.Client, tmp_path: Path) -> None:
    full, _ = train(lora_llama(0), arguments(tmp_path / "a"), store, "lora")
    full.train()
    first, second = store.versions("lora")
    params = list(full.model.named_parameters())
    frozen = sum(p.numel() * p.element_size() for _, p in params if not p.requires_grad)
    adapter = sum(p.numel() * p.element_size() for _, p in params if p.requires_grad)
    assert first.bytes_new > frozen  # the first version stores the base once
    # The second: the adapter, AdamW's two moments of it, steps and RNG state; never the base.
    assert adapter <= second.bytes_new <= 3 * adapter + 64 * 1024
    assert second.bytes_total > frozen + adapter

    fresh = lora_llama(99)
    resumed, _ = train(fresh, arguments(tmp_path / "b"), store, "lora-resumed")
    resume(resumed, "lora", 1, client=store)
    assert_same_weights(full.model, resumed.model)


def test_peft_versions_carry_each_adapters_config(store: client.Client, tmp_path: Path) -> None:
    trainer, _ = train(lora_llama(0), arguments(tmp_path / "out", max_steps=1, save_steps=1), store, "lora")
    trainer.train()
    extra = store.transport.manifest("lora", "latest").state["extra"]
    adapter = trainer.model.peft_config["default"]
    assert extra["peft_config"]["target_modules"] == sorted(adapter.target_modules) == ["q_proj", "v_proj"]
    trainer.model.save_pretrained(tmp_path / "adapter")  # the adapter_config.json PEFT writes, sets in any order
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert {**extra["peft_config"], "target_modules": None} == {**written, "target_modules": None}
    assert extra["model_config"]["model_type"] == "llama" and "peft_configs" not in extra

    model = lora_llama(0)
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["k_proj"]))
    model.set_adapter("other")
    configs = model_configs(model)
    assert configs["peft_config"]["target_modules"] == ["k_proj"]  # the active adapter's
    assert sorted(configs["peft_configs"]) == ["default", "other"]
    assert configs["peft_configs"]["default"]["target_modules"] == ["q_proj", "v_proj"]
