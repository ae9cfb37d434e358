"""``ckptstore import`` of a model in the Hugging Face hub cache: a snapshot folder whose files
are links into the repo's ``blobs/``, laid out by huggingface_hub's own link maker."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import safetensors.torch
import torch
from huggingface_hub.file_download import _create_symlink

from tests.cli.conftest import Cli
from tests.client.models import tensors_equal

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _cached(hub: Path, files: dict[str, bytes]) -> Path:
    """A snapshot of ``models--org--tiny`` holding ``files``, each a link to its blob, as the hub caches them."""
    repo = hub / "models--org--tiny"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        _create_symlink(str(blob), str(snapshot / name), new_blob=False)
    return snapshot


def _weights() -> tuple[dict[str, torch.Tensor], bytes]:
    tensors = {"layer.weight": torch.randn(4, 3), "layer.bias": torch.randn(4)}
    return tensors, safetensors.torch.save(tensors)


def test_a_hub_cache_snapshot_imports_through_its_blob_links(cli: Cli, tmp_path: Path) -> None:
    tensors, data = _weights()
    snapshot = _cached(tmp_path / "hub", {"model.safetensors": data, "tokenizer.json": b"{}"})
    assert os.path.islink(snapshot / "model.safetensors")
    assert not os.readlink(snapshot / "model.safetensors").startswith("/")  # relative, into ../../blobs
    out = cli.ok("import", snapshot, "cached")
    assert "left out: tokenizer.json" in out
    state = cli.client.load("cached").state_dict
    assert state is not None and all(tensors_equal(state[k], v) for k, v in tensors.items())


def test_a_snapshot_link_out_of_its_repo_is_refused(cli: Cli, tmp_path: Path) -> None:
    _, data = _weights()
    snapshot = _cached(tmp_path / "hub", {"config.json": b"{}"})
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(data)
    (snapshot / "model.safetensors").symlink_to(outside)
    failed = cli("import", snapshot, "cached")
    assert failed.exit_code == 2 and "is a link that points outside" in failed.stderr
    assert cli.client.runs() == []


def test_without_the_cache_layout_links_stay_inside_the_folder(cli: Cli, tmp_path: Path) -> None:
    """A folder named like a snapshot but with no blobs/ beside it gets no wider fence."""
    _, data = _weights()
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (tmp_path / "models--org--tiny" / "store").mkdir()
    (tmp_path / "models--org--tiny" / "store" / "w.safetensors").write_bytes(data)
    (snapshot / "model.safetensors").symlink_to("../../store/w.safetensors")
    failed = cli("import", snapshot, "cached")
    assert failed.exit_code == 2 and "is a link that points outside" in failed.stderr
