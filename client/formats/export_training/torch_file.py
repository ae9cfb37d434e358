"""The one writer of pickled files in the product: plain training state written with ``torch.save``.

The formats a user leaves for (a ``.pt`` training checkpoint, a Lightning ``.ckpt``, a Trainer's
``optimizer.pt``) are ``torch.save`` files, so an export must write one. What it writes is data
only, checked before a byte is written: dicts (string or integer keys), lists, tuples, tensors
(dense, on the CPU), ``bool``/``int``/``float``/``str``/``None``, and, where asked for, numpy
arrays of plain numeric dtypes (a Trainer's ``rng_state.pth`` holds numpy's generator state as
one). So every file loads with ``torch.load`` and ``weights_only=True`` (numpy arrays under the
``safe_globals`` the Trainer uses), never needing a general unpickler. Reading pickled files
stays with :mod:`client.formats.pickled.reader`.

Each file is written as ``.<name>.<uuid>.incomplete``, flushed and renamed into place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ckptstore.client.formats.exporting import written_atomically
from ckptstore.service.errors import StateEncodingError

_PLAIN = (bool, int, float, str, type(None))
_NUMPY_KINDS = frozenset("biuf?")


def check_plain(value: Any, path: str = "", *, numpy_arrays: bool = False) -> None:
    """Refuse anything in ``value`` that is not plain data (see the module docstring), naming its path.

    Raises:
        StateEncodingError: ``path/...`` holds a value of another type, or a tensor that is not
            a dense CPU tensor.
    """
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, _PLAIN):
            continue
        if type(node) in (torch.Tensor, torch.nn.Parameter):
            if node.layout != torch.strided or node.device.type != "cpu":
                raise StateEncodingError(f"{where or '/'}: a {node.layout} tensor on {node.device}, not a CPU tensor")
            continue
        if type(node) is dict:
            for key, child in node.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise StateEncodingError(f"{where or '/'}: a key of type {type(key).__name__}")
                stack.append((child, f"{where}/{key}"))
        elif type(node) in (list, tuple):
            stack.extend((child, f"{where}/{index}") for index, child in enumerate(node))
        elif numpy_arrays and type(node).__module__ == "numpy" and type(node).__name__ == "ndarray":
            if node.dtype.kind not in _NUMPY_KINDS:
                raise StateEncodingError(f"{where or '/'}: a numpy array of dtype {node.dtype}, not numbers")
        else:
            raise StateEncodingError(f"{where or '/'}: a {type(node).__name__}, not plain data")


def write_torch_file(path: Path, value: Any, *, numpy_arrays: bool = False) -> int:
    """Write plain ``value`` to ``path`` as ``torch.save`` does, atomically; returns the file's size.

    Raises:
        StateEncodingError: ``value`` holds something other than plain data (nothing is written).
    """
    check_plain(value, numpy_arrays=numpy_arrays)
    with written_atomically(path) as handle:
        torch.save(value, handle)  # noqa: TID251 - the export's target format; plain data, checked above
    return path.stat().st_size
