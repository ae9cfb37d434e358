"""Wall time of ``ckptstore ls`` (embedded store with a few versions), against bare Python and an
``import torch`` in the same run: the command must not pay for torch.

The project's modules are byte-compiled first, as ``pip install`` does: an editable install run
with ``PYTHONDONTWRITEBYTECODE`` set (as on this VM) would otherwise compile some fifty modules
from source at every start (~40 ms).

    .venv/bin/python bench/cli_start.py            # 7 runs each, medians
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LS = "from ckptstore.client.cli import app; app(['ls'], prog_name='ckptstore')"
SEED = (
    "import sys, torch, client\n"
    "with client.Client(home=sys.argv[1]) as c:\n"
    "    m = torch.nn.Linear(64, 64)\n"
    "    for step in range(3):\n"
    "        c.save('demo', m, step=step)\n"
)


ROOT = Path(__file__).resolve().parent.parent


def compile_bytecode() -> None:
    """Byte-compile ``client`` and ``service`` as an installed package has them."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(ROOT / "client"), str(ROOT / "service")],
        check=True,
        capture_output=True,
    )


def wall(code: str, env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="ckpt-cli-") as home:
        env = {**os.environ, "CKPTSTORE_HOME": str(Path(home)), "CKPTSTORE_URL": ""}
        subprocess.run([sys.executable, "-c", SEED, home], env=env, check=True)
        rows = {"python -c pass": "pass", "ckptstore ls": LS, "python -c 'import torch'": "import torch"}
        times: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(args.runs):
            for name, code in rows.items():
                times[name].append(wall(code, env))
    torch_import = statistics.median(times["python -c 'import torch'"])
    print(f"CLI start-up, wall seconds, median of {args.runs} (floor for ckptstore ls: 0.5 s)")
    print(f"{'command':<28}{'median':>8}{'min':>8}{'max':>8}{'vs import torch':>17}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<28}{median:>8.3f}{min(samples):>8.3f}{max(samples):>8.3f}{median / torch_import:>16.2f}x")


if __name__ == "__main__":
    main()
