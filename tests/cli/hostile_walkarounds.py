"""Caps that read a spelling (safetensors entry counts, config fields that size a model), control sequences in
names shown on the terminal, and folders changed during the import.

Each bounded case is refused in its own process within :data:`~tests.cli.hostile_case.WITHIN_S` seconds and
:data:`~tests.cli.hostile_case.MAX_RSS_MIB` MiB peak RSS (``isolated=True, within_s=WITHIN_S,
max_rss_mib=MAX_RSS_MIB``). The race of a folder swapped for a link while it is read is
:mod:`tests.cli.test_confined_race`; what the terminal is shown, :mod:`tests.cli.test_import_shown`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.cli.hostile_case import LIMIT, MAX_RSS_MIB, NOT_A, WITHIN_S, Case
from tests.cli.import_kit import trainer_folder

#: An OSC sequence (set the window title) and a CSI one (red), as a hostile file name holds them.
OSC = "\x1b]0;owned\x07"
CSI = "\x1b[31m"


def escaped_key_entries(work: Path) -> Path:
    """A safetensors header of 1,000,000 one-element tensors whose ``data_offsets`` key is spelled
    ``data_offset\\u0073``: the same key once parsed, never the bytes ``"data_offsets"``."""
    count = 1_000_000
    entries = b",".join(
        b'"layer.%d":{"dtype":"F32","shape":[1],"data_offset\\u0073":[%d,%d]}' % (i, 4 * i, 4 * i + 4)
        for i in range(count)
    )
    header = b"{" + entries + b"}"
    path = work / "model.safetensors"
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.write(bytes(4 * count))
    return path


def nested_lists(work: Path) -> Path:
    """A safetensors header of one tensor whose shape holds 30,000,000 empty lists (~90 MB of JSON):
    no brace past the first few, each ``[]`` a list object once parsed."""
    count = 30_000_000
    header = b'{"w":{"dtype":"F32","shape":[' + b",".join([b"[]"] * count) + b'],"data_offsets":[0,0]}}'
    path = work / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return path


def _config(change: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[Path], Path]:
    """A Trainer folder (a tiny GPT-2's weights) whose ``config.json`` is replaced by ``change(config)``."""

    def build(work: Path) -> Path:
        folder = work / "ckpt"
        trainer_folder(folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(change(config)))
        return folder

    return build


def _bart_decoder_layers(config: dict[str, Any]) -> dict[str, Any]:
    """A small BART whose decoder asks for 15,000 layers (``num_hidden_layers`` is its encoder's)."""
    return {
        "model_type": "bart",
        "architectures": ["BartForConditionalGeneration"],
        "vocab_size": 64,
        "d_model": 16,
        "encoder_layers": 1,
        "decoder_layers": 15_000,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 32,
        "decoder_ffn_dim": 32,
        "max_position_embeddings": 64,
    }


def _qwen2_layers(config: dict[str, Any]) -> dict[str, Any]:
    """A small Qwen2 of 100,000,000 layers: its config alone lists a type per layer before any check."""
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 100_000_000,
    }


def _nested_layers(config: dict[str, Any]) -> dict[str, Any]:
    """The GPT-2 config with a layer count two objects down, where no reader of names looks."""
    return {**config, "task_specific_params": {"generation": {"n_layer": 1 << 40}}}


def escape_in_name(work: Path) -> Path:
    """A ``.pt`` of random bytes whose file name holds an OSC and a CSI sequence."""
    path = work / f"w{OSC}{CSI}.pt"
    path.write_bytes(bytes(range(256)) * 4)
    return path


#: How the error line shows :func:`escape_in_name`'s file: each control character as its escape.
ESCAPED_NAME = "w\\x1b]0;owned\\x07\\x1b[31m.pt"


def _bounded(case_id: str, build: Callable[[Path], Path], offending: str) -> Case:
    return Case(case_id, build, offending, LIMIT, isolated=True, within_s=WITHIN_S, max_rss_mib=MAX_RSS_MIB)


CASES: list[Case] = [
    _bounded("safetensors-escaped-key-million-entries", escaped_key_entries, "model.safetensors"),
    _bounded("safetensors-thirty-million-lists", nested_lists, "model.safetensors"),
    _bounded("trainer-config-bart-decoder-layers", _config(_bart_decoder_layers), "config.json"),
    _bounded("trainer-config-qwen2-1e8-layers", _config(_qwen2_layers), "config.json"),
    _bounded("trainer-config-nested-layers", _config(_nested_layers), "config.json"),
    Case("pt-name-with-escapes", escape_in_name, ESCAPED_NAME, NOT_A),
]
