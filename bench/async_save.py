"""How long a training loop waits for a checkpoint: background saves and resumed jobs.

Every figure comes from the same run, on an embedded store on this machine's disk:

- the time the caller is blocked by ``save(..., blocking=False)`` against a synchronous save
  and against a plain copy (``clone``) of the same tensors, for a full model and for a LoRA-style
  model (frozen base, small trainable adapters, AdamW on the adapters);
- ``torch.distributed.checkpoint.async_save`` on the CPU (one process), blocked time and total;
- a resumed job: a new client loads the model, trains the adapters one step and saves,
  against the first full save;
- a full fine-tune (32 layers of WIDTH x WIDTH and their AdamW state) saved in the background
  after a step, from the call to the commit, on the client's thread and in a save process;
- a LoRA Llama of many modules (transformers + peft, r=8 on q_proj and v_proj, 16 layers,
  ~540 modules), saved in the background after every step: the median time the call blocks
  against a plain clone of its trainable and optimizer state after a step, and the CPU time a
  save takes in all, every thread's, from the call to its commit (and the shards it writes);
- the same loop's step time with torch on one thread (so a background thread has a core of its
  own), with a background save after every step, and with two threads of known work started
  in its place: one that sleeps (waiting costs the loop nothing) and one that runs Python
  (the loop pays for every millisecond of it: the interpreter is shared).

    .venv/bin/python bench/async_save.py                 # 512 MiB base, median of 5
    .venv/bin/python bench/async_save.py --size-mib 64 --repeats 1
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ckptstore.client import Client
from ckptstore.client.saving.cadence import RUN_LENGTH

os.environ.setdefault("CKPTSTORE_DISABLE_PROGRESS_BARS", "1")
warnings.filterwarnings("ignore", message=".*single process.*")
MIB = 1 << 20
WIDTH = 1024
RANK = 8


class Adapted(nn.Module):
    """``layers`` frozen WIDTH x WIDTH fp32 blocks, each with trainable rank-RANK adapters."""

    def __init__(self, layers: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.base.requires_grad_(False)
        self.down = nn.ParameterList(nn.Parameter(torch.randn(RANK, WIDTH) * 0.01) for _ in range(layers))
        self.up = nn.ParameterList(nn.Parameter(torch.zeros(WIDTH, RANK)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for base, down, up in zip(self.base, self.down, self.up, strict=True):
            x = base(x) + x @ down.t() @ up.t()
        return x


def step(model: Adapted, optim: torch.optim.Optimizer) -> None:
    """One training step of the adapters."""
    model(torch.randn(4, WIDTH)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def median_time(repeats: int, run: Callable[[], object], before: Callable[[], object] = lambda: None) -> float:
    """Median wall time of ``run`` over ``repeats``, ``before`` untimed ahead of each."""
    times = []
    for _ in range(repeats):
        before()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def state_tensors(model: nn.Module, optim: torch.optim.Optimizer, trainable_only: bool) -> list[torch.Tensor]:
    """The tensors a save of ``model`` and ``optim`` copies (the trainable state alone if asked)."""
    tensors = [p for p in model.parameters() if p.requires_grad or not trainable_only]
    tensors += [v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors


#: A model, its optimizer, one training step of it, and its trainable and optimizer state.
Loop = tuple[nn.Module, torch.optim.Optimizer, Callable[[], None], Callable[[], list[torch.Tensor]]]


def full_finetune_rows(root: Path, repeats: int) -> list[tuple[str, float, str]]:
    """A full fine-tune's background save after a step (every tensor of the model and its AdamW
    state changed), from the call to the commit: on the client's thread and in a save process."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(32)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train() -> None:
        model(torch.randn(8, WIDTH)).sum().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    train()
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(model, optim, False))
    rows = []
    wheres: tuple[Literal["thread", "process"], ...] = ("thread", "process")
    for where in wheres:
        with Client(home=root / f"full-{where}", background=where) as ckpt:
            ckpt.save("full", model, optim)
            ckpt.save("full", model, optim, blocking=False).result()  # staging, the helper: off the clock
            seconds = median_time(repeats, lambda: ckpt.save("full", model, optim, blocking=False).result(), train)
        note = f"{nbytes / MIB:.0f} MiB, 32 layers" if where == "thread" else ""
        rows.append((f"full fine-tune: background save to commit, {where}", seconds, note))
    return rows


def peft_llama() -> Loop | None:
    """A LoRA Llama of many modules (peft, r=8 on q_proj and v_proj, 16 layers) with AdamW, one
    step taken: (model, optim, train one step, its trainable and optimizer state); None without peft."""
    try:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=16,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(LlamaForCausalLM(config), lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=1e-4)
    tokens = torch.randint(0, 1000, (2, 32))

    def train() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    def state() -> list[torch.Tensor]:
        return trainable + [v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]

    train()
    return model, optim, train, state


def peft_llama_rows(root: Path, repeats: int) -> list[tuple[str, float, str]]:
    """Blocked time of a background save after each step of a many-module LoRA Llama, against
    a plain clone of its trainable and optimizer state (rows to print; none without peft)."""
    built = peft_llama()
    if built is None:
        return []
    model, optim, train, state = built
    blocked: list[float] = []
    cpu: list[float] = []  # every thread's, from the call until the version is committed
    shards: list[int] = []
    with Client(home=root / "peft", background="thread") as ckpt:
        ckpt.save("lora", model, optim)
        ckpt.save("lora", model, optim, blocking=False).result()  # the staging buffers, off the clock
        for _ in range(max(20, 4 * repeats)):
            train()
            started, started_cpu = time.perf_counter(), time.process_time()
            handle = ckpt.save("lora", model, optim, blocking=False)
            blocked.append(time.perf_counter() - started)
            shards.append(handle.result().shards)
            cpu.append(time.process_time() - started_cpu)
    copy = median_time(max(20, 4 * repeats), lambda: [t.clone() for t in state()], train)
    modules = sum(1 for _ in model.modules())
    nbytes = sum(t.numel() * t.element_size() for t in state())
    return [
        (f"LoRA Llama ({modules} modules): caller blocked", statistics.median(blocked), ""),
        ("LoRA Llama: plain clone of the trainable state", copy, f"{nbytes / MIB:.1f} MiB, {len(state())} tensors"),
        (
            "LoRA Llama: CPU of a save, every thread",
            statistics.median(cpu),
            f"call to commit; {statistics.median(shards):g} shards a save",
        ),
    ]


class _Busy(threading.Thread):
    """A thread that, once started, sleeps or runs Python for ``seconds`` of its own CPU time."""

    def __init__(self, seconds: float, python: bool) -> None:
        super().__init__(daemon=True)
        self.seconds, self.python = seconds, python

    def run(self) -> None:
        if not self.python:
            time.sleep(self.seconds)
            return
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass

    def result(self) -> None:
        self.join()


def loop_cost_table(root: Path, steps: int, rounds: int) -> list[str]:
    """What a background save after every step costs the LoRA Llama's loop, with torch on one
    thread so that the save's thread has a core of its own, against two threads of known work
    started after every step in its place: one sleeping, one running Python (Markdown lines)."""
    built = peft_llama()
    if built is None:
        return []
    model, optim, train, _ = built
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with (
            Client(home=root / "loop", background="thread") as ckpt,
            Client(home=root / "loop-p", background="process") as helped,
            Client(home=root / "loop-a") as default,
        ):
            for client in (ckpt, helped, default):
                client.save("lora", model, optim)
                for _ in range(
                    RUN_LENGTH
                ):  # staging, the process (the default's from its RUN_LENGTH-th): off the clock
                    client.save("lora", model, optim, blocking=False).result()

            def busy(seconds: float, python: bool) -> _Busy:
                thread = _Busy(seconds, python)
                thread.start()
                return thread

            after: dict[str, Callable[[], object]] = {
                "nothing": lambda: None,
                '`save(..., blocking=False)`, `Client(background="thread")`': lambda: ckpt.save(
                    "lora", model, optim, blocking=False
                ),
                '`save(..., blocking=False)`, `Client(background="process")`': lambda: helped.save(
                    "lora", model, optim, blocking=False
                ),
                "`save(..., blocking=False)`, `Client()` (auto)": lambda: default.save(
                    "lora", model, optim, blocking=False
                ),
                "a thread that sleeps 40 ms": lambda: busy(0.040, python=False),
                "a thread that runs 10 ms of Python": lambda: busy(0.010, python=True),
            }
            seconds: dict[str, list[float]] = {name: [] for name in after}
            for _ in range(rounds):
                for name, then in after.items():
                    gc.collect()
                    pending: Any = None
                    started = time.perf_counter()
                    for _ in range(steps):
                        train()
                        if isinstance(pending, _Busy):
                            pending.result()  # one such thread at a time (a save call waits itself, as needed)
                        pending = then()
                    seconds[name].append((time.perf_counter() - started) / steps)
                    if pending is not None:
                        pending.result()
    finally:
        torch.set_num_threads(threads)
    base = statistics.median(seconds["nothing"])
    lines = [
        f"Step time of the LoRA Llama's loop (`torch.set_num_threads(1)`), by what starts after each step "
        f"({steps} steps, median of {rounds} rounds):",
        "",
        "| after every step | step ms | more than nothing, ms |",
        "|---|---:|---:|",
    ]
    for name, values in seconds.items():
        step_s = statistics.median(values)
        more = "-" if name == "nothing" else f"{(step_s - base) * 1e3:+.1f}"
        lines.append(f"| {name} | {step_s * 1e3:.1f} | {more} |")
    return lines


def main() -> None:
    """Run every measurement and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=512, help="frozen base size (default 512)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the stores go (default: a temp folder)")
    args = parser.parse_args()
    layers = max(1, args.size_mib * MIB // (WIDTH * WIDTH * 4))
    root = Path(tempfile.mkdtemp(prefix="ckpt-async-", dir=args.dir))
    rows: list[tuple[str, float, str]] = []
    loop_lines: list[str] = []
    try:
        model = Adapted(layers)
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        step(model, optim)
        full_bytes = sum(t.numel() * t.element_size() for t in state_tensors(model, optim, False))
        counter = iter(range(10**6))

        def fresh_home() -> Path:
            return root / f"store-{next(counter)}"

        # A full first save, synchronous and in the background, each to a fresh store and client.
        saved_by: list[Client] = []  # each first save on a store opened untimed
        first_full = median_time(
            args.repeats,
            lambda: saved_by[-1].save("run", model, optim),
            lambda: saved_by.append(Client(home=fresh_home())),
        )
        for ckpt in saved_by:
            ckpt.close()
        blocked_full: list[float] = []
        for _ in range(args.repeats):
            with Client(home=fresh_home()) as ckpt:
                started = time.perf_counter()
                handle = ckpt.save("run", model, optim, blocking=False)
                blocked_full.append(time.perf_counter() - started)
                handle.result()
        copy_full = median_time(args.repeats, lambda: [t.clone() for t in state_tensors(model, optim, False)])
        rows += [
            ("full model: first save, synchronous", first_full, f"{full_bytes / MIB:.0f} MiB"),
            ("full model: caller blocked, blocking=False", statistics.median(blocked_full), ""),
            ("full model: plain clone of the same tensors", copy_full, ""),
        ]

        # LoRA steady state: the same client saves after each step.
        with Client(home=fresh_home()) as ckpt:
            ckpt.save("lora", model, optim)
            lora_sync = median_time(args.repeats, lambda: ckpt.save("lora", model, optim), lambda: step(model, optim))
            blocked_lora: list[float] = []
            for _ in range(args.repeats):
                step(model, optim)
                started = time.perf_counter()
                handle = ckpt.save("lora", model, optim, blocking=False)
                blocked_lora.append(time.perf_counter() - started)
                handle.result()
        # After a step, as the blocked times are: the step leaves the CPU's caches as a save finds them.
        copy_lora = median_time(
            args.repeats, lambda: [t.clone() for t in state_tensors(model, optim, True)], lambda: step(model, optim)
        )
        trainable_bytes = sum(t.numel() * t.element_size() for t in state_tensors(model, optim, True))
        rows += [
            ("LoRA: save after a step, synchronous", lora_sync, f"{trainable_bytes / MIB:.1f} MiB trainable"),
            ("LoRA: caller blocked, blocking=False", statistics.median(blocked_lora), ""),
            ("LoRA: plain clone of the trainable state", copy_lora, ""),
        ]

        # A resumed job: a new client (as a new process has) loads, trains one step, saves.
        home = fresh_home()
        with Client(home=home) as ckpt:
            ckpt.save("resume", model, optim)
        resumed: list[float] = []
        for _ in range(args.repeats):
            fresh = Adapted(layers, seed=1)
            fresh_optim = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
            with Client(home=home) as ckpt:
                ckpt.load("resume", model=fresh, optim=fresh_optim)
                step(fresh, fresh_optim)
                started = time.perf_counter()
                ckpt.save("resume", fresh, fresh_optim)
                resumed.append(time.perf_counter() - started)
        rows.append(("resumed job: first save after load", statistics.median(resumed), ""))

        # DCP's async_save on the CPU, one process, to a fresh folder each time.
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        blocked_dcp: list[float] = []
        total_dcp: list[float] = []
        for _ in range(args.repeats):
            folder = fresh_home()
            started = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=str(folder))
            blocked_dcp.append(time.perf_counter() - started)
            future.result()
            total_dcp.append(time.perf_counter() - started)
        rows += [
            ("DCP async_save: caller blocked", statistics.median(blocked_dcp), ""),
            ("DCP async_save: until stored", statistics.median(total_dcp), ""),
        ]
        rows += full_finetune_rows(root, args.repeats)
        rows += peft_llama_rows(root, args.repeats)
        loop_lines = loop_cost_table(root, steps=16, rounds=max(2, args.repeats // 2))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    figures = {name: seconds for name, seconds, _ in rows}
    print(f"{'what':<46} {'seconds':>9}  note")
    for name, seconds, note in rows:
        print(f"{name:<46} {seconds:>9.4f}  {note}")
    print()
    ratios = [
        ("full: blocked / plain clone", figures["full model: caller blocked, blocking=False"], copy_full, "<= 1.5"),
        (
            "LoRA: blocked / plain clone of trainable state",
            figures["LoRA: caller blocked, blocking=False"],
            copy_lora,
            "<= 1.5",
        ),
        (
            "LoRA: blocked / synchronous full save",
            figures["LoRA: caller blocked, blocking=False"],
            first_full,
            "<= 0.02",
        ),
        (
            "resumed LoRA save / first full save",
            figures["resumed job: first save after load"],
            first_full,
            "<= 0.1 (goal 0.05)",
        ),
        (
            "ckptstore blocked / DCP async_save blocked (full)",
            figures["full model: caller blocked, blocking=False"],
            figures["DCP async_save: caller blocked"],
            "lower is better",
        ),
    ]
    if "LoRA Llama: plain clone of the trainable state" in figures:
        blocked = next(seconds for name, seconds, _ in rows if name.startswith("LoRA Llama (") and "blocked" in name)
        copy = figures["LoRA Llama: plain clone of the trainable state"]
        floor = f"<= 2 (floor 4x + 2 ms: {(4 * copy + 0.002) / copy:.1f})"
        ratios.append(("LoRA Llama: blocked / plain clone", blocked, copy, floor))
    print(f"{'ratio':<50} {'value':>8}  floor")
    for name, numerator, denominator, floor in ratios:
        print(f"{name:<50} {numerator / denominator:>8.3f}  {floor}")
    if loop_lines:
        print()
        print("\n".join(loop_lines))


if __name__ == "__main__":
    main()
