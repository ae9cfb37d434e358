"""load(keys=[globs]): only the selected tensors are read (their bytes and no others), strictly
within the subset; the rest of the model is untouched; optimizer state for those parameters only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptstore import client
from ckptstore.service.errors import InvalidInputError, StateMismatchError
from tests.client.models import TinyNet, tensors_equal
from tests.client.test_lora import lora_llama, train_steps
from tests.client.wrapping import compiled, trained


@pytest.fixture
def ckpt(tmp_path: Path) -> Iterator[client.Client]:
    with client.Client(home=tmp_path / "store") as embedded:
        yield embedded


def _nbytes(ckpt: client.Client, run: str, wanted: object) -> int:
    """Bytes of the distinct stored tensors whose keys are ``wanted`` (equal ones are read once)."""
    manifest = ckpt.transport.manifest(run, "latest")
    return sum({e.digest: e.nbytes for e in manifest.tensors if wanted(e.key)}.values())  # type: ignore[operator]


def test_adapter_only_load_reads_only_the_adapter(ckpt: client.Client) -> None:
    model = lora_llama(seed=0)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train_steps(model, optim, range(2))
    ckpt.save("lora", model, optim)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_state = {
        n: {k: v.clone() for k, v in optim.state[p].items()} for n, p in model.named_parameters() if p in optim.state
    }

    other = lora_llama(seed=1)  # other base weights and other adapters
    before = {k: v.clone() for k, v in other.state_dict().items()}
    other_optim = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-3)
    result = ckpt.load("lora", model=other, optim=other_optim, keys=["*lora_*"])

    lora = [k for k in saved if "lora_" in k]
    assert lora and len(lora) < len(saved) / 2
    for name, value in other.state_dict().items():
        expected = saved[name] if "lora_" in name else before[name]
        assert tensors_equal(value, expected), name
    assert not tensors_equal(before[lora[0]], saved[lora[0]])  # the comparison is not vacuous
    for name, param in other.named_parameters():
        if param.requires_grad:
            for key, value in saved_state[name].items():
                assert tensors_equal(other_optim.state[param][key], value), (name, key)
    expected_bytes = _nbytes(ckpt, "lora", lambda key: "lora_" in key)
    assert result.bytes_read == expected_bytes
    assert expected_bytes < _nbytes(ckpt, "lora", lambda key: True) / 10


def test_partial_load_is_strict_within_the_subset(ckpt: client.Client) -> None:
    model, optim = trained()
    ckpt.save("net", model, optim)
    target = TinyNet(seed=3)
    target.body[3] = torch.nn.Linear(32, 16, bias=False)  # body.3.bias is gone from the target
    with pytest.raises(StateMismatchError, match=r"unexpected keys \(1\): body.3.bias") as caught:
        ckpt.load("net", model=target, keys=["body.*"])
    assert caught.value.unexpected_keys == ["body.3.bias"] and caught.value.missing_keys == []
    result = ckpt.load("net", model=target, keys=["body.*"], strict=False)
    assert result.unexpected_keys == ["body.3.bias"]
    assert tensors_equal(target.body[0].weight, model.body[0].weight)
    # outside the subset nothing differs from a plain load that fails: the embedding is untouched
    assert not tensors_equal(target.embed.weight, model.embed.weight)


def test_patterns_select_canonical_names_through_wrappers(ckpt: client.Client) -> None:
    model, optim = trained()
    ckpt.save("net", compiled(model), optim)
    target = compiled(TinyNet(seed=4))
    result = ckpt.load("net", model=target, keys=["norm.*", "bn.running_*"])
    assert result.bytes_read == _nbytes(ckpt, "net", lambda k: k.startswith(("model/norm.", "model/bn.running_")))
    assert tensors_equal(target.norm.weight, model.norm.weight)
    assert not tensors_equal(target.bn.weight, model.bn.weight)


def test_state_dict_of_a_subset(ckpt: client.Client) -> None:
    model, _ = trained()
    ckpt.save("net", model)
    result = ckpt.load("net", keys=["body.0.*"])
    assert result.state_dict is not None and list(result.state_dict) == ["body.0.weight", "body.0.bias"]
    assert result.bytes_read == _nbytes(ckpt, "net", lambda k: k.startswith("model/body.0."))


def test_optimizer_must_cover_exactly_the_selected_parameters(ckpt: client.Client) -> None:
    model, optim = trained()
    ckpt.save("net", model, optim)
    target = TinyNet(seed=5)
    whole = torch.optim.AdamW(target.parameters(), lr=1e-2)
    with pytest.raises(StateMismatchError, match="not in checkpoint: .*embed.weight"):
        ckpt.load("net", model=target, optim=whole, keys=["body.*"])
    body = torch.optim.AdamW(target.body.parameters(), lr=1e-2)
    ckpt.load("net", model=target, optim=body, keys=["body.*"])
    assert tensors_equal(body.state[target.body[0].weight]["exp_avg"], optim.state[model.body[0].weight]["exp_avg"])


@pytest.mark.parametrize(
    ("keys", "message"),
    [("body.*", "list of glob patterns"), ([], "selects nothing"), (["nothing.*"], "match no tensor")],
)
def test_bad_patterns_are_refused(ckpt: client.Client, keys: object, message: str) -> None:
    model, _ = trained()
    ckpt.save("net", model)
    with pytest.raises(InvalidInputError, match=message):
        ckpt.load("net", model=TinyNet(), keys=keys)  # type: ignore[arg-type]
