"""Adapters: frozen base weights are stored once; every version is complete and loads strictly."""

from __future__ import annotations

import pytest
import torch

from ckptstore import client
from tests.client.models import tensors_equal

pytestmark = pytest.mark.slow  # trains Llama-shaped adapters over many versions, on every backend

transformers = pytest.importorskip("transformers")  # a declared test dependency; installed in CI
peft = pytest.importorskip("peft")


def lora_llama(seed: int, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> torch.nn.Module:
    """A small Llama built from a config (no downloads) wrapped with a peft LoRA adapter."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    base = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0)
    model = peft.get_peft_model(base, lora)
    # Non-zero adapter B matrices, so a wrong load would show.
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model


def train_steps(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 512, (2, 16), generator=generator)
        optim.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optim.step()


def trainable_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    adapter = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = sum(v.numel() * v.element_size() for s in optim.state.values() for v in s.values() if torch.is_tensor(v))
    return adapter + state


def test_adapter_versions_store_only_what_changed(ckpt: client.Client) -> None:
    model = lora_llama(seed=0)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train_steps(model, optim, range(1))
    first = ckpt.save("lora", model, optim, step=1)
    assert first.bytes_new > 0.9 * first.bytes_total
    budget = trainable_bytes(model, optim)
    assert budget < 0.1 * first.bytes_total, "the adapter must be a small share of the model"

    hits_before = ckpt.digest_cache.hits if ckpt.digest_cache else 0
    for version in range(2, 5):
        train_steps(model, optim, range(version, version + 1))
        result = ckpt.save("lora", model, optim, step=version)
        assert result.version == version
        assert 0 < result.bytes_new <= 1.25 * budget, (result.bytes_new, budget)
        assert result.bytes_total == first.bytes_total
    assert ckpt.digest_cache is not None and ckpt.digest_cache.hits > hits_before, "frozen weights were re-hashed"

    listed = ckpt.versions("lora")
    assert [v.version for v in listed] == [1, 2, 3, 4]
    assert all(v.bytes_new <= 1.25 * budget for v in listed[1:])
    assert listed[-1].bytes_trainable < 0.1 * listed[-1].bytes_total

    # A model with *different* base weights: the version must restore every tensor, strictly.
    other = lora_llama(seed=1)
    assert not tensors_equal(
        other.state_dict()["base_model.model.model.layers.0.mlp.up_proj.weight"],
        model.state_dict()["base_model.model.model.layers.0.mlp.up_proj.weight"],
    )
    other_optim = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-3)
    result = ckpt.load("lora", model=other, optim=other_optim)
    assert result.missing_keys == [] and result.unexpected_keys == []
    expected = model.state_dict()
    for key, value in other.state_dict().items():
        assert tensors_equal(value, expected[key]), key
    train_steps(model, optim, range(10, 11))
    train_steps(other, other_optim, range(10, 11))
    for key, value in other.state_dict().items():
        assert tensors_equal(value, model.state_dict()[key]), f"training diverged after load at {key}"


def test_adapter_mismatch_is_refused_strictly_and_reported_exactly(ckpt: client.Client) -> None:
    ckpt.save("lora", lora_llama(seed=0))
    wider = lora_llama(seed=1, targets=("q_proj", "k_proj", "v_proj"))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(client.StateMismatchError) as caught:
        ckpt.load("lora", model=wider)
    # peft renames a wrapped layer's weight to base_layer.weight, so k_proj shows on both sides.
    missing, unexpected = caught.value.missing_keys, caught.value.unexpected_keys
    assert {k.split(".k_proj.")[1] for k in missing} == {
        "lora_A.default.weight",
        "lora_B.default.weight",
        "base_layer.weight",
    }
    assert {k.split(".k_proj.")[1] for k in unexpected} == {"weight"}
    assert len(missing) == 3 * 4 and len(unexpected) == 4
    assert "missing keys" in str(caught.value) and ".k_proj.lora_A" in str(caught.value)
    assert all(tensors_equal(v, before[k]) for k, v in wider.state_dict().items()), "strict failure wrote"

    loose = ckpt.load("lora", model=wider, strict=False)
    assert loose.missing_keys == missing and loose.unexpected_keys == unexpected
    assert tensors_equal(
        wider.state_dict()["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"],
        lora_llama(seed=0).state_dict()["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"],
    ), "strict=False must still load the matching keys"
    narrower = lora_llama(seed=2, targets=("q_proj",))
    report = ckpt.load("lora", model=narrower, strict=False)
    assert {k.split(".v_proj.")[1] for k in report.unexpected_keys} == {
        "lora_A.default.weight",
        "lora_B.default.weight",
        "base_layer.weight",
    }
    assert {k.split(".v_proj.")[1] for k in report.missing_keys} == {"weight"}
