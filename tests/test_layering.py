"""The service never imports torch, fastapi or the client; the client owns torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib, pkgutil, sys
for blocked in ("torch", "numpy", "client", "fastapi"):
    sys.modules[blocked] = None  # any import of these now raises ImportError
import service
names = [m.name for m in pkgutil.walk_packages(service.__path__, "service.")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def test_every_service_module_imports_without_torch_or_client() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) >= 10


def test_no_pickle_anywhere_in_the_product() -> None:
    offenders = []
    for path in list((ROOT / "service").rglob("*.py")) + list((ROOT / "client").rglob("*.py")):
        text = path.read_text()
        if "import pickle" in text or "torch.load(" in text or "torch.save(" in text:
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
