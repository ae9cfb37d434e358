"""The saving processes of tests/faults/test_gc_beside_saves.py: they import torch and the client
only, so that each starts in a few seconds."""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

import torch
from torch import nn

from ckptstore import client
from ckptstore.service.errors import MissingTensorsError

#: Versions each saving process saves.
VERSIONS = 5


class Adapted(nn.Module):
    """A frozen base every saver shares (the same seed) and trainable layers of its own, each
    stored in a shard of its own (the savers' shards are small): a save stores several shards
    one after another before it commits."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(96, 96)
        self.base.requires_grad_(False)
        torch.manual_seed(seed)
        self.layers = nn.Sequential(*(nn.Linear(96, 96) for _ in range(4)))
        self.head = nn.Linear(96, 4)

    def step(self, generator: torch.Generator) -> None:
        """One change of the trainable tensors, as a training step makes."""
        with torch.no_grad():
            for param in self.layers.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.01)


def fingerprints(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """SHA-256 of each tensor's bytes, with its dtype and shape."""
    found = {}
    for key, tensor in state.items():
        data = tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        found[key] = hashlib.sha256(f"{tensor.dtype}{list(tensor.shape)}".encode() + data).hexdigest()
    return found


def counting_refusals(ckpt: client.Client) -> list[int]:
    """Count the commits the store refuses for missing tensors (each would make the save send again)."""
    refused = [0]
    real = ckpt.transport.commit

    def commit(*args: Any, **kwargs: Any) -> Any:
        try:
            return real(*args, **kwargs)
        except MissingTensorsError:
            refused[0] += 1
            raise

    ckpt.transport.commit = commit  # type: ignore[method-assign]
    return refused


# -- child processes -------------------------------------------------------------------------


def open_child_client(where: dict[str, str], **options: Any) -> client.Client:
    """The client a child saves with: the embedded home, or the database and blobs the environment names."""
    if "home" in where:
        return client.Client(home=where["home"], **options)
    os.environ.update(where)
    return client.Client(**options)


def saver(where: dict[str, str], index: int, out: Any) -> None:
    """Save :data:`VERSIONS` versions of an Adapted model to run ``saver-<index>``; report each
    version's fingerprints, the errors and the refused commits."""
    errors: list[str] = []
    versions: dict[int, dict[str, str]] = {}
    refused = [0]
    try:
        # The first saver hands its saves to a save process: that path must hold too.
        with open_child_client(where, shard_bytes=16 << 10, background="process" if index == 0 else None) as ckpt:
            refused = counting_refusals(ckpt)
            model = Adapted(seed=index + 1)
            generator = torch.Generator().manual_seed(index)
            for step in range(VERSIONS):
                model.step(generator)
                try:
                    result = ckpt.save(f"saver-{index}", model, step=step)
                    versions[result.version] = fingerprints(model.state_dict())
                except Exception as exc:  # reported to the test, which fails on any
                    errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        out.put(("saver", index, errors, refused[0], versions))


def stored_then_killed(home: str, out: Any) -> None:
    """Save once and, at the commit, say so and wait to be killed (the test kills this process)."""
    with client.Client(home=home) as ckpt:

        def never(*args: Any, **kwargs: Any) -> Any:
            out.put("stored")
            threading.Event().wait()  # nobody sets it: this process is killed here

        ckpt.transport.commit = never  # type: ignore[method-assign]
        ckpt.save("killed", Adapted(seed=9))
