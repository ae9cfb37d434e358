"""StoreWriter and StoreReader under torch.distributed.checkpoint, on 2 real gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ckptstore import client
from ckptstore.client.tensors import byte_view
from ckptstore.service.format.manifest import Manifest
from tests.distributed.ranks import run_ranks


def _state(mesh: Any, fill: float | None) -> dict[str, Any]:
    """A state dict with sharded fp32 and bf16 tensors, a replicated scalar and JSON values;
    with ``fill`` every tensor holds that value and every value is blanked."""
    from torch.distributed.tensor import Shard, distribute_tensor

    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(9, 5, generator=generator)
    embed = torch.randn(6, 4, generator=generator).to(torch.bfloat16)
    if fill is not None:
        weight, embed = torch.full_like(weight, fill), torch.full_like(embed, fill)
    return {
        "model": {
            "fc.weight": distribute_tensor(weight, mesh, [Shard(0)]),
            "embed.weight": distribute_tensor(embed, mesh, [Shard(1)]),
        },
        "optim": {
            "state": {"fc.weight": {"step": torch.tensor(3.0 if fill is None else fill)}},
            "param_groups": [
                {"lr": 0.1 if fill is None else 0.0, "betas": (0.9, 0.99) if fill is None else (0.0,), "params": ["x"]}
            ],
        },
        "epoch": 4 if fill is None else 0,
        "notes": {"tokens": [1, 2, 3] if fill is None else [], "name": "run" if fill is None else ""},
    }


def _round_trip(rank: int, world: int, home: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from ckptstore.client.distributed import StoreReader, StoreWriter

    store = client.Client(home=home)
    mesh = init_device_mesh("cpu", (world,))
    saved = _state(mesh, None)
    metadata = dcp.save(saved, storage_writer=StoreWriter("dcp", client=store, step=5, metrics={"loss": 0.5}))
    loaded = _state(mesh, 0.0)
    dcp.load(loaded, storage_reader=StoreReader("dcp", client=store))
    # async_save: a second version, committed when the future completes
    saved["model"]["fc.weight"].to_local().mul_(2)
    future = dcp.async_save(saved, storage_writer=StoreWriter("dcp", client=store, step=6))
    later = future.result()
    again = _state(mesh, 0.0)
    dcp.load(again, storage_reader=StoreReader("dcp", 2, client=store))
    return {
        "version": metadata.storage_data.version,
        "async_version": later.storage_data.version,
        "equal": all(
            torch.equal(loaded["model"][k].full_tensor(), saved_full)
            for k, saved_full in [
                ("fc.weight", _state(mesh, None)["model"]["fc.weight"].full_tensor()),
                ("embed.weight", saved["model"]["embed.weight"].full_tensor()),
            ]
        ),
        "async_equal": torch.equal(
            again["model"]["fc.weight"].full_tensor(), saved["model"]["fc.weight"].full_tensor()
        ),
        "values": [
            loaded["epoch"],
            loaded["notes"],
            loaded["optim"]["param_groups"],
            float(loaded["optim"]["state"]["fc.weight"]["step"]),
        ],
    }


def test_dcp_save_and_load_round_trip_with_async_save(tmp_path: Path) -> None:
    """Two ranks dcp.save into one embedded store, dcp.load back every value, and async_save a
    second version; the manifest is ordinary JSON with chunks tiling each sharded tensor."""
    home = tmp_path / "store"
    results = run_ranks(2, tmp_path, _round_trip, str(home))
    assert [r["version"] for r in results] == [1, 1]
    assert [r["async_version"] for r in results] == [2, 2]
    assert all(r["equal"] and r["async_equal"] for r in results)
    epoch, notes, groups, step = results[0]["values"]
    assert (epoch, notes, step) == (4, {"tokens": [1, 2, 3], "name": "run"}, 3.0)
    assert groups == [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["x"]}]

    with client.Client(home=home) as store:
        manifest: Manifest = store.transport.manifest("dcp", 1)
        entries = {e.key: e for e in manifest.tensors}
        fc, embed = entries["model/fc.weight"], entries["model/embed.weight"]
        assert (fc.dtype, fc.shape, embed.dtype, embed.shape) == ("F32", [9, 5], "BF16", [6, 4])
        assert [(c.offsets, c.shape) for c in fc.chunks or ()] == [([0, 0], [5, 5]), ([5, 0], [4, 5])]
        assert [(c.offsets, c.shape) for c in embed.chunks or ()] == [([0, 0], [6, 2]), ([0, 2], [6, 2])]
        step = entries["optim/state/fc.weight/step"]
        assert (step.digest is not None, step.placement) == (True, "host")
        assert manifest.state["extra"] == {"epoch": 4, "notes": {"tokens": [1, 2, 3], "name": "run"}}
        assert manifest.state["dcp"] == {"moved": ["epoch", "notes"]}
        assert manifest.step == 5 and manifest.metrics == {"loss": 0.5}
        # A plain load assembles the chunks into whole tensors.
        plain = store.load("dcp", 1)
        assert plain.state_dict is not None
        expected = torch.randn(9, 5, generator=torch.Generator().manual_seed(7))
        assert bytes(byte_view(plain.state_dict["fc.weight"])) == bytes(byte_view(expected))
        assert plain.extra == {"epoch": 4, "notes": {"tokens": [1, 2, 3], "name": "run"}}


def _refused(rank: int, world: int, home: str) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptstore.client.distributed import StoreWriter

    store = client.Client(home=home)
    state = {"model": {"w": torch.ones(2)}, "extra": {"hook": {1, 2}}}
    try:
        dcp.save(state, storage_writer=StoreWriter("refused", client=store))
    except CheckpointException as exc:  # DCP's wrapper of every rank's failure
        return str(exc)
    return "saved"


def test_non_json_values_are_refused_with_their_key_and_nothing_is_committed(tmp_path: Path) -> None:
    home = tmp_path / "store"
    messages = run_ranks(2, tmp_path, _refused, str(home))
    for message in messages:
        assert "extra.hook" in message and "cannot store a value of type builtins.set" in message
    with client.Client(home=home) as store:
        assert store.runs() == []
