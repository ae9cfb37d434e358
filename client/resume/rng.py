"""Random number generator state as tensors and JSON, so a resumed run draws what it would have.

Python's ``random`` state is a tuple of ints (JSON); NumPy's legacy global state becomes a
uint32 tensor plus JSON; torch's CPU generator and each CUDA device's are byte tensors
(``torch.cuda.get_rng_state_all()``, one per device, when CUDA is available). The result goes
into a version's ``resume`` section (:mod:`client.resume.section`), or a plug-in's ``extra``,
and comes back through :func:`restore_rng`.

:func:`to_json` and :func:`from_json` write the same state as plain JSON (torch's states as
base64 text, the rest as numbers), as a version's ``resume`` section keeps it: a few kilobytes
that differ at every save, so as tensors they would add new bytes and a shard to every version.
"""

from __future__ import annotations

import base64
import binascii
import random
from typing import Any

import numpy as np
import torch

from ckptstore.service.errors import StateMismatchError


def capture_rng() -> dict[str, Any]:
    """The state of Python's, NumPy's, torch's CPU and (when present) every CUDA generator."""
    kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.array(keys, dtype=np.uint32)),
            "pos": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    # A process that never touched CUDA has drawn nothing from its generators: asking for their
    # state would create a context on every device, so it is recorded once CUDA is initialized.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the generators :func:`capture_rng` described (CUDA's only when CUDA is present).

    ``state["cuda"]`` is a list of every device's state, or one tensor: the current device's
    (what a single-process Trainer saves). A list goes to the devices it and this process both
    have (device ``i`` gets state ``i``), so a resume on fewer devices restores the ones it has.

    Raises:
        StateMismatchError: ``state`` is not what :func:`capture_rng` returns.
    """
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        numpy = state["numpy"]
        keys = numpy["keys"].cpu().numpy().astype(np.uint32)
        np.random.set_state((numpy["kind"], keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
        torch.set_rng_state(state["torch"].cpu())
        cuda = state.get("cuda")
        if cuda is not None and torch.cuda.is_available():
            if isinstance(cuda, torch.Tensor):
                torch.cuda.set_rng_state(cuda.cpu())
            else:
                for index, device_state in enumerate(cuda[: torch.cuda.device_count()]):
                    torch.cuda.set_rng_state(device_state.cpu(), index)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as exc:
        raise StateMismatchError(f"stored random number generator state is malformed: {exc!r}") from exc


def _text(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().contiguous().numpy().tobytes()).decode("ascii")


def _bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def to_json(state: dict[str, Any]) -> dict[str, Any]:
    """:func:`capture_rng`'s ``state`` as plain JSON values (:func:`from_json` reads it back)."""
    version, internal, gauss = state["python"]
    numpy = state["numpy"]
    written: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {**numpy, "keys": [int(key) for key in numpy["keys"].tolist()]},
        "torch": _text(state["torch"]),
    }
    if "cuda" in state:
        written["cuda"] = [_text(device_state) for device_state in state["cuda"]]
    return written


def from_json(written: Any) -> dict[str, Any]:
    """The state :func:`to_json` wrote, in :func:`capture_rng`'s layout (for :func:`restore_rng`).

    Raises:
        StateMismatchError: ``written`` is not what :func:`to_json` writes.
    """
    try:
        python = written["python"]
        numpy = written["numpy"]
        state: dict[str, Any] = {
            "python": (python["version"], tuple(python["state"]), python["gauss"]),
            "numpy": {**numpy, "keys": torch.tensor(numpy["keys"], dtype=torch.int64)},
            "torch": _bytes(written["torch"]),
        }
        if "cuda" in written:
            state["cuda"] = [_bytes(text) for text in written["cuda"]]
    except (KeyError, TypeError, ValueError, binascii.Error, RuntimeError, OverflowError) as exc:
        raise StateMismatchError(f"stored random number generator state is malformed: {exc!r}") from exc
    return state
