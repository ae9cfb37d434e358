"""LoRA versions: freeze the base, add adapters, save, change only the adapters, save again.

Rows ``save_lora_v2`` (the same client: its digest cache skips hashing the frozen base),
``save_lora_v2_new_client`` (re-hashes the base, writes only what changed) and
``save_lora_v2_resumed`` (a new client loads, steps, saves), each over a fresh store per repeat;
also how long a background save blocks the caller against a plain clone of the trainable state
(in the footer and the targets). Runs after the full saves and loads: it adds adapters to the model.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any

import torch
from common import (
    GIB,
    MIB,
    RUN_ID,
    Bench,
    Row,
    Transformer,
    fake_step,
    fresh_folder,
    optim_tensors,
    tensor_bytes,
    timed,
)
from torch import nn

from ckptstore.client import Client

#: Share of the model's parameters the LoRA adapters train (the rank is chosen to match it).
LORA_SHARE = 0.01
PROJECTIONS = ("q", "k", "v", "o")


def lora_rank(model: Transformer, share: float = LORA_SHARE) -> int:
    """The adapter rank whose A/B pairs on every attention projection train ``share`` of the model."""
    d = model.blocks[0].q.weight.shape[1]
    per_rank = len(model.blocks) * len(PROJECTIONS) * 2 * d
    return max(1, round(share * sum(p.numel() for p in model.parameters()) / per_rank))


def add_adapters(model: Transformer, rank: int) -> list[nn.Parameter]:
    """Freeze the model and give every attention projection a trainable rank-``rank`` A/B pair."""
    model.requires_grad_(False)
    adapters = []
    for block in model.blocks:
        for name in PROJECTIONS:
            weight = getattr(block, name).weight
            a = nn.Parameter(torch.randn(rank, weight.shape[1], dtype=weight.dtype) * 0.01)
            b = nn.Parameter(torch.zeros(weight.shape[0], rank, dtype=weight.dtype))
            block.register_parameter(f"{name}_lora_A", a)
            block.register_parameter(f"{name}_lora_B", b)
            adapters += [a, b]
    return adapters


LORA_SAVES = {
    "save_lora_v2": "LoRA v2, same client (digest cache); GB/s and ratio over the full logical state",
    "save_lora_v2_new_client": "LoRA v2, new client (re-hashes the frozen base)",
    "save_lora_v2_resumed": "LoRA v2, resumed job: a new client loads the model, steps, saves",
}


def lora_round(bench: Bench, adapters: list[nn.Parameter], optim: torch.optim.Optimizer) -> dict[str, Any]:
    """One fresh store: a full save, an adapter-only change saved by the same client, another saved
    by a new client; returns ``name -> (seconds, SaveResult)``."""
    generator = torch.Generator().manual_seed(1)
    home = fresh_folder(bench.workdir / "lora")
    outcome = {}
    with Client(home=home) as client:
        for name in ("save_lora_v1", "save_lora_v2"):
            fake_step(optim, adapters, generator)
            os.sync()
            outcome[name] = timed(lambda: client.save(RUN_ID, bench.model, optim))
    fake_step(optim, adapters, generator)
    os.sync()
    with Client(home=home) as client:
        outcome["save_lora_v2_new_client"] = timed(lambda: client.save(RUN_ID, bench.model, optim))
    with Client(home=home) as client:  # as a resumed process: load (teaches the cache), step, save
        client.load(RUN_ID, model=bench.model, optim=optim)
        fake_step(optim, adapters, generator)
        os.sync()
        outcome["save_lora_v2_resumed"] = timed(lambda: client.save(RUN_ID, bench.model, optim))
        # The time a training loop waits for a background save, against a plain copy of what it
        # must not read live (the adapters and their optimizer state), each right after a step.
        # The first background save of a process also allocates its staging buffers; the loop
        # waits for that once, then for the copies into them.
        for name in ("lora_blocked_first", "lora_blocked"):
            fake_step(optim, adapters, generator)
            gc.collect()  # as timed() does
            started = time.perf_counter()
            handle = client.save(RUN_ID, bench.model, optim, blocking=False)
            outcome[name] = (time.perf_counter() - started, handle.result())
    fake_step(optim, adapters, generator)
    trainable = [*adapters, *optim_tensors(optim)]
    outcome["lora_plain_copy"] = timed(lambda: [t.clone() for t in trainable])
    return outcome


def time_lora(bench: Bench) -> None:
    """Freeze the base, add adapters, save (v1), change only the adapters, save again.

    The second save comes once from the same client, whose digest cache skips re-hashing the
    frozen base, and once from a new client (as a resumed process would), which re-hashes the
    base but still writes only what changed. The adapters' AdamW state is saved with them.
    """
    adapters = add_adapters(bench.model, lora_rank(bench.model))
    optim = torch.optim.AdamW(adapters, lr=1e-4)
    results = [lora_round(bench, adapters, optim) for _ in range(bench.repeats)]
    last = results[-1]
    total = last["save_lora_v1"][1].bytes_total
    bench.lora = {
        "adapter_bytes": tensor_bytes(adapters),
        "adapter_share": sum(a.numel() for a in adapters) / sum(p.numel() for p in bench.model.parameters()),
        "rank": adapters[0].shape[0],
        "bytes_total": total,
    }
    for name in last:
        bytes_new = getattr(last[name][1], "bytes_new", 0)  # a plain copy stores nothing
        bench.lora[name] = {"seconds": [r[name][0] for r in results], "bytes_new": bytes_new}
    for name, note in LORA_SAVES.items():
        bench.rows.append(Row("ckptstore", name, bench.lora[name]["seconds"], total, note=note))


def lora_line(bench: Bench) -> str:
    """The footer's LoRA summary: adapters, bytes written, times against the first full save."""
    lora = bench.lora
    full = next(r.median for r in bench.rows if r.method == "ckptstore" and r.operation == "save")
    v2, fresh = lora["save_lora_v2"], lora["save_lora_v2_new_client"]
    return (
        f"LoRA: rank {lora['rank']} on {', '.join(PROJECTIONS)}, {lora['adapter_share']:.2%} of the parameters "
        f"trainable, adapters {lora['adapter_bytes'] / MIB:.2f} MiB + AdamW state; "
        f"v2 wrote {v2['bytes_new'] / MIB:.2f} MiB of {lora['bytes_total'] / GIB:.3f} GiB and took "
        f"{statistics.median(v2['seconds']) / full:.3f}x the time of the first full save "
        f"({statistics.median(fresh['seconds']) / full:.3f}x from a new client); a background save blocked "
        f"the caller {statistics.median(lora['lora_blocked']['seconds']) * 1e3:.1f} ms "
        f"({statistics.median(lora['lora_blocked_first']['seconds']) * 1e3:.1f} ms for the first, which "
        "allocates the staging buffers) against "
        f"{statistics.median(lora['lora_plain_copy']['seconds']) * 1e3:.1f} ms for a plain clone of the "
        "trainable state"
    )
