"""Every dtype the format stores, in every layout, in every place a save looks, comes back bit for bit.

Tensors are drawn by hypothesis (tests/client/layouts.py): size-1 dims with any stride (as
optimizers keep them), 0-dim, zero-size, transposed, sliced with an offset, expanded,
channels_last, conjugate and negative views, several views of one storage, and one object
held twice. Each goes in as a model buffer, per-parameter optimizer state, a tensor inside a
param_group, scheduler state and an extra, on the embedded store and over HTTP (SQLite and a
folder; PostgreSQL and S3). The first save hashes every tensor; after the storages change in
place the same client saves again, which sends an embedded store the changed tensors
unhashed; the second version is also exported and read back with the safetensors library.
A third save runs in the background and the storages change again as soon as it returns: its
version holds the views as they were (the snapshot's staging copies of every layout).

``CKPTSTORE_LAYOUT_EXAMPLES`` and ``CKPTSTORE_LAYOUT_SEED`` set the example count and seed
(CI: a fixed seed and a bounded count; ``tests/layouts_long.py`` runs thousands).
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from ckptstore import client
from ckptstore.client.formats.exporting import export_version
from ckptstore.client.saving.hashing import DigestCache, digest_of
from ckptstore.client.tensors import byte_view, check_storable, host_contiguous
from ckptstore.service.api import create_app
from ckptstore.service.db import Database
from ckptstore.service.factory import open_store
from ckptstore.service.settings import Settings
from tests.backends import empty_tables
from tests.client.layouts import (
    Storage,
    assert_same_tensor,
    differing_copy,
    reference_bytes,
    storages,
)
from tests.servers import running_server

pytestmark = pytest.mark.slow  # hypothesis draws of every layout, on every backend

EXAMPLES = int(os.environ.get("CKPTSTORE_LAYOUT_EXAMPLES", "25"))
SEED = int(os.environ.get("CKPTSTORE_LAYOUT_SEED", "20261124"))
LAYOUT_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_runs = itertools.count()


class Holder(torch.nn.Module):
    """One parameter and the given tensors as buffers ``b0``, ``b1``, ..."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))
        for index, tensor in enumerate(buffers):
            self.register_buffer(f"b{index}", tensor)


class HoldsState(torch.optim.Optimizer):
    """An optimizer whose state and param_group hold whatever tensors it is given."""

    def __init__(self, model: Holder, tensors: list[torch.Tensor] | None) -> None:
        super().__init__(model.parameters(), {"lr": 0.1})
        if tensors is not None:
            self.state[model.w] = {f"t{i}": t for i, t in enumerate(tensors)}
            self.param_groups[0]["held"] = list(tensors)
            self.param_groups[0]["first"] = tensors[0]

    def step(self, closure: Any = None) -> None:  # noqa: D102 - never stepped
        return None


class HoldsTensors:
    """A scheduler-like object whose state_dict holds tensors."""

    def __init__(self, tensors: list[torch.Tensor] | None) -> None:
        self.held = tensors

    def state_dict(self) -> dict[str, Any]:  # noqa: D102
        return {"held": self.held, "last_epoch": 3}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: D102
        self.held = state["held"]


@pytest.fixture(scope="module", params=["embedded", "http", "http-postgres-s3"])
def layout_client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[client.Client]:
    """A client on a store of each kind, shared by a test's examples (each uses its own run)."""
    home = tmp_path_factory.mktemp(request.param)
    if request.param == "embedded":
        with client.Client(home=home) as embedded:
            yield embedded
        return
    with pytest.MonkeyPatch.context() as patch:
        settings_ = Settings(home=home)
        if request.param == "http-postgres-s3":
            endpoint = request.getfixturevalue("s3_endpoint")
            patch.setenv("AWS_ENDPOINT_URL", endpoint)
            bucket = f"layouts-{uuid.uuid4().hex[:16]}"
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            url = request.getfixturevalue("pg_url")
            database = Database(url)
            empty_tables(database)
            database.dispose()
            settings_ = Settings(home=home, database_url=url, blobs=f"s3://{bucket}/layouts")
        store = open_store(settings_)
        try:
            with running_server(create_app(store, settings_)) as url_, client.Client(url_) as remote:
                yield remote
        finally:
            store.close()


def _places(views: list[torch.Tensor], tie: bool) -> tuple[Holder, HoldsState, HoldsTensors, dict[str, Any]]:
    model = Holder(views)
    extra = {"views": views, "first": views[0], "again": views[0] if tie else views[-1]}
    return model, HoldsState(model, views), HoldsTensors(views), extra


def _check_load(ckpt: client.Client, run: str, version: int, views: list[torch.Tensor], tie: bool) -> None:
    model = Holder([differing_copy(v) for v in views])
    for index, view in enumerate(views):
        if view.numel():
            assert reference_bytes(getattr(model, f"b{index}")) != reference_bytes(view)
    optim, scheduler = HoldsState(model, None), HoldsTensors(None)
    result = ckpt.load(run, version, model=model, optim=optim, scheduler=scheduler)
    state, group = optim.state[model.w], optim.param_groups[0]
    for index, view in enumerate(views):
        assert_same_tensor(getattr(model, f"b{index}"), view, f"model buffer b{index}")
        assert_same_tensor(state[f"t{index}"], view, f"optimizer state t{index}")
        assert_same_tensor(group["held"][index], view, f"param_group held[{index}]")
        assert scheduler.held is not None
        assert_same_tensor(scheduler.held[index], view, f"scheduler held[{index}]")
        assert_same_tensor(result.extra["views"][index], view, f"extra views[{index}]")
    assert_same_tensor(group["first"], views[0], "param_group first")
    assert_same_tensor(result.extra["first"], views[0], "extra first")
    assert_same_tensor(result.extra["again"], views[0] if tie else views[-1], "extra again")


def _check_export(ckpt: client.Client, run: str, version: int, views: list[torch.Tensor], where: Path) -> None:
    export_version(ckpt.transport, run, version, where, optimizer=True)
    weights, optimizer = load_file(where / "model.safetensors"), load_file(where / "optimizer.safetensors")
    for index, view in enumerate(views):
        assert_same_tensor(weights[f"b{index}"], view, f"exported b{index}")
        assert_same_tensor(optimizer[f"state/w/t{index}"], view, f"exported optimizer t{index}")


def _change_in_place(groups: list[Storage]) -> None:
    """Flip bits of every storage through a view of it, as an optimizer step changes state in place."""
    for group in groups:
        flip = 1 if group.dtype == torch.bool else 0x3C
        group.base.view(torch.uint8).bitwise_xor_(flip)


@seed(SEED)
@LAYOUT_SETTINGS
@given(groups=st.lists(storages(), min_size=1, max_size=2), tie=st.booleans())
def test_every_layout_round_trips_in_every_place(
    layout_client: client.Client, tmp_path_factory: pytest.TempPathFactory, groups: list[Storage], tie: bool
) -> None:
    run = f"layouts-{next(_runs)}"
    views = [view for group in groups for view in group.views()]
    described = "; ".join(f"{g.dtype} {s.describe()}" for g in groups for s in g.specs)
    model, optim, scheduler, extra = _places(views, tie)
    first = layout_client.save(run, model, optim, scheduler=scheduler, extra=extra)
    _check_load(layout_client, run, first.version, views, tie)
    expected_first = [v.clone() for v in views]
    _change_in_place(groups)
    second = layout_client.save(run, model, optim, scheduler=scheduler, extra=extra)
    try:
        _check_load(layout_client, run, second.version, views, tie)
        _check_load(layout_client, run, first.version, expected_first, tie)
        _check_export(layout_client, run, second.version, views, tmp_path_factory.mktemp("export"))
        # In the background: the version holds the views as they were when save() returned.
        expected_second = [v.clone() for v in views]
        third = layout_client.save(run, model, optim, scheduler=scheduler, extra=extra, blocking=False)
        _change_in_place(groups)
        _check_load(layout_client, run, third.result().version, expected_second, tie)
    except AssertionError as exc:
        raise AssertionError(f"{exc} [{described}]") from exc


@seed(SEED)
@settings(max_examples=EXAMPLES * 8, deadline=None, suppress_health_check=[HealthCheck.data_too_large])
@given(group=storages())
def test_bytes_digests_and_cache_samples_of_every_layout(group: Storage) -> None:
    for view in group.views():
        check_storable(view, "k")
        host = host_contiguous(view, "k")
        assert bytes(byte_view(host)) == reference_bytes(view)
        rebuilt = torch.empty(view.shape, dtype=view.dtype).copy_(view.resolve_conj().resolve_neg())
        assert digest_of(view, "k") == digest_of(rebuilt, "k")
        cache = DigestCache(min_bytes=0)
        cache.put(view, "d" * 64, cache.take(view))
        assert cache.get(view) == "d" * 64
