"""Full saves and cold loads: every method of methods.py on the same state, in interleaved rounds.

Rows ``save``, ``load`` (a new state_dict) and ``load_into_model`` per method, each the median of
the timed rounds, every load checked against the saved values; then each load's peak RSS, measured
in a fresh process (bench/compare.py re-invoked with ``--child``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from common import (
    LOAD,
    LOAD_INTO,
    Bench,
    Row,
    Shape,
    build_model,
    build_optimizer,
    fresh_folder,
    same_state,
    same_tensors,
    state_tensors,
    timed,
)
from methods import BY_NAME, METHODS, Method

#: The script a child process runs: the entry point, which hands ``--child`` to :func:`run_child`.
ENTRY = Path(__file__).resolve().with_name("compare.py")


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------


def rounds(bench: Bench) -> Iterable[tuple[bool, list[Method]]]:
    """Per round: whether it is timed (warm-up rounds come first) and the order of the methods.

    Warm-up matters on VMs whose host backs guest memory lazily: the first pass over a
    gigabyte of fresh page cache or buffers can take several times longer than later ones.
    The order rotates every round so no method always runs right after the same other one.
    """
    for index in range(bench.warmup + bench.repeats):
        shift = index % len(METHODS)
        yield index >= bench.warmup, METHODS[shift:] + METHODS[:shift]


def time_saves(bench: Bench) -> None:
    """Median durable-save time per method; rounds interleave the methods."""
    seconds: dict[str, list[float]] = {m.name: [] for m in METHODS}
    for counted, order in rounds(bench):
        for method in order:
            path = fresh_folder(bench.folder(method.name))
            os.sync()
            elapsed = method.save(bench.model, bench.optim, path)
            if counted:
                seconds[method.name].append(elapsed)
    for method in METHODS:
        bench.rows.append(Row(method.name, "save", seconds[method.name], bench.total_bytes))


def time_loads(bench: Bench) -> None:
    """Median cold-load time per method and operation, checking every result."""
    seconds: dict[tuple[str, str], list[float]] = {}
    for counted, order in rounds(bench):
        for method in order:
            for operation in (LOAD, LOAD_INTO):
                elapsed = cold_load(bench, method, operation)
                if counted:
                    seconds.setdefault((method.name, operation), []).append(elapsed)
    for (name, operation), values in seconds.items():
        nbytes = bench.model_bytes if operation == LOAD else bench.total_bytes
        bench.rows.append(Row(name, operation, values, nbytes))


def cold_load(bench: Bench, method: Method, operation: str) -> float:
    """Seconds of one cold load by ``method``; exits if the loaded values are wrong."""
    path = bench.folder(method.name)
    if operation == LOAD:
        bench.dropper(path)
        elapsed, state = timed(lambda: method.load(path))
        correct = same_tensors(state, bench.model)
    else:
        zero_target(bench)
        bench.dropper(path)
        elapsed, _ = timed(lambda: method.load_into(path, bench.target, bench.target_optim))
        correct = same_state(bench.target, bench.target_optim, bench.model, bench.optim)
    if not correct:
        raise SystemExit(f"{method.name} {operation}: the loaded values differ from the saved ones")
    # A method that must start something first (a server) times its own load.
    return float(method.__dict__.pop("last_seconds", elapsed))


def zero_target(bench: Bench) -> None:
    """Overwrite the load target with zeros so a failed load cannot pass the check."""
    with torch.no_grad():
        for tensor in state_tensors(bench.target, bench.target_optim):
            tensor.zero_()


def child_peak_rss(bench: Bench, method: Method, operation: str) -> float:
    """Peak RSS above baseline (MiB) of one load, run in a fresh process."""
    command = [sys.executable, str(ENTRY), "--child", f"{method.name}:{operation}"]
    command += ["--child-path", str(bench.folder(method.name)), *bench.shape.child_args()]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child {method.name}:{operation} failed:\n{done.stderr}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return (report["peak_kib"] - report["baseline_kib"]) / 1024


def measure_rss(bench: Bench) -> None:
    """Fill in the peak RSS column of every load row."""
    for row in bench.rows:
        if row.operation in (LOAD, LOAD_INTO):
            row.peak_rss_mib = child_peak_rss(bench, BY_NAME[row.method], row.operation)


def floor_line(bench: Bench) -> str:
    """How close each method's load into a model comes to the device's raw read (raw-io)."""
    t = {(r.method, r.operation): r.median for r in bench.rows}
    floor = t[("raw-io", LOAD_INTO)]
    speeds = ", ".join(f"{m.name} {floor / t[(m.name, LOAD_INTO)]:.2f}x" for m in METHODS if m.name != "raw-io")
    return (
        f"I/O floor (raw-io: buffered write, no format, no hashing): save {t[('raw-io', 'save')]:.3f} s, "
        f"cold read into the model {floor:.3f} s; load-into-model speed as a share of it: {speeds}"
    )


# --------------------------------------------------------------------------------------
# Child process: one load, peak RSS
# --------------------------------------------------------------------------------------


def status_kib(field_name: str) -> int:
    """A ``kB`` field of /proc/self/status."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def run_child(args: argparse.Namespace, shape: Shape) -> None:
    """Perform one load and print its peak and baseline RSS as JSON.

    The baseline is taken after imports and, for loads into a model, after building and
    writing the model (and optimizer) that the load fills.
    """
    name, operation = args.child.split(":")
    method, path = BY_NAME[name], Path(args.child_path)
    target = optim = None
    if operation == LOAD_INTO:
        target = build_model(shape, "zeros")
        optim = build_optimizer(target, shape)
    reset = reset_peak_rss()
    baseline = status_kib("VmRSS")
    if operation == LOAD_INTO:
        assert target is not None
        method.load_into(path, target, optim)
    else:
        method.load(path)
    peak = status_kib("VmHWM") if reset else max(status_kib("VmHWM"), baseline)
    print(json.dumps({"peak_kib": peak, "baseline_kib": baseline, "hwm_reset": reset}))
