"""``ckptstore export --format pt``: a ``torch.save`` training checkpoint that a plain loop resumes from
with ``torch.load(weights_only=True)`` bit for bit, and that ``ckptstore import`` reads back as the same
version. The optimizer goes back to torch's positional layout in the order the version recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.client.formats.export_training.version_state import positional_optimizer
from ckptstore.service.errors import StateMismatchError
from tests.cli.conftest import Cli
from tests.client.models import tensors_equal


class TwoHeads(torch.nn.Module):
    """Two layers of one shape, so only the recorded order says which state is whose."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))


def build(seed: int, reverse: bool) -> tuple[TwoHeads, torch.optim.Optimizer, Any]:
    """The model, an AdamW whose groups list the head first when ``reverse``, and a StepLR."""
    torch.manual_seed(seed)
    model = TwoHeads()
    first, second = (model.head, model.backbone) if reverse else (model.backbone, model.head)
    optim = torch.optim.AdamW(
        [{"params": list(first.parameters()), "lr": 1e-2}, {"params": list(second.parameters()), "lr": 3e-3}]
    )
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)


def train(model: TwoHeads, optim: torch.optim.Optimizer, sched: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.mse_loss(model(x), x.flip(1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        losses.append(loss.item())
    return losses


def resumed_from(path: Path, reverse: bool) -> tuple[TwoHeads, list[float]]:
    """A fresh model (other weights) resumed from ``path`` as a plain loop does, then 4 more steps."""
    model, optim, sched = build(seed=99, reverse=reverse)
    checkpoint = torch.load(path, weights_only=True)  # noqa: TID251 - reading the file as its tool does
    model.load_state_dict(checkpoint["model"])
    optim.load_state_dict(checkpoint["optimizer"])
    sched.load_state_dict(checkpoint["lr_scheduler"])
    return model, train(model, optim, sched, range(checkpoint["step"], checkpoint["step"] + 4))


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert tensors_equal(x, y), name


@pytest.mark.parametrize("reverse", [False, True], ids=["model-order", "head-first"])
def test_a_saved_version_exported_as_pt_resumes_a_plain_loop_bit_for_bit(
    cli: Cli, tmp_path: Path, reverse: bool
) -> None:
    model, optim, sched = build(seed=0, reverse=reverse)
    train(model, optim, sched, range(5))
    cli.client.save(
        "run", model, optim, scheduler=sched, step=5, extra={"epoch": 1, "note": "kept"}, metrics={"loss": 0.25}
    )
    out = tmp_path / "out" / "checkpoint.pt"
    text = cli.ok("export", "run", out, "--format", "pt")
    assert "as pt" in text and "checkpoint.pt" in text

    checkpoint = torch.load(out, weights_only=True)  # noqa: TID251 - reading the file as its tool does
    assert set(checkpoint) == {"model", "optimizer", "lr_scheduler", "step", "epoch", "note", "loss"}
    assert (checkpoint["step"], checkpoint["epoch"], checkpoint["note"], checkpoint["loss"]) == (5, 1, "kept", 0.25)
    assert checkpoint["optimizer"].keys() == optim.state_dict().keys()
    assert [g["params"] for g in checkpoint["optimizer"]["param_groups"]] == [[0, 1], [2, 3]]

    expected = train(model, optim, sched, range(5, 9))  # the original run goes on
    found, losses = resumed_from(out, reverse)
    assert losses == expected
    assert_same_weights(found, model)


def test_an_imported_pt_exported_and_imported_again_is_the_same_version(cli: Cli, tmp_path: Path) -> None:
    model, optim, sched = build(seed=0, reverse=True)
    train(model, optim, sched, range(3))
    source = tmp_path / "training.pt"
    torch.save(  # noqa: TID251 - the user's own file under test
        {"model_state_dict": model.state_dict(), "optimizer_state_dict": optim.state_dict(),
         "scheduler": sched.state_dict(), "global_step": 3, "epoch": 0, "loss": 0.5},
        source,
    )  # fmt: skip
    cli.ok("import", source, "run")
    cli.ok("export", "run", tmp_path / "again.pt", "--format", "pt")
    again = torch.load(tmp_path / "again.pt", weights_only=True)  # noqa: TID251 - reading the file as its tool does
    assert "step" not in again and again["global_step"] == 3  # the file's own step key, not a second one
    cli.ok("import", tmp_path / "again.pt", "run")

    first, second = (cli.client.transport.manifest("run", v) for v in (1, 2))
    assert first.state == second.state
    assert (first.step, first.metrics) == (second.step, second.metrics) == (3, {"loss": 0.5})
    assert [(e.key, e.digest, e.placement) for e in first.tensors] == [
        (e.key, e.digest, e.placement) for e in second.tensors
    ]
    # and the re-exported file still resumes the run, head-first groups included
    expected = train(model, optim, sched, range(3, 7))
    cli.ok("export", "run@2", tmp_path / "third.pt", "--format", "pt")
    third = torch.load(tmp_path / "third.pt", weights_only=True)  # noqa: TID251 - reading the file as its tool does
    third["step"] = third.pop("global_step")
    torch.save(third, tmp_path / "renamed.pt")  # noqa: TID251 - the user renames a key and saves again
    found, losses = resumed_from(tmp_path / "renamed.pt", reverse=True)
    assert losses == expected
    assert_same_weights(found, model)


def test_a_version_without_optimizer_exports_weights_and_extras(cli: Cli, tmp_path: Path) -> None:
    model, _, _ = build(seed=0, reverse=False)
    cli.client.save("weights", model, extra={"epoch": 2})
    cli.ok("export", "weights", tmp_path / "w.pt", "--format", "pt")
    checkpoint = torch.load(tmp_path / "w.pt", weights_only=True)  # noqa: TID251 - reading the file as its tool does
    assert set(checkpoint) == {"model", "epoch"}
    assert_same_weights_dict(checkpoint["model"], model.state_dict())


def assert_same_weights_dict(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert tensors_equal(a[name], b[name]), name


def test_export_pt_refuses_a_folder_and_an_extra_named_as_the_model(cli: Cli, tmp_path: Path) -> None:
    model, _, _ = build(seed=0, reverse=False)
    cli.client.save("run", model, extra={"state_dict": {"w": 1}})
    (tmp_path / "folder").mkdir()
    result = cli("export", "run", tmp_path / "folder", "--format", "pt")
    assert result.exit_code != 0 and "writes one file" in result.stderr
    result = cli("export", "run", tmp_path / "x.pt", "--format", "pt")
    assert result.exit_code != 0 and "extra['state_dict']" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.pt").exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 4), min_size=1, max_size=4), data=st.data())
def test_state_by_name_is_numbered_in_the_recorded_group_order(sizes: list[int], data: st.DataObject) -> None:
    names = [f"p{i}" for i in range(sum(sizes))]
    order = data.draw(st.permutations(names))
    groups, at = [], 0
    for size in sizes:
        groups.append({"lr": 0.1, "params": order[at : at + size]})
        at += size
    with_state = data.draw(st.sets(st.sampled_from(names)) if names else st.just(set()))
    decoded = {"state": {name: {"n": name} for name in with_state}, "param_groups": groups}
    numbered = positional_optimizer(decoded, "v")
    flat = [p for g in numbered["param_groups"] for p in g["params"]]
    assert flat == list(range(len(names)))
    assert {numbered["state"][order.index(n)]["n"] for n in with_state} == with_state
    for index, value in numbered["state"].items():
        assert value["n"] == order[index]


def test_state_no_group_lists_cannot_be_numbered() -> None:
    with pytest.raises(StateMismatchError, match="no param group lists"):
        positional_optimizer({"state": {"ghost": {}}, "param_groups": [{"params": ["a"]}]}, "version 1")
