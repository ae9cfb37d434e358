"""An embedded client never imports the HTTP transport or httpx: saving, saving in the background
and loading on a local store load nothing a server's clients need."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, torch
from ckptstore.client import Client
with Client(home=sys.argv[1]) as ckpt:
    model = torch.nn.Linear(8, 8)
    ckpt.save("run", model)
    with torch.no_grad():
        model.weight.add_(1.0)
    ckpt.save("run", model, blocking=False).result()
    loaded = torch.nn.Linear(8, 8)
    ckpt.load("run", model=loaded)
    assert torch.equal(loaded.weight, model.weight)
http = sorted(name for name in sys.modules if name == "httpx" or name.startswith("ckptstore.client.http"))
print("IMPORTED:" + ",".join(http))
"""


def test_an_embedded_client_saves_and_loads_without_importing_the_http_transport(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "home")],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "CKPTSTORE_URL"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    marker = [line for line in done.stdout.splitlines() if line.startswith("IMPORTED:")]
    assert marker == ["IMPORTED:"], done.stdout
