"""Random number generator state as tensors and JSON, so a resumed run draws what it would have.

Python's ``random`` state is a tuple of ints (JSON); NumPy's legacy global state becomes a
uint32 tensor plus JSON; torch's CPU generator and each CUDA device's are byte tensors. The
result goes into a version's ``extra`` and comes back through :func:`restore_rng`.

:func:`from_trainer_layout` reads the other layout a version may hold: the dict
``transformers.Trainer`` writes to ``rng_state.pth`` (``python``, ``numpy`` as
``np.random.get_state()``'s tuple, ``cpu``, and ``cuda``: one device's tensor, or a list of
every device's under distributed training), as a Trainer folder imported with
``ckptstore import`` keeps it.
"""

from __future__ import annotations

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
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def from_trainer_layout(state: Any) -> dict[str, Any]:
    """:func:`capture_rng`'s layout of the state ``transformers.Trainer`` saves as ``rng_state.pth``.

    Raises:
        StateMismatchError: ``state`` is not the Trainer's layout.
    """
    try:
        kind, keys, position, has_gauss, cached = state["numpy"]
        converted: dict[str, Any] = {
            "python": state["python"],
            "numpy": {"kind": kind, "keys": keys, "pos": position, "has_gauss": has_gauss, "cached_gaussian": cached},
            "torch": state["cpu"],
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise StateMismatchError(
            f"stored Trainer random number generator state is malformed (python, numpy, cpu expected): {exc!r}"
        ) from exc
    if state.get("cuda") is not None:
        converted["cuda"] = state["cuda"]
    return converted


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the generators :func:`capture_rng` described (CUDA's only when CUDA is present).

    ``state["cuda"]`` is a list of every device's state, or one tensor: the current device's
    (what a single-process Trainer saves).

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
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StateMismatchError(f"stored random number generator state is malformed: {exc!r}") from exc
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, torch.Tensor):
            torch.cuda.set_rng_state(cuda.cpu())
        else:
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
