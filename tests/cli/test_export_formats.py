"""``ckptstore export --format peft|dcp``: a PEFT adapter folder PeftModel.from_pretrained loads
onto its base, and a DCP folder dcp.load reads; both bitwise. Versions the Trainer plug-in saved
carry their configs: the Hugging Face export writes ``config.json`` (from_pretrained loads the
folder) and the PEFT export the adapter's config."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import torch
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ckptstore.client.integrations.transformers import CkptstoreCallback
from tests.cli.conftest import Cli
from tests.client.models import TinyNet, tensors_equal
from tests.client.test_lora import lora_llama, train_steps
from tests.client.wrapping import assert_bitwise, state_by_name, trained
from tests.integrations.hf_kit import Tokens, arguments, tiny_gpt2


def _base() -> torch.nn.Module:
    """The base model under the adapter (the seed that built it builds the same weights), without the adapter."""
    fresh = lora_llama(seed=0)  # the same seed builds the same base weights
    return fresh.unload()


def test_peft_adapter_folder_loads_onto_its_base(cli: Cli, tmp_path: Path) -> None:
    model = lora_llama(seed=0)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train_steps(model, optim, range(2))
    config = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=sorted))
    cli.client.save("lora", model, optim, extra={"peft_config": config})
    out = tmp_path / "adapter"
    text = cli.ok("export", "lora", out, "--format", "peft")
    assert "as peft" in text
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    restored = peft.PeftModel.from_pretrained(_base(), out)
    expected = {k: v for k, v in model.state_dict().items()}
    found = restored.state_dict()
    assert found.keys() == expected.keys()
    assert all(tensors_equal(found[k], v) for k, v in expected.items())
    tokens = torch.arange(16).reshape(1, 16)
    assert torch.equal(restored(input_ids=tokens).logits, model(input_ids=tokens).logits)


def test_peft_export_needs_a_config(cli: Cli, tmp_path: Path) -> None:
    model = lora_llama(seed=0)
    cli.client.save_state_dict("lora", model.state_dict())  # a state_dict says nothing of its adapter
    failed = cli("export", "lora", tmp_path / "a", "--format", "peft")
    assert failed.exit_code != 0 and "peft_config" in failed.stderr
    config = tmp_path / "adapter_config.json"
    model.peft_config["default"].save_pretrained(tmp_path)  # writes adapter_config.json
    cli.ok("export", "lora", tmp_path / "b", "--format", "peft", "--peft-config", config)
    assert json.loads((tmp_path / "b" / "adapter_config.json").read_text()) == json.loads(config.read_text())


def test_dcp_folder_is_read_by_dcp_load(cli: Cli, tmp_path: Path) -> None:
    model, optim = trained()
    expected = state_by_name(model, optim)
    cli.client.save("net", model, optim)
    out = tmp_path / "dcp"
    cli.ok("export", "net", out, "--format", "dcp")
    fresh = TinyNet(seed=6)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    model_state, optim_state = get_state_dict(fresh, fresh_optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=out, no_dist=True)
    set_state_dict(fresh, fresh_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert_bitwise(state_by_name(fresh, fresh_optim), expected)


def _train_with_callback(model: torch.nn.Module, cli: Cli, output: Path) -> transformers.Trainer:
    """Three Trainer steps, the last saved as a version of ``run`` by the plug-in."""
    args = arguments(output, max_steps=3, save_steps=3)
    callbacks = [CkptstoreCallback("run", client=cli.client)]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    return trainer


def test_trainer_versions_export_a_folder_from_pretrained_loads(cli: Cli, tmp_path: Path) -> None:
    trainer = _train_with_callback(tiny_gpt2(seed=0), cli, tmp_path / "out")
    out = tmp_path / "hf"
    assert "config.json" in cli.ok("export", "run", out)

    written = json.loads((out / "config.json").read_text())
    assert written == json.loads(trainer.model.config.to_json_string(use_diff=False))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is transformers.GPT2LMHeadModel
    found, expected = loaded.state_dict(), trainer.model.state_dict()
    assert found.keys() == expected.keys()
    assert all(tensors_equal(found[k], v) for k, v in expected.items())


def test_a_version_without_a_config_exports_no_config(cli: Cli, tmp_path: Path) -> None:
    model, _ = trained()
    cli.client.save("net", model)
    out = tmp_path / "hf"
    (out / "config.json").parent.mkdir()
    result = cli("export", "net", out)
    assert result.exit_code == 0 and "has no config.json" in result.stderr
    assert not (out / "config.json").exists()


def test_peft_trainer_versions_export_their_adapter_config(cli: Cli, tmp_path: Path) -> None:
    trainer = _train_with_callback(lora_llama(seed=0), cli, tmp_path / "out")
    extra = cli.client.transport.manifest("run", "latest").state["extra"]
    assert extra["model_config"]["model_type"] == "llama"
    assert "peft_configs" not in extra  # one adapter

    out = tmp_path / "adapter"
    cli.ok("export", "run", out, "--format", "peft")  # no --peft-config: the version's own
    restored = peft.PeftModel.from_pretrained(_base(), out)
    assert restored.peft_config["default"].target_modules == trainer.model.peft_config["default"].target_modules
    found, expected = restored.state_dict(), trainer.model.state_dict()
    assert found.keys() == expected.keys()
    assert all(tensors_equal(found[k], v) for k, v in expected.items())
