"""The wrapped-model, import and export examples of docs/ run as printed."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from tests.cli.conftest import Cli

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: Lines naming sources a reader brings (a Trainer run, a LoRA run, an Accelerate run, a training
#: run); tests/cli/test_import_formats.py, test_export_formats.py, test_import_accelerate.py and
#: test_export_training_*.py run those paths on real ones.
BROUGHT = ("out/checkpoint-500", "my-lora", "my-acc-run", "my-run ", "my-finetune")


def _blocks(page: str, heading: str, language: str) -> list[str]:
    text = (DOCS / page).read_text()
    start = text.index(f"\n{heading}\n")
    ends = [i for i in (text.find("\n## ", start + 1), text.find("\n### ", start + 1)) if i > 0]
    section = text[start : min(ends) if ends else None]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_partial_load_example(cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPTSTORE_HOME", cli.env["CKPTSTORE_HOME"] or "")
    (code,) = _blocks("saving-and-loading.md", "## Wrapped models and partial loads", "python")
    exec(compile(code, "saving-and-loading.md", "exec"), {})
    assert cli.client.load("partial-demo", keys=["1.*"]).bytes_read == 40


def test_import_and_export_commands(cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (code,) = _blocks("import-export.md", "## Import", "python")
    exec(compile(code, "import-export.md", "exec"), {})
    lines = [
        line
        for block in _blocks("import-export.md", "## Import", "bash") + _blocks("import-export.md", "## Export", "bash")
        for line in block.splitlines()
    ]
    ran = 0
    for line in lines:
        if any(source in line for source in BROUGHT):
            continue
        words = shlex.split(line, comments=True)
        assert words[0] == "ckptstore"
        cli.ok(*words[1:])
        ran += 1
    assert ran == 6
    assert {r.run_id for r in cli.client.runs()} == {"from-pt", "from-training", "from-dcp"}
    assert cli.client.versions("from-training")[0].metrics == {"loss": 0.5}
    assert cli.client.load("from-training").extra == {"epoch": 1, "loss": 0.5}
    assert os.path.isfile(tmp_path / "dcp-folder" / ".metadata")
