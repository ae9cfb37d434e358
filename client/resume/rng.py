"""Random number generator state as tensors and JSON, so a resumed run draws what it would have.

Python's ``random`` state is a tuple of ints (JSON); NumPy's legacy global state becomes a
uint32 tensor plus JSON; torch's CPU generator and each CUDA device's are byte tensors
(``torch.cuda.get_rng_state_all()``, one per device, when CUDA is available). The result goes
into a version's ``resume`` section (:mod:`client.resume.section`), or a plug-in's ``extra``,
and comes back through :func:`restore_rng`.
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
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise StateMismatchError(f"stored random number generator state is malformed: {exc!r}") from exc
