"""Non-tensor state as JSON: optimizer hyperparameters, scheduler counters, user extras.

JSON has no tuples, non-string keys, NaN or tensors, so those are written as one-key
marker objects that decode back to the original Python values:

    (0.9, 0.999)        -> {"__tuple__": [0.9, 0.999]}
    float("inf")        -> {"__float__": "inf"}
    {3: "a"}            -> {"__dict__": [[3, "a"]]}
    torch.bfloat16      -> {"__dtype__": "bfloat16"}
    torch.device("cpu") -> {"__device__": "cpu"}
    a tensor            -> {"__tensor__": "<its manifest key>"}

Anything else is refused with a StateEncodingError naming its path; nothing is pickled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ckptstore.client.keys import escape
from ckptstore.service.errors import StateEncodingError
from ckptstore.service.format.manifest import TENSOR_REF

TUPLE, FLOAT, DICT, DTYPE, DEVICE = "__tuple__", "__float__", "__dict__", "__dtype__", "__device__"
MARKERS = {TENSOR_REF, TUPLE, FLOAT, DICT, DTYPE, DEVICE}
_INT64 = (-(2**63), 2**63 - 1)

#: Values encoded as they are, whatever their path (bool, str, None; not int or float: bounds).
_PLAIN_SCALARS = frozenset({bool, str, type(None)})
#: Tensor types handed to the sink at once (a subclass goes through encode, and is refused there).
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})

TensorSink = Callable[[torch.Tensor, str], str]
TensorSource = Callable[[str], torch.Tensor]


def encode(value: Any, path: str, on_tensor: TensorSink) -> Any:
    """Encode ``value`` (found at ``path``) as JSON; ``on_tensor`` stores a tensor, returns its key."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise StateEncodingError(f"{path}: integer {value} does not fit in 64 bits")
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {FLOAT: repr(value)}
    if isinstance(value, torch.Tensor):
        return {TENSOR_REF: on_tensor(value, path)}
    if isinstance(value, tuple):
        return {TUPLE: [encode(v, f"{path}/{i}", on_tensor) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}/{i}", on_tensor) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in MARKERS):
            return _encode_str_dict(value, path, on_tensor)
        return {
            DICT: [
                [encode(k, f"{path}/~key{i}", on_tensor), encode(v, f"{path}/{escape(k)}", on_tensor)]
                for i, (k, v) in enumerate(value.items())
            ]
        }
    if isinstance(value, torch.dtype):
        return {DTYPE: str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {DEVICE: str(value)}
    raise StateEncodingError(
        f"{path}: cannot store a value of type {type(value).__module__}.{type(value).__qualname__}; "
        "checkpoints hold JSON values, tuples, dicts and tensors only (never pickle). "
        "Convert it to one of those, or keep it out of the state you save"
    )


def _encode_str_dict(value: dict[str, Any], path: str, on_tensor: TensorSink) -> dict[str, Any]:
    """:func:`encode` of a dict with string keys. Its plain scalars and tensors (all of an
    optimizer's per-parameter state) are encoded here, without a call each: a save encodes
    one such dict per parameter."""
    encoded: dict[str, Any] = {}
    for key, item in value.items():
        kind = type(item)
        if kind in _PLAIN_SCALARS:
            encoded[key] = item
        elif kind in _PLAIN_TENSORS:
            encoded[key] = {TENSOR_REF: on_tensor(item, f"{path}/{escape(key)}")}
        else:
            encoded[key] = encode(item, f"{path}/{escape(key)}", on_tensor)
    return encoded


def decode(value: Any, tensor_for: TensorSource) -> Any:
    """Rebuild the Python value written by :func:`encode`; ``tensor_for`` maps keys to tensors."""
    if isinstance(value, list):
        return [decode(v, tensor_for) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((marker, inner),) = value.items()
        if marker == TENSOR_REF:
            return tensor_for(inner)
        if marker == TUPLE:
            return tuple(decode(v, tensor_for) for v in inner)
        if marker == FLOAT:
            return float(inner)
        if marker == DICT:
            return {_hashable(decode(k, tensor_for)): decode(v, tensor_for) for k, v in inner}
        if marker == DTYPE:
            dtype = getattr(torch, inner, None)
            if not isinstance(dtype, torch.dtype):
                raise StateEncodingError(f"unknown dtype {inner!r} in stored state")
            return dtype
        if marker == DEVICE:
            return torch.device(inner)
    return {k: decode(v, tensor_for) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(_hashable(k) for k in key)
    return key
