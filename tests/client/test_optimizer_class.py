"""A version records its optimizer's class, and a strict load into another class is refused
before anything is written: AdamW's state in an SGD(momentum=0.9) otherwise loads without a
word and its next ``step()`` raises ``KeyError: 'momentum'`` inside torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptstore import client
from ckptstore.client import SaveHandle
from ckptstore.service.errors import InvalidManifestError, StateMismatchError
from ckptstore.service.format.manifest import validate_body
from tests.client.models import TinyNet, train


def _trained_adamw() -> tuple[TinyNet, torch.optim.Optimizer]:
    model = TinyNet(seed=1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    return model, optim


def test_a_version_records_its_optimizers_class_and_refuses_another_before_writing(ckpt: client.Client) -> None:
    model, optim = _trained_adamw()
    ckpt.save("run", model, optim)
    assert ckpt.transport.manifest("run", "latest").optimizer_class == "torch.optim.adamw.AdamW"

    other = TinyNet(seed=2)
    before = {name: tensor.clone() for name, tensor in other.state_dict().items()}
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(StateMismatchError) as refused:
        ckpt.load("run", model=other, optim=sgd)
    message = str(refused.value)
    assert "\n" not in message and "torch.optim.adamw.AdamW" in message and "torch.optim.sgd.SGD" in message
    assert "strict=False" in message
    assert all(torch.equal(before[name], tensor) for name, tensor in other.state_dict().items()), "model written"
    assert not sgd.state and sgd.param_groups[0]["momentum"] == 0.9

    ckpt.load("run", model=other, optim=sgd, strict=False)  # the user means it
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in other.state_dict().items())
    assert sgd.param_groups[0]["lr"] == optim.param_groups[0]["lr"]


def test_the_same_class_loads_and_the_save_without_an_optimizer_records_none(ckpt: client.Client) -> None:
    model, optim = _trained_adamw()
    ckpt.save("run", model, optim)
    ckpt.save("weights", model)
    assert ckpt.transport.manifest("weights", "latest").optimizer_class is None
    resumed = TinyNet(seed=3)
    resumed_optim = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    ckpt.load("run", model=resumed, optim=resumed_optim)
    assert resumed_optim.state_dict()["param_groups"] == optim.state_dict()["param_groups"]


def test_a_save_process_records_the_class_too(tmp_path: Path) -> None:
    model, optim = _trained_adamw()
    with client.Client(home=tmp_path / "home", background="process") as ckpt:
        handle = ckpt.save("run", model, optim, blocking=False)
        assert isinstance(handle, SaveHandle) and handle.result().version == 1
        assert ckpt._background.process is not None  # the helper made it
        assert ckpt.transport.manifest("run", 1).optimizer_class == "torch.optim.adamw.AdamW"


#: Dotted names as Python spells a class's module and qualified name.
CLASS_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}(\.([A-Za-z_][A-Za-z0-9_]*|<locals>)){0,6}", fullmatch=True)


@given(st.text(max_size=240) | CLASS_NAMES)
def test_a_manifest_holds_a_dotted_class_name_or_is_refused(name: str) -> None:
    plain = len(name) <= 200 and name.isascii() and all(p.isidentifier() or p == "<locals>" for p in name.split("."))
    try:
        body = validate_body({"tensors": [], "optimizer_class": name})
    except InvalidManifestError as exc:
        assert "optimizer_class" in str(exc) and not plain
        return
    assert body.optimizer_class == name and len(name) <= 200 and (name[0].isalpha() or name[0] == "_")
    assert not any(ch.isspace() or (ch.isascii() and not (ch.isalnum() or ch in "_.<>")) for ch in name)


def test_a_manifest_without_the_field_stays_valid() -> None:
    assert validate_body({"tensors": []}).optimizer_class is None
