"""A full save after every tensor changed in place, as the next save of full fine-tuning makes.

Row ``save_all_changed``: a fresh store per repeat, a first full save, every floating-point tensor
nudged in place, then the same client saves again, so every tensor goes to the store unhashed and
is read once. Runs last: it changes the model.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from common import RUN_ID, Bench, Row, fresh_folder, timed
from torch import nn

from ckptstore.client import Client

ALL_CHANGED = "save_all_changed"


def nudge(model: nn.Module) -> None:
    """Change every floating-point tensor of ``model`` in place, as a step of full fine-tuning does."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.mul_(1.0 + 2.0**-10)


def all_changed_round(bench: Bench) -> tuple[float, Any]:
    """One fresh store: a full save, every tensor changed in place, the same client saves again."""
    home = fresh_folder(bench.workdir / "all-changed")
    with Client(home=home) as client:
        client.save(RUN_ID, bench.model)
        nudge(bench.model)
        os.sync()
        return timed(lambda: client.save(RUN_ID, bench.model))


def time_all_changed(bench: Bench) -> None:
    """The next save of a fully trained model: every tensor changed since the client's last save,
    so each goes to the store unhashed and is read once. Runs last: it changes the model."""
    results = [all_changed_round(bench) for _ in range(bench.repeats)]
    nbytes = results[-1][1].bytes_total
    note = "every tensor changed in place since the same client's last save (written unhashed)"
    bench.rows.append(Row("ckptstore", ALL_CHANGED, [seconds for seconds, _ in results], nbytes, note=note))


def all_changed_line(bench: Bench) -> list[str]:
    """The save after every tensor changed, against the first full save (none if not measured)."""
    t = {(r.method, r.operation): r.median for r in bench.rows}
    if ("ckptstore", ALL_CHANGED) not in t:
        return []
    full, again = t[("ckptstore", "save")], t[("ckptstore", ALL_CHANGED)]
    return [f"every tensor changed, same client: {again:.3f} s, {again / full:.2f}x the first full save ({full:.3f} s)"]
