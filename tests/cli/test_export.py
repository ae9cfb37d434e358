"""``ckptstore export``: Hugging Face safetensors files loadable by safetensors and transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

from ckptstore.client.cli.common import UsageProblem, parse_size
from ckptstore.client.formats.exporting import plan_files
from tests.cli.conftest import Cli
from tests.client.models import TinyNet, tensors_equal, train

ROOT = Path(__file__).resolve().parents[2]


def assert_same_tensors(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert tensors_equal(loaded[name], tensor), name


def load_folder(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported folder, following the index when there is one."""
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return load_file(directory / "model.safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        tensors.update(load_file(directory / file))
    return tensors


def test_export_writes_model_safetensors_under_state_dict_names(any_cli: Cli, tmp_path: Path) -> None:
    model = TinyNet()
    any_cli.client.save("run", model)
    out = tmp_path / "export"
    text = any_cli.ok("export", "run", out)
    assert text.startswith("exported run@1 to ") and "model.safetensors" in text
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    # The tied pair (embed.weight is head.weight) is written under both names.
    assert_same_tensors(load_file(out / "model.safetensors"), model.state_dict())
    with safe_open(out / "model.safetensors", "pt") as handle:
        assert handle.metadata() == {"format": "pt"}


def test_export_shards_beyond_the_size_limit_with_a_correct_index(any_cli: Cli, tmp_path: Path) -> None:
    model = TinyNet()
    any_cli.client.save("run", model)
    out = tmp_path / "sharded"
    any_cli.ok("export", "run@1", out, "--max-shard-size", "3KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    state = model.state_dict()
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"] == {"total_size": sum(t.numel() * t.element_size() for t in state.values())}
    files = sorted(set(index["weight_map"].values()))
    count = len(files)
    assert count > 2 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, "model.safetensors.index.json"])
    for file in files:
        in_file = load_file(out / file)
        assert sorted(in_file) == sorted(n for n, f in index["weight_map"].items() if f == file)
        assert (out / file).stat().st_size < 3000 + 1000  # a shard's data stays within the limit (+ header)
    assert_same_tensors(load_folder(out), state)

    # Exporting again into the same folder as one file removes the old shards and index.
    any_cli.ok("export", "run", out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_export_with_the_optimizer_writes_its_tensors_and_state_tree(any_cli: Cli, tmp_path: Path) -> None:
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    any_cli.client.save("run", model, optim, step=2)
    out = tmp_path / "with-optim"
    any_cli.ok("export", "run", out, "--optimizer")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "optimizer.json", "optimizer.safetensors"]
    tensors = load_file(out / "optimizer.safetensors")
    tree = json.loads((out / "optimizer.json").read_text())
    assert set(tree) == {"state", "param_groups"}
    assert tree["param_groups"][0]["lr"] == 1e-2 and "head.weight" not in tree["param_groups"][0]["params"]
    by_index = dict(enumerate(name for name, _ in model.named_parameters()))
    for index, state in optim.state_dict()["state"].items():
        name = by_index[index]
        for field, value in state.items():
            ref = tree["state"][name][field]["__tensor__"]
            assert ref == f"state/{name}/{field}" and tensors_equal(tensors[ref], value)
    assert len(tensors) == sum(len(s) for s in optim.state_dict()["state"].values())

    any_cli.client.save("plain", model)
    refused = any_cli("export", "plain", tmp_path / "nothing", "--optimizer")
    assert refused.exit_code == 1 and "holds no optimizer state" in refused.stderr


@pytest.mark.parametrize("max_shard_size", ["5GB", "40KiB"])
def test_export_of_a_llama_loads_with_from_pretrained(cli: Cli, tmp_path: Path, max_shard_size: str) -> None:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    cli.client.save("llama", model, step=1)
    out = tmp_path / "llama"
    config.save_pretrained(out)  # export never invents a config: the user brings it
    note = cli("export", "llama", out, "--max-shard-size", max_shard_size)
    assert note.exit_code == 0 and "config.json" not in note.stderr
    sharded = (out / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_size == "40KiB")

    loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert_same_tensors(loaded.state_dict(), model.state_dict())
    tokens = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_export_notes_a_missing_config_and_refuses_bad_sizes(cli: Cli, tmp_path: Path) -> None:
    cli.client.save("run", TinyNet())
    done = cli("export", "run", tmp_path / "out")
    assert done.exit_code == 0 and "no config.json" in done.stderr
    for size in ("5XB", "-1GB", "0", "GB", "1.5 PB"):
        bad = cli("export", "run", tmp_path / "bad", "--max-shard-size", size)
        assert bad.exit_code == 2 and bad.stderr.startswith("error: size"), size
    assert not (tmp_path / "bad").exists()
    assert cli("export", "nope", tmp_path / "x").exit_code == 1


@pytest.mark.parametrize("as_format", ["hf", "dcp", "peft"])
def test_export_onto_a_file_is_one_clear_usage_error(cli: Cli, tmp_path: Path, as_format: str) -> None:
    cli.client.save("run", TinyNet())
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    for directory, message in (
        (blocked, f"error: {blocked} exists and is not a folder: name a folder to write into"),
        (blocked / "sub", f"error: {blocked} exists and is not a folder, so {blocked / 'sub'} cannot be made in it"),
    ):
        failed = cli("export", "run", str(directory), "--format", as_format)
        assert failed.exit_code == 2, failed.output
        assert failed.stderr.startswith(message) and len(failed.stderr.splitlines()) == 1, failed.stderr
        assert "Errno" not in failed.stderr and failed.stdout == ""
    assert blocked.read_text() == "not a folder"


@pytest.mark.parametrize(("as_format", "name"), [("hf", "model.safetensors"), ("dcp", ".metadata")])
def test_export_over_a_folder_where_a_file_goes_names_it(cli: Cli, tmp_path: Path, as_format: str, name: str) -> None:
    cli.client.save("run", TinyNet())
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    failed = cli("export", "run", str(out), "--format", as_format)
    assert failed.exit_code == 1, failed.output
    assert failed.stderr.startswith(f"error: {out / name} exists and is a folder, so no file can be written there")
    assert len(failed.stderr.splitlines()) == 1 and "Errno" not in failed.stderr, failed.stderr
    assert not [p for p in out.iterdir() if p.name.endswith(".incomplete")]


@pytest.mark.slow  # a subprocess, so that torch's warnings reach its stderr as a user's terminal sees them
def test_a_dcp_export_prints_no_torch_warnings(cli: Cli, tmp_path: Path) -> None:
    cli.client.save("run", TinyNet())
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSTORE_")}
    env["CKPTSTORE_HOME"] = str(cli.env["CKPTSTORE_HOME"])
    out = tmp_path / "dcp"
    for _ in range(2):  # the second writes over the first, which torch also warns of
        done = subprocess.run(
            [
                sys.executable,
                "-W",
                "default",
                "-m",
                "ckptstore.client.cli",
                "export",
                "run",
                str(out),
                "--format",
                "dcp",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("exported run@1 to ")
        assert done.stderr == ""
    assert (out / ".metadata").is_file()


def test_parse_size_follows_hugging_face_units() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6
    assert parse_size("1GiB") == 2**30 and parse_size("64kib") == 64 * 1024
    assert parse_size("1048576") == 2**20 and parse_size("1.5 MB") == 1_500_000
    with pytest.raises(UsageProblem):
        parse_size("lots")


def test_plan_files_keeps_order_empty_tensors_and_oversized_ones() -> None:
    assert plan_files([4, 4, 4], 8) == [[0, 1], [2]]
    assert plan_files([20, 1, 0, 1], 8) == [[0], [1, 2, 3]]
    assert plan_files([0, 0], 8) == [[0, 1]]
    assert plan_files([], 8) == [[]]


def test_export_keys_writes_only_the_selected_tensors(cli: Cli, tmp_path: Path) -> None:
    model = TinyNet()
    cli.client.save("run", model)
    out = tmp_path / "subset"
    cli.ok("export", "run", out, "--keys", "body.*", "--keys", "norm.weight")
    expected = {k: v for k, v in model.state_dict().items() if k.startswith("body.") or k == "norm.weight"}
    assert_same_tensors(load_file(out / "model.safetensors"), expected)
    failed = cli("export", "run", tmp_path / "none", "--keys", "nothing.*")
    assert failed.exit_code != 0 and "match no tensor" in failed.stderr
