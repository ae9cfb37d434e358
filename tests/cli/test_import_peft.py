"""``ckptstore import`` of a PEFT LoRA adapter folder: the tensors under a PeftModel's names,
trainable, the config as ``extra["peft_config"]``; ``export --format peft`` writes the folder
back byte for byte, and peft's own loader and ``client.load`` give the adapter bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")  # the .[peft] extra; installed in CI

from tests.cli.conftest import Cli  # noqa: E402
from tests.client.models import tensors_equal  # noqa: E402
from tests.client.test_lora import lora_llama, train_steps  # noqa: E402


def _base() -> torch.nn.Module:
    """The base model under the adapter (the seed that built it builds the same weights), without the adapter."""
    return lora_llama(seed=0).unload()


def _trained_adapter(folder: Path) -> torch.nn.Module:
    """A LoRA Llama trained two steps, saved by peft to ``folder``."""
    model = lora_llama(seed=0)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train_steps(model, optim, range(2))
    model.save_pretrained(folder)
    return model


def _adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def test_a_peft_folder_round_trips_through_import_and_export(cli: Cli, tmp_path: Path) -> None:
    model = _trained_adapter(tmp_path / "saved")
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    report = json.loads(cli.ok("import", tmp_path / "saved", "lora", "--json"))
    assert report["extra"] == ["peft_config"] and report["model_tensors"] == len(_adapter(model)) == 16

    manifest = cli.client.transport.manifest("lora", "latest")
    stored = {e.key.removeprefix("model/"): e for e in manifest.tensors if e.key.startswith("model/")}
    assert stored.keys() == _adapter(model).keys()  # the names a PeftModel's state_dict uses
    assert all(entry.trainable for entry in stored.values())
    saved_config = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert manifest.state["extra"]["peft_config"] == saved_config

    # Into a PeftModel on its base, strictly for the adapter.
    fresh = lora_llama(seed=3)
    assert not tensors_equal(fresh.state_dict()[next(iter(stored))], _adapter(model)[next(iter(stored))])
    cli.client.load("lora", model=fresh, keys=["*lora_*"])
    assert all(tensors_equal(fresh.state_dict()[k], v) for k, v in _adapter(model).items())

    # Out again, loaded by peft.
    out = tmp_path / "exported"
    cli.ok("export", "lora", out, "--format", "peft")
    assert json.loads((out / "adapter_config.json").read_text()) == saved_config
    restored = peft.PeftModel.from_pretrained(_base(), out)
    found = restored.state_dict()
    assert found.keys() == model.state_dict().keys()
    assert all(tensors_equal(found[k], v) for k, v in model.state_dict().items())

    # export -> import -> export writes the same bytes.
    cli.ok("import", out, "again")
    twice = tmp_path / "exported-twice"
    cli.ok("export", "again", twice, "--format", "peft")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (twice / name).read_bytes() == (out / name).read_bytes(), name


def _folder(tmp_path: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if tensors:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


LORA_A = "base_model.model.layers.0.q_proj.lora_A.weight"


@pytest.mark.parametrize(
    ("config", "tensors", "expected"),
    [
        ({"peft_type": "IA3"}, {LORA_A: torch.zeros(2, 2)}, "peft_type 'IA3'"),
        ([1, 2], {LORA_A: torch.zeros(2, 2)}, "not a JSON object"),
        ({"peft_type": "LORA"}, {"base_model.model.score.weight": torch.zeros(2)}, "not a LoRA tensor"),
        ({"peft_type": "LORA"}, {}, "no adapter_model.safetensors"),
    ],
    ids=["other-method", "not-an-object", "modules-to-save", "no-tensor-file"],
)
def test_what_is_not_a_lora_adapter_is_refused_naming_the_file(
    cli: Cli, tmp_path: Path, config: dict[str, object], tensors: dict[str, torch.Tensor], expected: str
) -> None:
    folder = _folder(tmp_path, config, tensors)
    failed = cli("import", folder, "run")
    assert failed.exit_code == 2 and expected in failed.stderr and str(folder) in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1
    assert cli.client.runs() == []


def test_a_pickled_adapter_is_refused_with_the_fix(cli: Cli, tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"peft_type": "LORA"}, {})
    (folder / "adapter_model.bin").write_bytes(b"\x80\x02}q\x00.")
    failed = cli("import", folder, "run")
    assert failed.exit_code == 2 and "safe_serialization=True" in failed.stderr


def test_training_goes_on_from_an_imported_adapter_as_from_its_folder(cli: Cli, tmp_path: Path) -> None:
    """Fine-tuning continued from the import and from peft's own load of the folder is bitwise the same."""
    _trained_adapter(tmp_path / "saved")
    cli.ok("import", tmp_path / "saved", "lora")

    theirs = peft.PeftModel.from_pretrained(_base(), tmp_path / "saved", is_trainable=True)
    ours = lora_llama(seed=0)  # the same base; its adapter is the untrained one until the load
    before = {k: v.clone() for k, v in _adapter(ours).items()}
    cli.client.load("lora", model=ours, keys=["*lora_*"])
    assert not all(tensors_equal(before[k], v) for k, v in _adapter(ours).items())
    runs = []
    for model in (theirs, ours):
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        train_steps(model, optim, range(2, 5))
        runs.append((_adapter(model), [s for s in optim.state_dict()["state"].values()]))
    (their_adapter, their_state), (our_adapter, our_state) = runs
    assert their_adapter.keys() == our_adapter.keys()
    assert all(tensors_equal(our_adapter[k], v) for k, v in their_adapter.items())
    assert len(our_state) == len(their_state) == 16
    assert all(tensors_equal(o[k], t[k]) for o, t in zip(our_state, their_state, strict=True) for k in t)


def test_a_peft_trainer_checkpoint_folder_is_refused_saying_what_to_import(cli: Cli, tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-2"
    _trained_adapter(folder)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    failed = cli("import", folder, "run")
    assert failed.exit_code == 2 and "Trainer checkpoint of a PEFT model" in failed.stderr
    assert failed.stderr.count("\n") == 1 and cli.client.runs() == []
