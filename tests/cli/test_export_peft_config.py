"""``export --format peft`` writes ``adapter_config.json`` byte for byte as PEFT's own ``save_pretrained``
writes it for the same config: keys sorted except in ``rank_pattern``/``alpha_pattern`` (kept in their
order), indented by 2, and no newline at the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

peft = pytest.importorskip("peft")  # the .[transformers] extra brings it; installed in CI

from ckptstore.client.formats.export_formats import peft_config_text  # noqa: E402
from tests.cli.conftest import Cli  # noqa: E402
from tests.client.test_lora import lora_llama  # noqa: E402


def reference(tmp_path: Path, **changes: object) -> Path:
    """A PEFT folder PEFT wrote itself, with ``changes`` to its LoRA config."""
    model = lora_llama(seed=0)
    config = model.peft_config["default"]
    for name, value in changes.items():
        setattr(config, name, value)
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "changes",
    [{}, {"rank_pattern": {"v_proj": 2, "layers.0.q_proj": 8}, "alpha_pattern": {"z": 4, "a": 16}}],
    ids=["plain", "patterns-in-their-order"],
)
def test_an_imported_adapter_exports_peft_s_own_bytes(cli: Cli, tmp_path: Path, changes: dict[str, object]) -> None:
    folder = reference(tmp_path, **changes)
    written = (folder / "adapter_config.json").read_bytes()
    assert not written.endswith(b"\n")
    cli.ok("import", folder, "lora")
    cli.ok("export", "lora", tmp_path / "out", "--format", "peft")
    assert (tmp_path / "out" / "adapter_config.json").read_bytes() == written


def test_a_saved_config_exports_peft_s_own_bytes(cli: Cli, tmp_path: Path) -> None:
    folder = reference(tmp_path, rank_pattern={"v_proj": 2, "q_proj": 8})
    written = (folder / "adapter_config.json").read_bytes()
    model = lora_llama(seed=0)
    cli.client.save("lora", model, extra={"peft_config": json.loads(written)})
    cli.ok("export", "lora", tmp_path / "out", "--format", "peft")
    assert (tmp_path / "out" / "adapter_config.json").read_bytes() == written
    assert peft_config_text(json.loads(written)).encode() == written
