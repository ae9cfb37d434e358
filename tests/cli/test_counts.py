"""Every count the command line prints is in proper English: ``1 version``, ``2 versions``
(``verified 1 versions`` was the bug), through one helper. Each message family is run for real,
on a store holding one thing and on one holding two."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from ckptstore import client
from ckptstore.client.cli.counts import agree, counted, plural
from ckptstore.service.api import create_app
from ckptstore.service.factory import open_store
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.cli.conftest import Cli, env_for
from tests.servers import running_server

NOUNS = st.sampled_from(["version", "tensor", "shard", "blob", "temporary file", "entry", "parameter"])


@given(st.integers(min_value=0, max_value=10**12), NOUNS)
def test_a_count_is_singular_for_one_only(count: int, noun: str) -> None:
    text = counted(count, noun)
    assert text == (f"1 {noun}" if count == 1 else f"{count} {plural(noun)}")
    assert agree(count, "has", "have") == ("has" if count == 1 else "have")
    assert plural(noun).endswith("s") and plural("entry") == "entries"


def _store(cli: Cli) -> Store:
    store = cli.client.transport
    assert isinstance(store, Store)
    return store


def _compressible(seed: int) -> torch.Tensor:
    """64 KiB of small integers as float32: compression stores it in far less."""
    return torch.randint(0, 4, (128, 128), generator=torch.Generator().manual_seed(seed)).float()


def test_verify_show_and_retention_count_versions_and_tensors(cli: Cli) -> None:
    cli.client.save_state_dict("run", {"w": torch.ones(4)})
    assert cli.ok("verify", "run").startswith("verified 1 version: 1 tensor, 1 distinct, ")
    assert "\nmodel: 1 tensor, 16 B" in cli.ok("show", "run")
    cli.client.save_state_dict("run", {"w": torch.ones(4), "b": torch.zeros(2)})
    assert cli.ok("verify").startswith("verified 2 versions: 3 tensors, 2 distinct, ")
    assert "\nmodel: 2 tensors, 24 B" in cli.ok("show", "run")
    cli.client.save_state_dict("run", {"w": torch.ones(4)})
    assert "not kept: version 1 (" in cli.ok("retention", "run", "--keep-last", "2")
    assert "not kept: versions 1, 2 (" in cli.ok("retention", "run", "--keep-last", "1")


def test_gc_counts_shards_tensors_versions_blobs_and_files(cli: Cli) -> None:
    store = _store(cli)
    for count in (1, 2):  # one shard of one tensor per save
        cli.client.save_state_dict("kept", {f"w{count}": torch.full((4,), float(count))})
        assert cli.ok("gc", "--grace", "0").splitlines()[1].startswith(f"kept {counted(count, 'shard')}, 0 of them")
    cli.ok("rm", "kept@1", "-y")
    cli.ok("rm", "kept@2", "-y")
    assert cli.ok("gc", "--grace", "0").startswith("swept 2 shards (2 tensors, ")
    for count in (1, 2):
        run = f"gone{count}"
        for seed in range(count):  # one shard of one tensor per save
            cli.client.save_state_dict(run, {"w": torch.full((4,), float(10 * count + seed))})
        for version in range(1, count + 1):
            cli.ok("rm", f"{run}@{version}", "-y")
        swept = cli.ok("gc", "--grace", "0").splitlines()
        assert swept[0].startswith(f"swept {counted(count, 'shard')} ({counted(count, 'tensor')}, ")
        assert swept[1].startswith("kept 0 shards, 0 of them unreferenced")
    for count in (1, 2):
        run = f"compress{count}"
        for seed in range(count):
            cli.client.save_state_dict(run, {f"w{seed}": _compressible(10 * count + seed)})
        text = cli.ok("gc", "--compress", "--grace", "0")
        assert re.search(rf"^compressed {counted(count, 'tensor')} of {counted(count, 'version')} \(", text, re.M), text

    for count in (1, 2):
        for seed in range(count):  # blobs no shard record names
            path = store.staging_path()
            data = f"orphan {count} {seed}".encode()
            path.write_bytes(data)
            store.blobs.put_file(f"{count}{seed}".ljust(64, "0"), path)
        text = cli.ok("gc", "--grace", "0", "--dry-run")
        assert f"\n{counted(count, 'blob')} ({count * 10} B) {agree(count, 'has', 'have')} no shard record" in text
        cli.ok("gc", "--grace", "0", "--orphans")


def test_import_and_export_count_tensors(cli: Cli, tmp_path: Path) -> None:
    root = tmp_path
    for count in (1, 2):
        source = root / f"weights{count}.safetensors"
        save_file({f"t{i}": torch.full((3,), float(i)) for i in range(count)}, str(source))
        text = cli.ok("import", str(source), f"imported{count}")
        assert text.startswith(f"imported {counted(count, 'tensor')} (")
        assert f"model: {counted(count, 'tensor')}" in text
        report = json.loads(cli.ok("import", str(source), f"imported{count}", "--json"))
        assert report["model_tensors"] == count
        exported = cli.ok("export", f"imported{count}", str(root / f"out{count}"))
        assert f": {counted(count, 'tensor')}, " in exported.splitlines()[0]


def test_gc_counts_the_temporary_files_a_server_removed(tmp_path: Path) -> None:
    # An embedded store sweeps its staging folder as it opens; a server's collection reports them.
    settings = Settings(home=tmp_path / "server")
    store = open_store(settings)
    try:
        with running_server(create_app(store, settings)) as url, client.Client(url) as remote:
            cli = Cli(env_for(remote.transport, tmp_path / "scratch"), remote)
            for count in (1, 2):
                for seed in range(count):  # temporary files a killed save left in staging
                    (store.staging_dir / f"{seed:064x}.{99999 - seed}.incomplete").write_bytes(b"x" * 8)
                text = cli.ok("gc", "--grace", "0", "--orphans")
                assert f"\nremoved {counted(count, 'temporary file')} ({count * 8} B) that killed saves left" in text
    finally:
        store.close()
