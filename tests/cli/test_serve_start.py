"""``ckptstore serve`` says where it serves only once its socket is bound and listening: the line
names the port it bound (any free one for port 0), and a port another process holds is one
error line naming the address, exit status 1, with no "serving" line before it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.api.served_process import ROOT, serve_process


def _serve(home: Path, port: int) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("CKPTSTORE_")}
    env.update(CKPTSTORE_HOME=str(home), CKPTSTORE_HOST="127.0.0.1", CKPTSTORE_PORT=str(port))
    return subprocess.run(
        [sys.executable, "-m", "ckptstore.client.cli", "serve"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # far above a refusal's time: only so a server that did start fails the test
    )


def test_a_port_in_use_is_one_error_line_naming_the_address_and_no_serving_line(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve(tmp_path / "home", port)
    assert result.returncode == 1, result
    assert "serving" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: cannot serve on http://127.0.0.1:{port}: the address is in use")


def test_the_serving_line_names_the_port_bound_and_the_server_answers_there(tmp_path: Path) -> None:
    with serve_process(tmp_path / "home") as served:
        assert httpx.get(f"{served.url}/healthz", timeout=30).status_code == 200
    log = served.log.read_text(errors="replace")
    found = re.search(r"ckptstore serving \S+ on (http://127\.0\.0\.1:\d+)\n", log)
    assert found is not None and found.group(1) == served.url, log  # not the asked-for port 0
