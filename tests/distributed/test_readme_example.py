"""docs/distributed.md's torchrun example runs as printed: two ranks save and load an FSDP2 model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "distributed.md"


@pytest.mark.slow
def test_readme_torchrun_example_runs(tmp_path: Path) -> None:
    text = PAGE.read_text()
    (script,) = re.findall(r"```python\n(# train_fsdp\.py.*?)```", text, re.S)
    assert "CKPTSTORE_HOME=./.ckptstore .venv/bin/torchrun --nproc-per-node 2 train_fsdp.py" in text
    (tmp_path / "train_fsdp.py").write_text(script)
    environment = {**os.environ, "CKPTSTORE_HOME": str(tmp_path / ".ckptstore"), "OMP_NUM_THREADS": "1"}
    environment["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "train_fsdp.py"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(r"version 1 saved and loaded: \d+ bytes, \d+ new", done.stdout), done.stdout
