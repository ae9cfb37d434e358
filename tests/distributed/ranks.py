"""Running a function on N real processes joined by a gloo process group (CPU).

Each rank is a fresh interpreter (``spawn``), joined through a ``file://`` rendezvous in a
temporary folder; its return value, or its traceback, comes back through a queue.
"""

from __future__ import annotations

import os
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

#: How long a test waits for its ranks; a rank stuck past it fails the test.
RANK_TIMEOUT = 240


def run_ranks(world: int, scratch: Path, target: Callable[..., Any], *args: Any) -> list[Any]:
    """``target(rank, world, *args)`` on ``world`` processes; returns their results by rank."""
    started = start_ranks(world, scratch, target, *args)
    try:
        answers = dict(started.results.get(timeout=RANK_TIMEOUT) for _ in range(world))
    finally:
        started.join()
    failures = [answer[1] for answer in answers.values() if answer[0] == "error"]
    assert not failures, "a rank failed:\n" + "\n".join(failures)
    return [_unpacked(answers[rank][1]) for rank in range(world)]


@dataclass
class StartedRanks:
    """Ranks running: their processes, the queue their answers come by, and a queue of events
    the ranks may send the test (passed to ``target`` after ``args``)."""

    processes: list[Any]
    results: Any
    events: Any

    def result(self, rank: int) -> Any:
        """The answer of ``rank`` (other ranks' answers arriving first are dropped)."""
        while True:
            answered, (status, value) = self.results.get(timeout=RANK_TIMEOUT)
            if answered == rank:
                assert status == "ok", value
                return _unpacked(value)

    def join(self) -> None:
        """Wait for every process to end; kill any still running after 30 s."""
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()


def start_ranks(
    world: int, scratch: Path, target: Callable[..., Any], *args: Any, extra_queue: bool = False
) -> StartedRanks:
    """Start ``target(rank, world, *args)`` (plus the events queue with ``extra_queue``) on ``world`` processes."""
    context = mp.get_context("spawn")
    results, events = context.Queue(), context.Queue()
    rendezvous = scratch / f"rendezvous-{uuid.uuid4().hex}"
    arguments = (*args, events) if extra_queue else args
    processes = [
        context.Process(target=_rank_main, args=(rank, world, str(rendezvous), results, target, arguments))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    return StartedRanks(processes, results, events)


class _PackedTensor:
    """A tensor as bytes: torch's queue would share its memory, which dies with the rank."""

    def __init__(self, tensor: Any) -> None:
        from ckptstore.client.tensors import byte_view, host_contiguous

        self.dtype = str(tensor.dtype).removeprefix("torch.")
        self.shape = list(tensor.shape)
        self.data = bytes(byte_view(host_contiguous(tensor, "result")))

    def unpacked(self) -> Any:
        import torch

        tensor = torch.empty(self.shape, dtype=getattr(torch, self.dtype))
        if self.data:
            tensor.view(-1).view(torch.uint8)[:] = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return tensor


def _packed(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return _PackedTensor(value)
    if isinstance(value, dict):
        return {k: _packed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_packed(v) for v in value]
    return value


def _unpacked(value: Any) -> Any:
    if isinstance(value, _PackedTensor):
        return value.unpacked()
    if isinstance(value, dict):
        return {k: _unpacked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unpacked(v) for v in value]
    return value


def _rank_main(
    rank: int, world: int, rendezvous: str, results: Any, target: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    import torch
    import torch.distributed as dist

    os.environ["CKPTSTORE_DISABLE_PROGRESS_BARS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )
        answer: tuple[str, Any] = ("ok", _packed(target(rank, world, *args)))
    except BaseException:
        answer = ("error", f"rank {rank}:\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    results.put((rank, answer))
