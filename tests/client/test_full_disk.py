"""A store disk that fills up during a save: never a partial version, a StorageFullError at once (over
HTTP too: a full disk is not retried), and the save goes through once there is room."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch import nn

from ckptstore.service.errors import StorageFullError
from tests.client.conftest import Backend
from tests.faults.faulty import fail_staging_writes


def test_a_save_that_fills_the_store_disk_stores_no_partial_version(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 16))  # 8 MiB: several staging buffers
    partial = fail_staging_writes(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    if backend.name == "http-postgres-s3":  # shard bytes go to S3 directly: the server's disk is never in the way
        saved = backend.client.save("full-disk", model)
        assert partial == []
    else:
        with pytest.raises(StorageFullError, match="No space left on device"):
            backend.client.save("full-disk", model)
        assert len(partial) == 1  # the fault fired once, in the middle of the first shard
        assert backend.client.runs() == []
        saved = backend.client.save("full-disk", model)
    assert saved.version == 1 and [v.version for v in backend.client.versions("full-disk")] == [1]
    target = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 16))
    backend.client.load("full-disk", model=target)
    for name, tensor in model.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
