"""The service never imports torch, fastapi or the client; the client owns torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib, pkgutil, sys
blocked = sys.argv[1].split(",")
for name in blocked:
    sys.modules[name] = None  # any import of these now raises ImportError
import service
names = [m.name for m in pkgutil.walk_packages(service.__path__, "service.")]
names = [n for n in names if sys.argv[2] == "all" or not n.startswith("service.api")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def probe(blocked: str, which: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, blocked, which], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_the_engine_imports_without_torch_fastapi_or_client() -> None:
    assert probe("torch,numpy,client,fastapi,starlette,uvicorn", "core") >= 15


def test_the_whole_service_imports_without_torch_or_client() -> None:
    assert probe("torch,numpy,client", "all") >= 25


def test_no_pickle_anywhere_in_the_product() -> None:
    offenders = []
    for path in list((ROOT / "service").rglob("*.py")) + list((ROOT / "client").rglob("*.py")):
        text = path.read_text()
        if "import pickle" in text or "torch.load(" in text or "torch.save(" in text:
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
