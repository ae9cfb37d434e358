"""ckptstore: a checkpoint store for PyTorch training.

    from ckptstore import client
    client.save("my-run", model, optim, step=100)
    client.load("my-run", model=model, optim=optim, device="cuda")

``ckptstore.client`` is the Python client (torch-aware), ``ckptstore.service`` the torch-free
engine and HTTP service. ``ckptstore.save``, ``ckptstore.load`` and the rest of the client's
public names are the client's own, reached on first use, so importing ``ckptstore`` (as the
service does, being inside it) imports neither torch nor the client.

This module lives in ``client/_ckptstore/`` of the repository and is installed as the package
``ckptstore`` (``pyproject.toml`` maps the folders: ``client/`` to ``ckptstore.client``,
``service/`` to ``ckptstore.service``, ``migrations/`` to ``ckptstore.service.migrations``).
It may import nothing of its own at import time.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: The client's public names, reached as ``ckptstore.<name>`` (a test holds this to ``client.__all__``).
CLIENT_NAMES = frozenset(
    {
        "CheckpointError",
        "Client",
        "ConflictError",
        "Connection",
        "IntegrityError",
        "InvalidInputError",
        "InvalidManifestError",
        "InvalidNameError",
        "InvalidShardError",
        "LoadResult",
        "MissingTensorsError",
        "NotFoundError",
        "RunInfo",
        "SaveHandle",
        "SaveResult",
        "StateEncodingError",
        "StateMismatchError",
        "StorageError",
        "StorageFullError",
        "VersionInfo",
        "default_client",
        "load",
        "runs",
        "save",
        "versions",
    }
)


def __getattr__(name: str) -> Any:
    """The client's public names (``ckptstore.save``, ``ckptstore.Client``...), imported on first use."""
    if name in CLIENT_NAMES:
        return getattr(importlib.import_module("ckptstore.client"), name)
    raise AttributeError(f"module 'ckptstore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({"client", "service", "__version__", *CLIENT_NAMES})
