"""What the format cannot hold is refused by key, in every place, before any byte is stored."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ckptstore import client
from tests.client.conftest import Backend
from tests.client.test_layouts import Holder, HoldsState, HoldsTensors


class Wrapped(torch.Tensor):
    """A tensor subclass, as wrappers such as DTensor or FakeTensor are."""


def _quietly(make: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``make`` without the warnings torch gives for its prototype and deprecated kinds."""

    def made() -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return make()

    return made


UNSTORABLE: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "complex128": (lambda: torch.zeros(3, dtype=torch.complex128), "complex128 cannot be stored"),
    "complex32": (_quietly(lambda: torch.zeros(3, dtype=torch.complex32)), "complex32 cannot be stored"),
    "float8_e8m0fnu": (lambda: torch.zeros(3, dtype=torch.float8_e8m0fnu), "float8_e8m0fnu cannot be stored"),
    "sparse_coo": (lambda: torch.eye(3).to_sparse(), "sparse_coo tensors cannot be stored"),
    "sparse_csr": (_quietly(lambda: torch.eye(3).to_sparse_csr()), "sparse_csr tensors cannot be stored"),
    "quantized": (
        _quietly(lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)),
        "quantized tensors",
    ),
    "nested": (_quietly(lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])), "nested tensors"),
    "jagged": (
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        "nested tensors cannot be stored",
    ),
    "meta": (lambda: torch.zeros(3, device="meta"), "meta tensor"),
    "subclass": (lambda: torch.zeros(3).as_subclass(Wrapped), "tensor subclass Wrapped"),
}

#: Where the odd tensor goes, and the key that names it there.
PLACES = ["model", "optim_state", "param_group", "scheduler", "extra"]
KEYS = {
    "model": "model/odd",
    "optim_state": "optim/state/w/odd",
    "param_group": "optim/param_groups/0/odd",
    "scheduler": "scheduler/odd",
    "extra": "extra/odd",
}


def _save_with(ckpt: client.Client, place: str, odd: torch.Tensor, *, blocking: bool = True) -> None:
    # Large, ordinary tensors sit beside the odd one: a save that wrote before checking would store them.
    ordinary = [torch.randn(64, 1024), torch.randn(1 << 16).to(torch.bfloat16)]
    model = Holder(ordinary)
    if place == "model":
        model.register_buffer("odd", odd)
    optim = HoldsState(model, ordinary)
    if place == "optim_state":
        optim.state[model.w]["odd"] = odd
    if place == "param_group":
        optim.param_groups[0]["odd"] = odd
    scheduler = HoldsTensors(ordinary)
    extra: dict[str, Any] = {"ordinary": ordinary}
    if place == "scheduler":
        scheduler.state_dict = lambda: {"odd": odd}  # type: ignore[method-assign]
    if place == "extra":
        extra["odd"] = odd
    saved = ckpt.save("run", model, optim, scheduler=scheduler, extra=extra, blocking=blocking)
    if isinstance(saved, client.SaveHandle):
        saved.result()


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("kind", list(UNSTORABLE))
def test_unstorable_tensors_are_refused_by_key_before_anything_is_stored(
    backend: Backend, kind: str, place: str
) -> None:
    make, reason = UNSTORABLE[kind]
    with pytest.raises(client.StateEncodingError) as raised:
        _save_with(backend.client, place, make())
    assert str(raised.value).startswith(f"{KEYS[place]}: "), str(raised.value)
    assert reason in str(raised.value)
    assert backend.client.runs() == []
    assert list(backend.blobs.list_ids()) == [], "a refused save stored shards"


def test_the_same_save_succeeds_once_the_odd_tensor_is_dense(backend: Backend) -> None:
    _save_with(backend.client, "extra", torch.eye(3).to_sparse().to_dense())
    assert [run.run_id for run in backend.client.runs()] == ["run"]


def test_a_shape_whose_strides_overflow_is_refused_by_key_before_anything_is_stored(backend: Backend) -> None:
    """No element, yet laid out contiguously its shape needs strides of 2**124: a load could not
    make it, so the manifest check refuses it, in a background save too (whose snapshot would
    otherwise fail in torch.empty)."""
    odd = torch.empty(0).as_strided([0, 2**62, 2**62], [0, 0, 0])
    for place in ("model", "extra"):
        for blocking in (True, False):
            with pytest.raises(client.InvalidManifestError) as raised:
                _save_with(backend.client, place, odd, blocking=blocking)
            message = str(raised.value)
            assert f"{KEYS[place]}: shape {list(odd.shape)} is too large" in message, message
            assert "size or strides overflow 64-bit integers" in message
    assert backend.client.runs() == []
    assert list(backend.blobs.list_ids()) == [], "a refused save stored shards"


@pytest.mark.parametrize("model", [{"w": torch.ones(3)}, [torch.ones(3)], torch.ones(3), None])
@pytest.mark.parametrize("blocking", [True, False])
def test_a_model_that_is_not_a_module_is_refused_by_its_type(backend: Backend, model: Any, blocking: bool) -> None:
    with pytest.raises(client.StateEncodingError) as raised:
        backend.client.save("run", model, blocking=blocking)
    message = str(raised.value)
    assert f"model must be a torch.nn.Module, not a {type(model).__name__}" in message
    assert "save_state_dict" in message
    assert backend.client.runs() == []
