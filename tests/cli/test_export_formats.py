"""``ckptstore export --format peft|dcp``: a PEFT adapter folder PeftModel.from_pretrained loads
onto its base, and a DCP folder dcp.load reads; both bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tests.cli.conftest import Cli
from tests.client.models import TinyNet, tensors_equal
from tests.client.test_lora import lora_llama, train_steps
from tests.client.wrapping import assert_bitwise, state_by_name, trained


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
    cli.client.save("lora", model)
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
