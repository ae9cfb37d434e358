"""``ckptstore import``: safetensors weights become a model-only version that later saves dedup against."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptstore import client
from tests.cli.conftest import Cli
from tests.cli.test_export import assert_same_tensors, load_folder
from tests.client.models import TinyNet


def odd_tensors() -> dict[str, torch.Tensor]:
    """Dtypes, a scalar, an empty tensor and a name with '/' that must survive a round trip."""
    generator = torch.Generator().manual_seed(0)
    return {
        "w.bf16": torch.randn(8, 4, generator=generator).to(torch.bfloat16),
        "w.f16": torch.randn(3, 5, generator=generator).to(torch.float16),
        "w.f32": torch.randn(16, 16, generator=generator),
        "ids": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.5),
        "empty": torch.zeros(0, 3),
        "nested/name": torch.ones(2, dtype=torch.uint8),
    }


def separate(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state_dict with tied tensors cloned apart (safetensors refuses shared storage)."""
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def test_import_of_a_file_round_trips_bit_exactly(any_cli: Cli, tmp_path: Path) -> None:
    tensors = odd_tensors()
    source = tmp_path / "weights.safetensors"
    save_file(tensors, source)
    text = any_cli.ok("import", source, "base", "--tag", "base", "--tag", "seed")
    assert text.startswith(f"imported {len(tensors)} tensors") and "as base@1" in text
    shown = json.loads(any_cli.ok("show", "base@seed", "--json"))
    assert shown["version"]["tags"] == ["base", "seed"]
    entries = shown["manifest"]["tensors"]
    assert {e["key"] for e in entries} == {f"model/{name}".replace("nested/name", "nested~1name") for name in tensors}
    assert {(e["trainable"], e["placement"], e["device_type"]) for e in entries} == {(False, "target", "cpu")}
    out = tmp_path / "out"
    any_cli.ok("export", "base", out)
    assert_same_tensors(load_file(out / "model.safetensors"), tensors)


def test_import_of_a_sharded_folder_then_export_is_bit_exact(any_cli: Cli, tmp_path: Path) -> None:
    model = TinyNet()
    any_cli.client.save("trained", model)
    first = tmp_path / "first"
    any_cli.ok("export", "trained", first, "--max-shard-size", "3KB")
    any_cli.ok("import", first, "imported")
    second = tmp_path / "second"
    any_cli.ok("export", "imported", second, "--max-shard-size", "3KB")
    assert_same_tensors(load_folder(second), model.state_dict())
    written = json.loads((second / "model.safetensors.index.json").read_text())
    assert sorted(written["weight_map"]) == sorted(model.state_dict())
    single = tmp_path / "single"
    any_cli.ok("export", "trained", single)
    any_cli.ok("import", single, "imported")  # a folder with model.safetensors
    assert json.loads(any_cli.ok("ls", "imported", "--json"))[-1]["bytes_new"] == 0


def test_a_later_save_of_the_same_weights_stores_nothing_new(any_cli: Cli, tmp_path: Path) -> None:
    model = TinyNet()
    source = tmp_path / "base.safetensors"
    save_file(separate(model.state_dict()), source)
    any_cli.ok("import", source, "base-model")
    saved = any_cli.client.save("finetune", model)
    assert saved.bytes_new == 0 and saved.tensors_new == 0 and saved.bytes_stored == 0
    # The fine-tune's trainable flags are its own; only the bytes are shared.
    diff = json.loads(any_cli.ok("diff", "base-model", "finetune", "--json"))
    assert diff["totals"]["unchanged"]["count"] == len(model.state_dict())


def test_save_state_dict_takes_the_save_path(cli: Cli) -> None:
    tensors = odd_tensors()
    result = cli.client.save_state_dict("plain", tensors, step=3, metrics={"loss": 0.5}, tags=["x"])
    assert result.version == 1 and result.tensors_total == len(tensors) and result.shards == 1
    loaded = cli.client.load("plain")
    assert loaded.step == 3 and loaded.metrics == {"loss": 0.5}
    assert loaded.state_dict is not None
    assert_same_tensors(loaded.state_dict, tensors)
    again = cli.client.save_state_dict("plain", tensors, trainable=True)
    assert again.bytes_new == 0 and again.bytes_stored == 0


def test_save_state_dict_stores_extras_as_json_with_their_tensors(cli: Cli) -> None:
    extra = {"loops": {"epoch": 3, "betas": (0.9, 0.99)}, "ema": torch.arange(4, dtype=torch.bfloat16)}
    cli.client.save_state_dict("with-extra", {"w": torch.ones(3)}, extra=extra)
    loaded = cli.client.load("with-extra")
    assert loaded.extra["loops"] == {"epoch": 3, "betas": (0.9, 0.99)}
    assert loaded.extra["ema"].dtype == torch.bfloat16 and torch.equal(loaded.extra["ema"], extra["ema"])
    with pytest.raises(client.StateEncodingError, match="extra/loops/callback"):
        cli.client.save_state_dict("with-extra", {"w": torch.ones(3)}, extra={"loops": {"callback": print}})
    assert len(cli.client.versions("with-extra")) == 1


def header_file(path: Path, header: dict[str, object], data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_hostile_or_broken_sources_are_refused_without_a_version(cli: Cli, tmp_path: Path) -> None:
    f32 = {"dtype": "F32", "shape": [2]}
    cases = {
        "overlap": (
            header_file(
                tmp_path / "overlap.safetensors",
                {"a": {**f32, "data_offsets": [0, 8]}, "b": {**f32, "data_offsets": [4, 12]}},
                bytes(12),
            ),
            "overlap",
        ),
        "outside": (
            header_file(tmp_path / "outside.safetensors", {"a": {**f32, "data_offsets": [0, 8]}}, bytes(4)),
            "inside the file",
        ),
        "dtype": (
            header_file(
                tmp_path / "dtype.safetensors", {"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, bytes(1)
            ),
            "cannot store",
        ),
        "size": (
            header_file(tmp_path / "size.safetensors", {"a": {**f32, "data_offsets": [0, 4]}}, bytes(4)),
            "needs 8 bytes",
        ),
        "short": (tmp_path / "short.safetensors", "too short"),
        "empty": (header_file(tmp_path / "empty.safetensors", {"__metadata__": {"format": "pt"}}, b""), "no tensors"),
    }
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x00")
    duplicate = tmp_path / "duplicate.safetensors"
    one = b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    text = b'{"a":' + one + b',"a":' + one + b"}"
    duplicate.write_bytes(struct.pack("<Q", len(text)) + text + bytes(4))
    cases["duplicate"] = (duplicate, "twice")
    escape = tmp_path / "escape"
    escape.mkdir()
    (escape / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    cases["index"] = (escape, "points outside")
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    save_file({"b": torch.ones(2)}, lacking / "model-00001-of-00001.safetensors")
    (lacking / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"a": "model-00001-of-00001.safetensors"}})
    )
    cases["lacking"] = (lacking, "lacks 'a'")
    cases["folder"] = (tmp_path / "escape" / "..", "holds neither")
    for name, (source, message) in cases.items():
        result = cli("import", source, "victim")
        assert result.exit_code == 2, (name, result.output)
        assert result.stderr.startswith("error: ") and message in result.stderr, (name, result.stderr)
    assert json.loads(cli.ok("ls", "--json")) == []


def test_import_usage_errors(cli: Cli, tmp_path: Path) -> None:
    source = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(2)}, source)
    assert cli("import", tmp_path / "absent", "run").exit_code == 2
    at = cli("import", source, "run@2")
    assert at.exit_code == 2 and "without @REF" in at.stderr
    assert cli("import", source, "bad run").exit_code == 2
    assert cli("import", source, "run", "--tag", "latest").exit_code == 2
    assert json.loads(cli.ok("ls", "--json")) == []


def test_expanded_tensors_are_refused_by_key_unless_allowed_up_to_a_size(cli: Cli, tmp_path: Path) -> None:
    source = tmp_path / "expanded.pt"
    expanded = torch.arange(4.0).expand(3, 4)  # 16 bytes behind a tensor of 48
    torch.save({"row": expanded, "w": torch.ones(2)}, source)  # noqa: TID251 - making the user's file under test
    refused = cli("import", source, "run")
    assert refused.exit_code == 2 and "'row' claims 48 bytes" in refused.stderr and "16 bytes" in refused.stderr
    assert cli("import", source, "run", "--allow-expanded", "47B").exit_code == 2
    assert cli.client.runs() == []
    cli.ok("import", source, "run", "--allow-expanded", "48B")
    out = tmp_path / "out"
    cli.ok("export", "run", out)
    assert_same_tensors(load_file(out / "model.safetensors"), {"row": expanded.contiguous(), "w": torch.ones(2)})
