"""What the terminal is shown of names the CLI did not choose: control characters as escapes.

File names in a checkpoint folder, keys of a pickled dict and keys stored in a version may hold an
escape sequence (OSC, CSI, their C1 forms), a carriage return or a bidi override; printed as they
are, they would act on the user's terminal. Every line the CLI prints, the ``error:`` line
included, writes them as ``\\x1b``, ``\\u202e`` (:mod:`client.cli.shown`).
"""

from __future__ import annotations

import ast
import json
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from ckptstore.client.cli.shown import ESCAPED_CATEGORIES, shown, shown_lines
from tests.cli import hostile_pickles as hp
from tests.cli.conftest import Cli
from tests.cli.hostile_walkarounds import CSI, ESCAPED_NAME, OSC, escape_in_name
from tests.cli.import_kit import model_state

ROOT = Path(__file__).resolve().parents[2]
#: A name holding what a terminal would act on: OSC, CSI, their C1 forms, CR, a bidi override.
HOSTILE = f"n{OSC}{CSI}\x9d8;;x\x9c\x9b2J\rover\u202eevil\u2066\x7f"
HOSTILE_SHOWN = "n\\x1b]0;owned\\x07\\x1b[31m\\x9d8;;x\\x9c\\x9b2J\\x0dover\\u202eevil\\u2066\\x7f"


def unsafe(text: str) -> list[str]:
    """The characters of ``text`` a terminal may act on (every escaped category but its line breaks)."""
    return [c for c in text if unicodedata.category(c) in ESCAPED_CATEGORIES and c != "\n"]


def test_a_hostile_name_is_shown_as_its_escapes() -> None:
    assert shown(HOSTILE) == HOSTILE_SHOWN
    assert shown("tab\there\nnext") == "tab\\x09here\\x0anext"
    assert shown_lines("one\x1b[2J\ntwo") == "one\\x1b[2J\ntwo"
    assert shown("\U000e0041") == "\\U000e0041"  # a tag character (Cf) beyond the BMP
    assert shown("\udcff") == "\\udcff"  # an undecodable byte of a file name


@given(st.text())
def test_nothing_shown_is_a_control_character(text: str) -> None:
    assert unsafe(shown(text)) == []
    assert [c for c in unsafe(shown_lines(text))] == []
    assert shown_lines(text).count("\n") == text.count("\n")


@given(st.text().filter(str.isprintable))
def test_printable_text_is_shown_unchanged(text: str) -> None:
    assert shown(text) == text
    assert shown_lines(text) == text


def test_the_left_out_lines_show_file_names_escaped(cli: Cli, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(model_state(), folder / "model.safetensors")
    (folder / f"{HOSTILE}.txt").write_text("notes")
    out = cli.ok("import", folder, "run")
    assert unsafe(out) == [], out
    assert f"left out: {HOSTILE_SHOWN}.txt (not read" in out


def test_the_report_shows_pickle_keys_escaped(cli: Cli, tmp_path: Path) -> None:
    path = hp.torch_saved(
        {"state_dict": model_state(), HOSTILE: {1, 2}, f"kept{CSI}": {1: 2, "x": 3}}, tmp_path / "weights.pt"
    )
    out = cli.ok("import", path, "run")
    assert unsafe(out) == [], out
    assert f"left out: {HOSTILE_SHOWN} (cannot be stored: {HOSTILE_SHOWN}: " in out
    assert "extra kept\\x1b[31m" in out


def test_the_error_line_shows_the_file_name_escaped(cli: Cli, tmp_path: Path) -> None:
    failed = cli("import", escape_in_name(tmp_path), "run")
    assert failed.exit_code == 2
    assert unsafe(failed.stderr.rstrip("\n")) == [], failed.stderr
    assert len(failed.stderr.splitlines()) == 1 and ESCAPED_NAME in failed.stderr


def test_an_error_naming_a_hostile_file_stays_one_line(cli: Cli, tmp_path: Path) -> None:
    """A shard named with a newline and escapes, which lacks the tensor the index places there."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    name = f"{HOSTILE}\nerror: forged"
    save_file(model_state(), folder / "model.safetensors")
    save_file({"d": torch.ones(1)}, folder / name)
    weight_map = {"w": "model.safetensors", "b": "model.safetensors", "c": name}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    failed = cli("import", folder, "run")
    assert failed.exit_code == 2
    assert unsafe(failed.stderr.rstrip("\n")) == [] and len(failed.stderr.splitlines()) == 1, failed.stderr
    assert f"{HOSTILE_SHOWN}\\x0aerror: forged lacks 'c'" in failed.stderr


def test_diff_shows_stored_keys_escaped(cli: Cli) -> None:
    state = {"w": torch.ones(2)}
    cli.client.save_state_dict("run", state, scheduler_state={HOSTILE: 1})
    cli.client.save_state_dict("run", state, scheduler_state={HOSTILE: 2})
    out = cli.ok("diff", "run@1", "run@2")
    assert unsafe(out) == [], out
    assert HOSTILE_SHOWN in out


@pytest.mark.parametrize("module", sorted(p.name for p in (ROOT / "client" / "cli").glob("*.py")))
def test_the_cli_prints_only_through_its_escaping_echo(module: str) -> None:
    """No command calls typer.echo or print itself: common.echo and common.fail are the only writers."""
    tree = ast.parse((ROOT / "client" / "cli" / module).read_text())
    writers = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if called in ("print", "typer.echo", "typer.secho", "click.echo", "sys.stdout.write"):
                    writers.append(f"{function.name}: {called}")
    allowed = {"echo: typer.echo", "fail: typer.echo"} if module == "common.py" else set()
    assert set(writers) <= allowed, writers
