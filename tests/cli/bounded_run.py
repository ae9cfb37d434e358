"""Run one command under guards and report what it cost: ``python bounded_run.py REPORT SPEC``.

SPEC is JSON: ``{"argv": [...], "hang_s": 120, "kill_rss_mib": 4096, "max_file_bytes": N}``. The
command runs as this process's child; past ``hang_s`` seconds or ``kill_rss_mib`` resident it is
killed, and it may write no file larger than ``max_file_bytes``. REPORT receives JSON: ``exit_code``
(negative: the signal that ended it), ``peak_rss_kib`` (``wait4``'s ``ru_maxrss``), ``seconds`` and
``killed`` (which guard fired, or "").

Why a separate process: ``ru_maxrss`` counts the peak of the memory a process replaced at ``exec``,
so a child forked from a test runner holding hundreds of MiB would report the runner's peak. This
script holds a few MiB when it forks, so the figure is the command's own.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import sys
import time


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as status:
            found = re.search(r"^VmRSS:\s+(\d+) kB", status.read(), re.MULTILINE)
    except OSError:
        return 0.0
    return int(found.group(1)) / 1024 if found else 0.0


def main(report: str, spec: dict) -> None:
    pid = os.fork()
    if pid == 0:  # the command: a guard on file sizes, then exec
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["max_file_bytes"], spec["max_file_bytes"]))
        os.execv(spec["argv"][0], spec["argv"])
    start = time.monotonic()
    killed = ""
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        elapsed = time.monotonic() - start
        if not killed:
            if elapsed > spec["hang_s"]:
                killed = f"HUNG: killed after {spec['hang_s']} s"
            elif _rss_mib(pid) > spec["kill_rss_mib"]:
                killed = f"killed at {spec['kill_rss_mib']} MiB resident after {elapsed:.1f} s"
            if killed:
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    exit_code = os.waitstatus_to_exitcode(status)
    if exit_code == -signal.SIGXFSZ:
        killed = f"killed writing a file over {spec['max_file_bytes']} bytes"
    with open(report, "w") as out:
        json.dump(
            {
                "exit_code": exit_code,
                "peak_rss_kib": usage.ru_maxrss,
                "seconds": time.monotonic() - start,
                "killed": killed,
            },
            out,
        )


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
