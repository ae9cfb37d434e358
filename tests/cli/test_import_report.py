"""What ``ckptstore import`` says it stored and left out, for files and folders alike."""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch

from ckptstore.client.formats.importing import UNREAD_FILE, UNREAD_FOLDER
from tests.cli.conftest import Cli


def test_a_folder_reports_every_file_it_did_not_read(cli: Cli, tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    safetensors.torch.save_file({"w": torch.ones(3)}, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "notes").mkdir()
    reported = json.loads(cli.ok("import", folder, "run", "--json"))
    assert reported["left_out"] == {"notes": UNREAD_FOLDER, "tokenizer.json": UNREAD_FILE}
    assert reported["model_tensors"] == 1 and reported["optimizer_parameters"] is None
    text = cli.ok("import", folder, "run")
    assert "stored: model: 1 tensor" in text and "left out: tokenizer.json (not read" in text


def test_a_sharded_folder_reads_every_shard_its_index_names(cli: Cli, tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    safetensors.torch.save_file({"a": torch.ones(3)}, str(folder / "model-00001-of-00002.safetensors"))
    safetensors.torch.save_file({"b": torch.zeros(2)}, str(folder / "model-00002-of-00002.safetensors"))
    safetensors.torch.save_file({"c": torch.zeros(2)}, str(folder / "stale.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    reported = json.loads(cli.ok("import", folder, "run", "--json"))
    assert reported["left_out"] == {"stale.safetensors": UNREAD_FILE} and reported["model_tensors"] == 2


def test_a_single_file_has_nothing_left_out(cli: Cli, tmp_path: Path) -> None:
    source = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"w": torch.ones(3)}, str(source))
    reported = json.loads(cli.ok("import", source, "run", "--json"))
    assert reported["left_out"] == {} and reported["step"] is None and reported["extra"] == []
