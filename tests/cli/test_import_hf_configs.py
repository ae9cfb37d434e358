"""A Hugging Face model's configs travel with its weights: ``config.json`` and ``generation_config.json``
of a ``save_pretrained`` or Trainer folder are kept by ``ckptstore import``, ``client.save`` of a
transformers model records them, and ``ckptstore export`` writes both, so
``AutoModelForCausalLM.from_pretrained(export_dir)`` gives the same model with its sampling
settings and nothing copied by hand. A config file that is not a strict JSON object is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")  # the .[transformers] extra; installed in CI

from tests.cli.conftest import Cli  # noqa: E402
from tests.client.models import tensors_equal  # noqa: E402
from tests.integrations.hf_kit import Tokens, arguments, tiny_gpt2  # noqa: E402

SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 7, "max_new_tokens": 5}


def generating_gpt2(seed: int = 0) -> Any:
    """A tiny GPT-2 with sampling settings of its own (not transformers' defaults)."""
    model = tiny_gpt2(seed)
    for name, value in SAMPLING.items():
        setattr(model.generation_config, name, value)
    return model


def assert_loads_as(out: Path, model: Any) -> None:
    """``from_pretrained(out)`` gives ``model``'s class, config, weights and sampling settings."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(model)
    loading = {"_name_or_path": "", "dtype": None}  # what from_pretrained fills in from the folder and its load
    assert loaded.config.to_dict() | loading == model.config.to_dict() | loading
    found, expected = loaded.state_dict(), model.state_dict()
    assert found.keys() == expected.keys()
    assert all(tensors_equal(found[k], v) for k, v in expected.items())
    for name, value in SAMPLING.items():
        assert getattr(loaded.generation_config, name) == value, name
    assert loaded.generation_config.to_diff_dict() == model.generation_config.to_diff_dict()


def test_a_save_pretrained_folder_keeps_both_configs_for_export(cli: Cli, tmp_path: Path) -> None:
    model = generating_gpt2()
    model.save_pretrained(tmp_path / "saved")
    assert {"config.json", "generation_config.json"} <= {p.name for p in (tmp_path / "saved").iterdir()}
    report = json.loads(cli.ok("import", tmp_path / "saved", "gpt2", "--json"))
    assert report["extra"] == ["generation_config", "model_config"]
    assert "config.json" not in report["left_out"] and "generation_config.json" not in report["left_out"]
    extra = cli.client.transport.manifest("gpt2", "latest").state["extra"]
    for name, key in (("config.json", "model_config"), ("generation_config.json", "generation_config")):
        assert extra[key] == json.loads((tmp_path / "saved" / name).read_text()), name

    out = tmp_path / "exported"
    text = cli.ok("export", "gpt2", out)
    assert "generation_config.json" in text
    assert_loads_as(out, model)


def test_a_trainer_folder_keeps_its_generation_config(cli: Cli, tmp_path: Path) -> None:
    model = generating_gpt2()
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path / "run", max_steps=3), train_dataset=Tokens())
    trainer.train()
    folder = tmp_path / "run" / "checkpoint-3"
    cli.ok("import", folder, "trained")
    out = tmp_path / "exported"
    cli.ok("export", "trained", out)
    written = json.loads((folder / "generation_config.json").read_text())
    assert json.loads((out / "generation_config.json").read_text()) == written
    assert_loads_as(out, model)


def test_client_save_of_a_transformers_model_records_its_configs(cli: Cli, tmp_path: Path) -> None:
    model = generating_gpt2()
    cli.client.save("saved", model, extra={"note": "mine"})
    loaded = cli.client.load("saved", model=tiny_gpt2(3))
    assert loaded.extra["note"] == "mine"
    assert loaded.extra["model_config"] == json.loads(model.config.to_json_string(use_diff=False))
    assert loaded.extra["generation_config"]["temperature"] == 0.7
    out = tmp_path / "exported"
    cli.ok("export", "saved", out)
    assert_loads_as(out, model)

    # The caller's own extras win over what is recorded.
    cli.client.save("own", model, extra={"model_config": {"mine": True}})
    assert cli.client.load("own").extra["model_config"] == {"mine": True}


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("config.json", b"[1, 2]", "not a JSON object"),
        ("generation_config.json", b'{"top_k": 1, "top_k": 2}', "top_k"),
        ("generation_config.json", b'{"temperature": NaN}', "NaN"),
        ("generation_config.json", b"\xff\xfe{}", "not valid JSON"),
        ("generation_config.json", b"{" + b" " * (10 << 20) + b"}", "limit"),
    ],
    ids=["not-an-object", "duplicate-key", "nan", "not-utf8", "too-large"],
)
def test_a_config_that_is_not_a_strict_json_object_is_refused_naming_it(
    cli: Cli, tmp_path: Path, name: str, text: bytes, expected: str
) -> None:
    folder = tmp_path / "saved"
    generating_gpt2().save_pretrained(folder)
    (folder / name).write_bytes(text)
    failed = cli("import", folder, "run")
    assert failed.exit_code == 2 and str(folder / name) in failed.stderr and expected in failed.stderr, failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1 and cli.client.runs() == []
