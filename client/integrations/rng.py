"""Random number generator state in the trainers' layouts.

:func:`capture_rng` and :func:`restore_rng` are the client's own (:mod:`client.resume.rng`),
re-exported for the plug-ins. :func:`from_trainer_layout` reads the other layout a version may
hold: the dict ``transformers.Trainer`` writes to ``rng_state.pth`` (``python``, ``numpy`` as
``np.random.get_state()``'s tuple, ``cpu``, and ``cuda``: one device's tensor, or a list of
every device's under distributed training), as a Trainer folder imported with
``ckptstore import`` keeps it.
"""

from __future__ import annotations

from typing import Any

from ckptstore.client.resume.rng import capture_rng, restore_rng
from ckptstore.service.errors import StateMismatchError

__all__ = ["capture_rng", "from_trainer_layout", "restore_rng"]


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
