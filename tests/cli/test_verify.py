"""``ckptstore verify``: every referenced byte re-read and re-hashed through the transport."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ckptstore.service.format.dtypes import byte_length
from tests.cli.conftest import Cli
from tests.client.models import TinyNet, train
from tests.client.test_integrity import rewrite, trainable_shard


def saved_twice(cli: Cli) -> TinyNet:
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(1))
    cli.client.save("run", model, optim, step=1)
    cli.client.save("run", model, optim, step=1)  # the same bytes again: nothing new to check
    return model


def test_verify_of_a_clean_store_exits_0_with_a_summary(any_cli: Cli) -> None:
    saved_twice(any_cli)
    any_cli.client.save("other", TinyNet(seed=5))
    text = any_cli.ok("verify")
    assert text.startswith("verified 3 versions: ") and "re-read and re-hashed" in text
    report = json.loads(any_cli.ok("verify", "--json"))
    assert set(report) == {"ok", "versions", "tensors", "digests", "bytes", "seconds", "problems", "store"}
    assert report["ok"] is True and report["problems"] == [] and report["versions"] == 3
    manifests = [json.loads(any_cli.ok("show", ref, "--json"))["manifest"] for ref in ("run@1", "run@2", "other")]
    assert report["tensors"] == sum(len(m["tensors"]) for m in manifests)
    unique = {t["digest"]: t for m in manifests for t in m["tensors"]}  # each digest is read once
    assert report["digests"] == len(unique)
    assert report["bytes"] == sum(byte_length(t["dtype"], t["shape"]) for t in unique.values())
    one = json.loads(any_cli.ok("verify", "run@1", "--json"))
    assert one["versions"] == 1 and one["ok"] and one["tensors"] == len(manifests[0]["tensors"])


def test_a_flipped_byte_fails_verify_naming_the_key_and_shard(any_cli: Cli, tmp_path: Path) -> None:
    saved_twice(any_cli)
    backend = any_cli.backend
    assert backend is not None
    shard_id = trainable_shard(backend.blobs)
    manifest = any_cli.client.transport.manifest("run", 1)
    (entry,) = [e for e in manifest.tensors if e.key == "model/body.0.weight"]
    assert entry.digest is not None
    offset = any_cli.client.transport.locate([entry.digest])[entry.digest].offset

    def flip(data: bytearray) -> bytes:
        data[offset + 5] ^= 0x10
        return bytes(data)

    rewrite(backend.blobs, shard_id, tmp_path / "corrupt", flip)
    result = any_cli("verify")
    assert result.exit_code == 1
    (problem_line,) = [line for line in result.stdout.splitlines() if "model/body.0.weight" in line]
    assert problem_line.split()[:3] == ["run@1", "model/body.0.weight", shard_id] and "hash to" in problem_line
    assert "verified 2 versions" in result.stdout and result.stderr.startswith("error: 1 problem found")

    report = json.loads(any_cli("verify", "run@2", "--json").stdout)
    assert report["ok"] is False and len(report["problems"]) == 1
    (problem,) = report["problems"]
    assert problem["key"] == "model/body.0.weight" and problem["shard_id"] == shard_id
    assert problem["digest"] == entry.digest and problem["references"] == 1
    assert problem["run_id"] == "run" and problem["version"] == 2
    # Load refuses the same bytes: verify and load agree.
    failed = any_cli("export", "run", tmp_path / "export")
    assert failed.exit_code == 1 and "model/body.0.weight" in failed.stderr and "ckptstore verify" in failed.stderr


def test_a_missing_shard_is_a_problem_per_tensor(cli: Cli, tmp_path: Path) -> None:
    model = TinyNet()
    cli.client.save("run", model)
    blobs = cli.client.transport.blobs  # type: ignore[attr-defined]
    for shard_id in list(blobs.list_ids()):  # the trainable tensors' shard and the buffers' one
        blobs.delete(shard_id)
    report = json.loads(cli("verify", "--json").stdout)
    assert not report["ok"] and report["bytes"] == 0
    keys = {p["key"] for p in report["problems"]}
    assert len(keys) == len(report["problems"]) == report["digests"]
    assert all("missing" in p["problem"] for p in report["problems"])


def test_a_truncated_shard_names_only_the_tensors_it_lost(cli: Cli, tmp_path: Path) -> None:
    cli.client.save("run", TinyNet())
    blobs = cli.client.transport.blobs  # type: ignore[attr-defined]
    rewrite(blobs, trainable_shard(blobs), tmp_path / "short", lambda data: bytes(data[:-3]))
    result = cli("verify")
    assert result.exit_code == 1
    problems = [line for line in result.stdout.splitlines() if line.startswith("run@1")]
    assert len(problems) == 1 and "truncated" in problems[0]


def test_verify_of_an_unknown_version_is_an_error(cli: Cli) -> None:
    cli.client.save("run", TinyNet())
    result = cli("verify", "run@7")
    assert result.exit_code == 1 and result.stderr.strip() == "error: run 'run' has no version 7"
    assert cli("verify", "run@").exit_code == 2
    assert cli.ok("verify", "run").startswith("verified 1 version: ")
