"""Compare ckptstore's embedded store with safetensors, torch.save and torch.distributed.checkpoint.

Every method saves and loads the same transformer-shaped state in the same run. Saves are
durable (file and directory fsynced), loads are cold (page cache dropped before each one)
where the machine allows it, and each figure is the median of ``--repeats`` runs. Peak RSS of
every load is measured in a child process (this script re-invoked with ``--child``).

    .venv/bin/python bench/compare.py --quick
    .venv/bin/python bench/compare.py --size-gib 1 --json bench/results.json

This script builds the state and runs the sections in order; each lives in its own module:

    methods.py      the methods compared (ckptstore embedded and over HTTP, safetensors,
                    torch.save, DCP, raw I/O): save, load, load into a model
    save_load.py    full saves and cold loads of every method, interleaved; each load's peak RSS
    lora.py         LoRA versions: adapter-only saves, a resumed job's save, background-save blocking
    all_changed.py  a full save after every tensor changed in place
    report.py       ratios, the results table, the footer, the targets, JSON
    common.py       what they share: the model, durable writes and cold reads, timing, the server
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch
from all_changed import time_all_changed
from common import (
    DTYPES,
    GIB,
    Bench,
    CacheDropper,
    Shape,
    build_model,
    build_optimizer,
    layers_for,
    scratch_dir,
)
from lora import time_lora
from report import (
    add_ratios,
    format_footer,
    format_table,
    format_targets,
    machine_info,
    row_order,
    targets,
    write_json,
)
from save_load import measure_rss, run_child, time_loads, time_saves


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=None, help="model size (default 1.0; 1/16 with --quick)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size d (default 1024; 512 with --quick)")
    parser.add_argument("--vocab", type=int, default=None, help="embedding rows (default 32000; 8192 with --quick)")
    parser.add_argument("--layers", type=int, default=None, help="number of blocks (default: picked from --size-gib)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--with-optimizer", action="store_true", help="also save/load AdamW state after one step")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per figure (default 5; 1 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 1; 0 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run: 64 MiB, d=512, one repeat")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="scratch folder parent (default: a temp dir on /work)"
    )
    parser.add_argument(
        "--skip-loads", action="store_true", help="time only the saves and the LoRA version (large or wide models)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.size_gib = args.size_gib if args.size_gib is not None else (1 / 16 if quick else 1.0)
    args.hidden = args.hidden or (512 if quick else 1024)
    args.vocab = args.vocab or (8192 if quick else 32000)
    args.repeats = args.repeats or (1 if quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (0 if quick else 1)
    return args


def shape_from(args: argparse.Namespace) -> Shape:
    """The model shape the options describe."""
    dtype = DTYPES[args.dtype]
    layers = args.layers or layers_for(args.size_gib * GIB, args.vocab, args.hidden, dtype)
    return Shape(args.vocab, args.hidden, layers, args.dtype, args.with_optimizer)


def run_bench(args: argparse.Namespace, shape: Shape) -> Bench:
    """Build the state, time every method, measure RSS and the LoRA version; cleans up."""
    model = build_model(shape, "random")
    target = build_model(shape, "zeros")
    workdir = scratch_dir(args.workdir)
    bench = Bench(
        shape=shape,
        repeats=args.repeats,
        warmup=args.warmup,
        workdir=workdir,
        model=model,
        optim=build_optimizer(model, shape, torch.Generator().manual_seed(0)),
        target=target,
        target_optim=build_optimizer(target, shape),
        dropper=CacheDropper(),
    )
    try:
        print(
            f"state {bench.total_bytes / GIB:.3f} GiB in {workdir}; cold reads via {bench.dropper.method}",
            file=sys.stderr,
        )
        phases = (time_saves, time_lora) if args.skip_loads else (time_saves, time_loads, measure_rss, time_lora)
        phases += (time_all_changed,)
        for phase in phases:
            print(f"{time.strftime('%H:%M:%S')} {phase.__name__}", file=sys.stderr, flush=True)
            phase(bench)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    bench.rows.sort(key=row_order)
    add_ratios(bench.rows)
    return bench


def main(argv: list[str] | None = None) -> None:
    """Run the comparison (or, with --child, one measured load)."""
    args = parse_args(argv)
    shape = shape_from(args)
    if args.child:
        run_child(args, shape)
        return
    machine = machine_info()
    bench = run_bench(args, shape)
    print(format_table(bench.rows))
    print()
    print(format_footer(bench, machine))
    print()
    print(format_targets(targets(bench)))
    if args.json is not None:
        write_json(args.json, bench, machine)


if __name__ == "__main__":
    main()
