"""PEFT adapters beyond plain LoRA through ``ckptstore import`` and ``export --format peft``: DoRA's
magnitude vectors, LoRA on an embedding (with the embedding layer PEFT saves beside it) and
``modules_to_save`` copies. Each folder ``save_pretrained`` writes comes back out with PEFT's own
tensors under PEFT's own names, ``PeftModel.from_pretrained`` of the export gives the original's
outputs bit for bit, and ``client.load`` puts the imported adapter into a PeftModel strictly. A
PeftModel saved with ``client.save`` exports the same folder with no ``--peft-config``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

peft = pytest.importorskip("peft")  # the .[peft] extra; installed in CI
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from ckptstore.client.formats.hf.peft_names import export_names, file_name, model_names  # noqa: E402
from tests.cli.conftest import Cli  # noqa: E402
from tests.client.models import tensors_equal  # noqa: E402

VOCAB = 64
KINDS: dict[str, dict[str, Any]] = {
    "lora": {"target_modules": ["q_proj", "v_proj"]},
    "dora": {"target_modules": ["q_proj", "v_proj"], "use_dora": True},
    "embedding": {"target_modules": ["embed_tokens", "q_proj"]},
    "modules-to-save": {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
    "all-at-once": {"target_modules": ["embed_tokens", "q_proj"], "use_dora": True, "modules_to_save": ["lm_head"]},
}
#: What each kind's adapter file holds besides plain LoRA tensors (by name ending).
EXTRA_TENSORS = {
    "lora": set(),
    "dora": {"lora_magnitude_vector"},
    "embedding": {"lora_embedding_A", "lora_embedding_B", "embed_tokens.base_layer.weight"},
    "modules-to-save": {"lm_head.weight"},
    "all-at-once": {"lora_magnitude_vector", "lora_embedding_A", "embed_tokens.base_layer.weight", "lm_head.weight"},
}


def base_model() -> torch.nn.Module:
    """A 2-layer Llama of width 32 built from a config (nothing downloaded); the same weights each call."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


def adapted(kind: str, seed: int) -> torch.nn.Module:
    """The base with a ``kind`` adapter whose every trainable tensor is moved off its initial value
    (a LoRA B of zeros, a magnitude equal to the weight norms or a copy equal to its original
    would hide a load that missed them)."""
    model = peft.get_peft_model(base_model(), peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, **KINDS[kind]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model.eval()


def outputs(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=tokens).logits


def unordered(config: dict[str, Any]) -> dict[str, Any]:
    """An adapter config with its module list as a set (PEFT keeps it as one)."""
    return {**config, "target_modules": set(config["target_modules"])}


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's trainable tensors (the adapter), by state_dict name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_peft_folder_of_each_kind_round_trips_bit_for_bit(cli: Cli, tmp_path: Path, kind: str) -> None:
    model = adapted(kind, seed=1)
    expected = outputs(model)
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    theirs = load_file(saved / "adapter_model.safetensors")
    assert all(any(name.endswith(end) for name in theirs) for end in EXTRA_TENSORS[kind])

    report = json.loads(cli.ok("import", saved, "adapter", "--json"))
    assert report["model_tensors"] == len(theirs) and report["extra"] == ["peft_config"]
    manifest = cli.client.transport.manifest("adapter", "latest")
    stored = {e.key.removeprefix("model/") for e in manifest.tensors if e.key.startswith("model/")}
    names = set(model.state_dict())
    assert stored <= names, sorted(stored - names)  # the names a PeftModel's state_dict uses
    assert adapter_state(model).keys() <= stored

    out = tmp_path / "exported"
    cli.ok("export", "adapter", out, "--format", "peft")
    ours = load_file(out / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(tensors_equal(ours[k], v) for k, v in theirs.items())
    restored = peft.PeftModel.from_pretrained(base_model(), out).eval()
    assert tensors_equal(outputs(restored), expected)

    # Into a PeftModel on its base, strictly for what the adapter holds.
    fresh = adapted(kind, seed=2)
    assert not tensors_equal(outputs(fresh), expected)
    copies = ["*.modules_to_save.*"] if "modules_to_save" in KINDS[kind] else []
    cli.client.load("adapter", model=fresh, keys=["*lora_*", *copies])
    assert tensors_equal(outputs(fresh), expected)


@pytest.mark.parametrize("kind", ["dora", "embedding", "modules-to-save", "all-at-once"])
def test_a_saved_peft_model_exports_what_save_pretrained_writes_with_its_own_config(
    cli: Cli, tmp_path: Path, kind: str
) -> None:
    """``client.save`` of the whole PeftModel (base, ``original_module`` copies and all) records its
    adapter config; the export picks the adapter's tensors as PEFT does and needs no --peft-config."""
    model = adapted(kind, seed=1)
    model.save_pretrained(tmp_path / "saved")
    cli.client.save("whole", model)
    extra = cli.client.transport.manifest("whole", "latest").state["extra"]
    written = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert unordered(extra["peft_config"]) == unordered(written)  # PEFT writes a set's items in any order

    out = tmp_path / "exported"
    cli.ok("export", "whole", out, "--format", "peft")
    theirs = load_file(tmp_path / "saved" / "adapter_model.safetensors")
    ours = load_file(out / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(tensors_equal(ours[k], v) for k, v in theirs.items())
    assert unordered(json.loads((out / "adapter_config.json").read_text())) == unordered(written)
    assert tensors_equal(outputs(peft.PeftModel.from_pretrained(base_model(), out).eval()), outputs(model))


def test_a_tensor_of_no_known_kind_is_refused_by_name(cli: Cli, tmp_path: Path) -> None:
    model = adapted("modules-to-save", seed=1)
    model.save_pretrained(tmp_path / "saved")
    config_path = tmp_path / "saved" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["modules_to_save"] = None  # the lm_head copy is now a tensor the adapter does not explain
    config_path.write_text(json.dumps(config))
    failed = cli("import", tmp_path / "saved", "run")
    assert failed.exit_code == 2 and "'base_model.model.lm_head.weight' is not a LoRA tensor" in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1 and cli.client.runs() == []


PARTS = ["model", "layers", "0", "1", "self_attn", "q_proj", "mlp", "up"]
MODULE = st.lists(st.sampled_from(PARTS), min_size=1, max_size=5)


@given(
    module=MODULE,
    part=st.sampled_from(["lora_A", "lora_B", "lora_embedding_A", "lora_magnitude_vector", "modules_to_save"]),
    adapter=st.sampled_from(["default", "other"]),
)
def test_file_and_model_names_invert_each_other(module: list[str], part: str, adapter: str) -> None:
    """Every adapter tensor name a PeftModel may hold maps to PEFT's file name and back."""
    prefix = ".".join(["base_model", "model", *module])
    model_name = {
        "lora_A": f"{prefix}.lora_A.{adapter}.weight",
        "lora_B": f"{prefix}.lora_B.{adapter}.weight",
        "lora_embedding_A": f"{prefix}.lora_embedding_A.{adapter}",
        "lora_magnitude_vector": f"{prefix}.lora_magnitude_vector.{adapter}.weight",
        "modules_to_save": f"{prefix}.modules_to_save.{adapter}.weight",
    }[part]
    saved = file_name(model_name, adapter)
    assert saved is not None and adapter not in saved.split(".")[len(prefix.split(".")) :]
    assert file_name(model_name, "another") is None
    assert model_names([saved], [".".join(module)] if part == "modules_to_save" else [], adapter) == {saved: model_name}
    assert export_names([model_name, f"{prefix}.original_module.weight"], adapter) == {model_name: saved}
