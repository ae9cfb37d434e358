"""Loads hand tensors to their devices through :class:`client.loading.device_copy.DeviceCopier`;
off CUDA it copies as ``copy_`` and ``to`` do, and a load reads on as many threads as the
machine's cores call for (tests/client/test_cuda.py runs the CUDA side)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import client
from ckptstore.client.loading import readahead
from ckptstore.client.loading.device_copy import DeviceCopier

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


@given(st.sampled_from(DTYPES), st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3))
def test_off_cuda_it_copies_and_moves_as_torch_does(
    source_dtype: torch.dtype, dtype: torch.dtype, shape: list[int]
) -> None:
    source = torch.randint(0, 3, shape).to(source_dtype)
    with DeviceCopier([torch.device("cpu"), torch.device("meta")]) as copier:
        assert not copier.pinned and not copier.host_empty(shape, dtype).is_pinned()
        target = torch.empty(shape, dtype=dtype)
        copier.copy(target, source)
        assert torch.equal(target, source.to(dtype))
        moved = copier.to(source, torch.device("meta"), dtype)
        assert moved.device.type == "meta" and moved.dtype == dtype and moved.shape == source.shape
        assert copier.to(source, torch.device("cpu")) is source  # as Tensor.to: nothing to move


def test_one_reader_per_four_cores_up_to_four() -> None:
    assert [readahead.local_reads(cores) for cores in (1, 2, 4, 7, 8, 16, 64)] == [1, 1, 1, 1, 2, 4, 4]


class Layers(torch.nn.Module):
    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.layers = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(size)) for size in sizes)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cores=st.sampled_from([2, 8, 16]),
    sizes=st.lists(st.integers(1, 300_000), min_size=1, max_size=12),
    shard_bytes=st.sampled_from([1 << 16, 1 << 20, 64 << 20]),
    unit_bytes=st.sampled_from([1 << 12, 1 << 18, 64 << 20]),
)
def test_a_load_on_several_read_threads_reads_every_tensor_exactly(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    cores: int,
    sizes: list[int],
    shard_bytes: int,
    unit_bytes: int,
) -> None:
    """Reads of units (large tensors cut in several) run on up to four threads out of order; the
    tensors come out whole, verified, in the model's own memory and in the optimizer's state."""
    from ckptstore.client.loading import reader

    monkeypatch.setattr("ckptstore.client.api.os.cpu_count", lambda: cores)
    monkeypatch.setattr(reader, "UNIT_BYTES", unit_bytes)
    torch.manual_seed(len(sizes))
    model = Layers(sizes)
    optim = torch.optim.Adam(model.parameters())
    torch.stack([p.sum() for p in model.parameters()]).sum().backward()
    optim.step()
    home = tmp_path_factory.mktemp("store")
    with client.Client(home=home, shard_bytes=shard_bytes) as ckpt:
        assert ckpt.read_threads == readahead.local_reads(cores)
        ckpt.save("run", model, optim)
        fresh = Layers(sizes)
        fresh_optim = torch.optim.Adam(fresh.parameters())
        ckpt.load("run", model=fresh, optim=fresh_optim)
    for mine, theirs in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(optim.state.values(), fresh_optim.state.values(), strict=True):
        assert torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"])


def test_a_load_onto_meta_goes_through_the_copier(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Layers([10, 20])
    with client.Client(home=tmp_path) as ckpt:
        ckpt.save("run", model)
        state = ckpt.load("run", device="meta").state_dict
    assert state is not None and {t.device.type for t in state.values()} == {"meta"}
