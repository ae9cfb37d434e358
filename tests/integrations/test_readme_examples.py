"""The trainer plug-in examples of docs/trainers.md run as they are, on a fresh embedded store."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptstore import client

ROOT = Path(__file__).resolve().parents[2]


def example(heading: str) -> str:
    """The first python block under ``## heading`` of docs/trainers.md."""
    text = (ROOT / "docs" / "trainers.md").read_text()
    part = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", part, re.DOTALL)
    assert match is not None, f"no python example under {heading}"
    return match.group(1)


def run_example(heading: str, tmp_path: Path) -> client.Client:
    env = {**os.environ, "CKPTSTORE_HOME": str(tmp_path / "store"), "HF_HUB_OFFLINE": "1"}
    env.pop("CKPTSTORE_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", example(heading)], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return client.Client(home=tmp_path / "store")


@pytest.mark.slow
def test_lightning_example(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    with run_example("Lightning", tmp_path) as store:
        versions = store.versions("regressor")
        tags = {tag for v in versions for tag in v.tags}
        assert "last" in tags and len(versions) == 3  # the top 2 and last
        assert max(v.step or 0 for v in versions) == 20  # 5 epochs of 4 steps: the resume went on
    assert not [p for p in tmp_path.rglob("*.ckpt")]


@pytest.mark.slow
def test_hugging_face_trainer_example(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    with run_example("Hugging Face Trainer", tmp_path) as store:
        versions = store.versions("gpt2-tiny")
        # Steps 4 and 8 of the first run, then the resumed run's step 8: the limit keeps the last 2.
        assert [v.step for v in versions] == [8, 8] and [v.version for v in versions] == [2, 3]
        assert store.retention("gpt2-tiny").keep_last == 2
    assert not list((tmp_path / "out").glob("checkpoint-*"))


@pytest.mark.slow
def test_accelerate_example(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    with run_example("Accelerate", tmp_path) as store:
        (version,) = store.versions("acc-demo")
        assert version.metrics == {"loss": 0.25}
        keys = {e.key for e in store.transport.manifest("acc-demo").tensors}
        assert "optim/state/0.weight/exp_avg" in keys and "extra/rng/torch" in keys
