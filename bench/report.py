"""What bench/compare.py prints and records: ratios, the results table, the footer, the targets, JSON.

The machine description (CPU, memory, versions, commit, first-touch cost) and ``add_ratios`` are
also used by bench/gpu.py.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch
from all_changed import all_changed_line
from common import GIB, LOAD, LOAD_INTO, MIB, Bench, Row, timed
from lora import lora_line
from methods import METHODS
from save_load import floor_line

from ckptstore.client import Client
from ckptstore.service.format.sharding import DEFAULT_SHARD_BYTES


def add_ratios(rows: list[Row]) -> None:
    """Each row's median time over safetensors' for the same operation (LoRA saves: vs full save)."""
    base = {row.operation: row.median for row in rows if row.method == "safetensors"}
    for row in rows:
        reference = base.get(row.operation) or base.get("save" if row.operation.startswith("save") else "")
        row.ratio = row.median / reference if reference else None


def run_text(command: list[str]) -> str:
    """A command's stripped output, or '' if it fails."""
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def code_commit(code: Path) -> str:
    """The short commit of the checkout holding ``code``, marked '+dirty' if tracked files differ."""
    commit = run_text(["git", "-C", str(code), "rev-parse", "--short", "HEAD"])
    if not commit:
        return "unknown"
    changed = run_text(["git", "-C", str(code), "status", "--porcelain", "--untracked-files=no"])
    return commit + ("+dirty" if changed else "")


def fill_gbps(nbytes: int = 256 * MIB, tries: int = 3) -> tuple[float, float]:
    """Best GB/s of filling fresh memory (first touch, page faults) and of filling it again.

    On some VMs (e.g. with balloon free-page reporting) first touch is many times slower
    than memory bandwidth; every method that allocates memory or page cache pays it.
    """
    fresh = resident = 0.0
    for _ in range(tries):
        seconds, buffer = timed(lambda: torch.empty(nbytes, dtype=torch.uint8).fill_(1))
        fresh = max(fresh, nbytes / seconds / 1e9)
        seconds, _ = timed(lambda buffer=buffer: buffer.fill_(2))
        resident = max(resident, nbytes / seconds / 1e9)
        del buffer
    return fresh, resident


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, library versions, commit and code location, first-touch cost."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    code = Path(sys.modules[Client.__module__].__file__ or ".").resolve().parent.parent
    commit = code_commit(code)
    fresh, resident = fill_gbps()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "commit": commit,
        "code": str(code),
        "fill_fresh_gbps": round(fresh, 2),
        "fill_resident_gbps": round(resident, 2),
    }


def format_table(rows: list[Row]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| method | operation | seconds (median) | min-max s | GB/s | vs safetensors | peak RSS MiB | note |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
        rss = f"{row.peak_rss_mib:.0f}" if row.peak_rss_mib is not None else "-"
        spread = f"{min(row.seconds):.2f}-{max(row.seconds):.2f}"
        cells = [row.method, row.operation, f"{row.median:.3f}", spread, f"{row.gbps:.2f}", ratio, rss, row.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_footer(bench: Bench, machine: dict[str, Any]) -> str:
    """Machine, state size, cache-drop method, then each section's summary line."""
    shape = bench.shape
    return "\n".join(
        [
            f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB RAM; "
            f"torch {machine['torch']}, safetensors {machine['safetensors']}, python {machine['python']}; "
            f"commit {machine['commit']}; ckptstore code from {machine['code']}; "
            f"memory fill {machine['fill_fresh_gbps']} GB/s fresh (page faults) "
            f"vs {machine['fill_resident_gbps']} GB/s resident",
            f"state: model {bench.model_bytes / GIB:.3f} GiB ({shape.layers} layers, d={shape.hidden}, "
            f"vocab={shape.vocab}, {shape.dtype}), optimizer {(bench.total_bytes - bench.model_bytes) / GIB:.3f} GiB; "
            f"median of {bench.repeats} after {bench.warmup} warm-up; cold reads via {bench.dropper.method}; "
            "GB/s = logical bytes / 1e9 / s",
            lora_line(bench),
            *all_changed_line(bench),
            *([floor_line(bench)] if any(r.operation == LOAD_INTO for r in bench.rows) else []),
        ]
    )


@dataclass
class Target:
    """One performance target: a measured figure against its floor (and goal)."""

    what: str
    value: float
    floor: float
    goal: float | None = None
    at_most: bool = False  # True: the figure must stay at or below the floor

    @property
    def met(self) -> bool:
        """Whether the floor is met."""
        return self.value <= self.floor if self.at_most else self.value >= self.floor


def targets(bench: Bench) -> list[Target]:
    """The figures the benchmark is meant to keep in line, computed from this run's medians.

    Speeds are ratios of times (other's seconds / ours), so 1.25 means 1.25x as fast.
    """
    t = {(r.method, r.operation): r.median for r in bench.rows}
    rss = {(r.method, r.operation): r.peak_rss_mib for r in bench.rows}
    full = t[("ckptstore", "save")]
    save_targets = [
        Target("embedded save speed vs safetensors save_file+fsync", t[("safetensors", "save")] / full, 0.8, 1.0),
        Target(
            "LoRA v2 save time / first full save time (same client)",
            statistics.median(bench.lora["save_lora_v2"]["seconds"]) / full,
            0.10,
            at_most=True,
        ),
        Target(
            "resumed LoRA v2 save time / first full save time (new client after a load)",
            statistics.median(bench.lora["save_lora_v2_resumed"]["seconds"]) / full,
            0.10,
            at_most=True,
        ),
        Target(
            "LoRA caller blocked by a background save / first full save time",
            statistics.median(bench.lora["lora_blocked"]["seconds"]) / full,
            0.02,
            at_most=True,
        ),
        Target(
            "LoRA caller blocked by a background save / plain clone of the trainable state",
            statistics.median(bench.lora["lora_blocked"]["seconds"])
            / statistics.median(bench.lora["lora_plain_copy"]["seconds"]),
            1.5,
            at_most=True,
        ),
        Target("HTTP save speed vs embedded", full / t[("ckptstore-http", "save")], 0.6, 0.8),
    ]
    if ("ckptstore", LOAD_INTO) not in t:  # --skip-loads
        return save_targets
    found = [
        save_targets[0],
        Target(
            "embedded load-into-model speed vs safetensors load_file",
            t[("safetensors", LOAD)] / t[("ckptstore", LOAD_INTO)],
            0.8,
            1.0,
        ),
        Target(
            "embedded load-into-model speed vs DCP FileSystemReader into the model",
            t[("dcp", LOAD_INTO)] / t[("ckptstore", LOAD_INTO)],
            1.5,
        ),
        *save_targets[1:],
    ]
    for operation in (LOAD, LOAD_INTO):
        found.append(
            Target(
                f"HTTP {operation} speed vs embedded",
                t[("ckptstore", operation)] / t[("ckptstore-http", operation)],
                0.6,
                0.8,
            )
        )
    peak = rss.get(("ckptstore", LOAD_INTO))
    if peak is not None:
        # The child's baseline already holds the model, so what the load may add is one shard plus
        # 15% of model + shard.
        allowed = (DEFAULT_SHARD_BYTES + 0.15 * (bench.total_bytes + DEFAULT_SHARD_BYTES)) / MIB
        found.append(Target("load-into-model peak RSS above the model, MiB", peak, allowed, at_most=True))
    return found


def format_targets(found: list[Target]) -> str:
    """The targets as a Markdown table."""
    lines = ["| target | this run | floor | goal | met |", "|---|---:|---:|---:|---|"]
    for target in found:
        floor = ("<= " if target.at_most else ">= ") + f"{target.floor:.2f}"
        goal = f"{target.goal:.2f}" if target.goal is not None else "-"
        lines.append(f"| {target.what} | {target.value:.2f} | {floor} | {goal} | {'yes' if target.met else 'NO'} |")
    return "\n".join(lines)


def write_json(path: Path, bench: Bench, machine: dict[str, Any]) -> None:
    """The results as JSON for tracking over time."""
    rows = [{**asdict(row), "median": row.median, "gbps": row.gbps} for row in bench.rows]
    document = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "shape": asdict(bench.shape),
        "model_bytes": bench.model_bytes,
        "total_bytes": bench.total_bytes,
        "repeats": bench.repeats,
        "warmup": bench.warmup,
        "cache_drop": bench.dropper.method,
        "rows": rows,
        "lora": bench.lora,
        "targets": [{**asdict(t), "met": t.met} for t in targets(bench)],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def row_order(row: Row) -> tuple[int, str, int]:
    """Table order: operations in a fixed order, safetensors first, then the METHODS order."""
    operations = ["save", LOAD, LOAD_INTO]
    rank = operations.index(row.operation) if row.operation in operations else len(operations)
    return (rank, row.operation, [m.name for m in METHODS].index(row.method))
