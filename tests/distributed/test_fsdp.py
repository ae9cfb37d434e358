"""ckptstore.client.save / client.load of an FSDP2 model on real gloo ranks: exact resume, resharding
from N to M ranks and into a plain model, true dtypes, placement, dedup across versions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import client
from tests.distributed.fsdp_model import Net, full_state, open_client, placements, sharded, train
from tests.distributed.ranks import run_ranks

STEPS = 3


def _train_save_continue(rank: int, world: int, home: str) -> dict[str, Any]:
    store = open_client(home)
    net, optim = sharded(world)
    train(net, optim, rank, range(STEPS))
    result = store.save("fsdp", net, optim, step=STEPS, metrics={"loss": 1.0})
    at_save = full_state(net, optim)
    train(net, optim, rank, range(STEPS, 2 * STEPS))
    return {"version": result.version, "at_save": at_save, "final": full_state(net, optim)}


def _resume(rank: int, world: int, home: str) -> dict[str, Any]:
    store = open_client(home)
    net, optim = sharded(world)
    loaded = store.load("fsdp", model=net, optim=optim)
    where = placements(optim)
    train(net, optim, rank, range(STEPS, 2 * STEPS))
    return {"version": loaded.version, "step": loaded.step, "placements": where, "final": full_state(net, optim)}


def _load_then_save(rank: int, world: int, home: str, run_id: str, save_as: str | None) -> dict[str, torch.Tensor]:
    store = open_client(home)
    net, optim = sharded(world)
    store.load(run_id, model=net, optim=optim)
    loaded = full_state(net, optim)
    if save_as is not None:
        store.save(save_as, net, optim, step=STEPS)
    return loaded


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Two ranks train STEPS steps, save version 1 of run 'fsdp', then train STEPS more."""
    scratch = tmp_path_factory.mktemp("fsdp")
    home = scratch / "store"
    return home, run_ranks(2, scratch, _train_save_continue, str(home))


def _assert_same(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for key, tensor in expected.items():
        assert found[key].dtype == tensor.dtype, key
        assert torch.equal(found[key], tensor), key


def test_resumed_training_is_bit_exact(trained: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Fresh processes load the version and train STEPS more steps: every parameter and
    optimizer tensor equals, bit for bit, those of the run that never stopped."""
    home, uninterrupted = trained
    resumed = run_ranks(2, tmp_path, _resume, str(home))
    for rank in range(2):
        assert resumed[rank]["version"] == 1 and resumed[rank]["step"] == STEPS
        assert resumed[rank]["placements"] == {("step", "cpu"), ("exp_avg", "cpu"), ("exp_avg_sq", "cpu")}
        _assert_same(resumed[rank]["final"], uninterrupted[rank]["final"])
    # and the state did change after the save: the comparison is not vacuous
    final, at_save = uninterrupted[0]["final"], uninterrupted[0]["at_save"]
    assert not torch.equal(final["model/head.weight"], at_save["model/head.weight"])


def test_manifest_records_true_dtypes_chunks_and_placements(trained: tuple[Path, list[dict[str, Any]]]) -> None:
    """fp32 master weights under a bf16 compute policy stay F32; the bf16 buffer stays BF16;
    sharded tensors carry one chunk per rank; Adam's step is host, its moments follow the param."""
    home, _ = trained
    with client.Client(home=home) as store:
        manifest = store.transport.manifest("fsdp", 1)
    entries = {e.key: e for e in manifest.tensors}
    assert entries["model/embed.weight"].dtype == "F32"
    assert entries["model/scale"].dtype == "BF16" and entries["model/scale"].digest is not None
    assert [(c.offsets, c.shape) for c in entries["model/embed.weight"].chunks or ()] == [
        ([0, 0], [17, 16]),
        ([17, 0], [17, 16]),
    ]
    assert entries["model/embed.weight"].trainable is True
    assert (entries["optim/state/head.weight/exp_avg"].placement, entries["optim/state/head.weight/exp_avg"].param) == (
        "param",
        "head.weight",
    )
    assert entries["optim/state/head.weight/step"].placement == "host"
    assert entries["optim/state/head.weight/exp_avg_sq"].dtype == "F32"
    assert manifest.step == STEPS and manifest.metrics == {"loss": 1.0}


@pytest.mark.slow
def test_reshard_two_to_four_and_four_to_two(trained: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Four ranks load the 2-rank version (one of them holds an empty shard of head.weight) and
    save it as a 4-rank version; two ranks load that: every tensor is what was saved."""
    home, saved = trained
    expected = saved[0]["at_save"]
    for found in run_ranks(4, tmp_path, _load_then_save, str(home), "fsdp", "fsdp-4"):
        _assert_same(found, expected)
    with client.Client(home=home) as store:
        head = {e.key: e for e in store.transport.manifest("fsdp-4").tensors}["model/embed.weight"]
        assert [c.shape for c in head.chunks or ()] == [[9, 16], [9, 16], [9, 16], [7, 16]]
    for found in run_ranks(2, tmp_path, _load_then_save, str(home), "fsdp-4", None):
        _assert_same(found, expected)


def test_reshard_two_to_one(trained: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    home, saved = trained
    (found,) = run_ranks(1, tmp_path, _load_then_save, str(home), "fsdp", None)
    _assert_same(found, saved[0]["at_save"])


def test_plain_model_loads_a_sharded_version(trained: tuple[Path, list[dict[str, Any]]]) -> None:
    """A single process without torch.distributed loads the 2-rank version: chunks assembled
    into whole tensors, the optimizer state keyed by parameter name."""
    home, saved = trained
    expected = saved[0]["at_save"]
    net = Net()
    optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
    with client.Client(home=home) as store:
        result = store.load("fsdp", model=net, optim=optim)
    assert result.version == 1
    names = {id(p): name for name, p in net.named_parameters()}
    found = {f"model/{k}": v for k, v in net.state_dict().items()}
    found |= {f"optim/{names[id(p)]}/{k}": v for p, s in optim.state.items() for k, v in s.items()}
    _assert_same(found, expected)


def test_sharded_version_placed_on_meta(trained: tuple[Path, list[dict[str, Any]]]) -> None:
    """Placement rules hold for a sharded version: with device='meta' standing in for an
    accelerator, weights and moments go there, Adam's step stays on the CPU."""
    home, _ = trained
    net = Net()
    optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
    with client.Client(home=home) as store:
        store.load("fsdp", model=net, optim=optim, device="meta")
    assert {p.device.type for p in net.parameters()} == {"meta"}
    assert {(k, v.device.type) for s in optim.state.values() for k, v in s.items()} == {
        ("step", "cpu"),
        ("exp_avg", "meta"),
        ("exp_avg_sq", "meta"),
    }


def _adapter_versions(rank: int, world: int, home: str) -> list[dict[str, int]]:
    store = open_client(home)
    net, optim = sharded(world, frozen_base=True)
    results = []
    for step in range(2):
        train(net, optim, rank, range(step, step + 1))
        saved = store.save("adapter", net, optim, step=step)
        results.append({"bytes_total": saved.bytes_total, "bytes_new": saved.bytes_new})
    return results


def test_adapter_versions_store_only_changed_chunks(tmp_path: Path) -> None:
    """With the base frozen, a second version sends only the adapter's chunks and its
    optimizer state: the frozen chunks of every rank are found in the store."""
    results = run_ranks(2, tmp_path, _adapter_versions, str(tmp_path / "store"))
    first, second = results[0]
    frozen = (16 * 34 + 34 + 34 * 30 + 30) * 4
    adapter = (30 * 3 + 3) * 4
    assert first["bytes_new"] >= frozen + adapter
    # the adapter, its two Adam moments and the step scalars; none of the frozen base
    assert 3 * adapter <= second["bytes_new"] <= 3 * adapter + 2 * 4
    assert second["bytes_total"] == first["bytes_total"]
    with client.Client(home=tmp_path / "store") as store:
        versions = store.versions("adapter")
    assert [v.version for v in versions] == [1, 2]
