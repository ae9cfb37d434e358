"""Importing the client, or the integrations package, never imports a training framework."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate", "peft")

PROBE = f"""
import sys
import ckptstore.client.api, ckptstore.client.integrations, ckptstore.client.integrations.paths
import ckptstore.client.integrations.rng, ckptstore.client.integrations.trees
loaded = sorted(m for m in {FRAMEWORKS!r} if m in sys.modules)
print(loaded)
"""


def test_frameworks_are_imported_only_by_their_own_module() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
