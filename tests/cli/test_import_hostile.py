"""``ckptstore import`` of hostile checkpoints (:mod:`tests.cli.hostile_imports`): refused, in our words,
without running their code, reading outside the source or exhausting the machine.

The contract for every case: exit 2; stderr is one line, ``error: …``, naming the offending file and
holding the case's words, with no traceback; nothing stored; the payload's marker file absent. The
Python API raises :class:`InvalidInputError` for the same sources. Bombs and hangs run as their own
``ckptstore`` process (:mod:`tests.cli.bounded_run`): peak RSS (``wait4``'s ``ru_maxrss``) under
1.5 GiB, and guards that kill it past 120 s, 4 GiB resident or a 1 GiB file written, so a
regression fails the test instead of taking the machine. Their figures are printed (``pytest -s``)
and carried in each failure message.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed.checkpoint.api
from typer.testing import CliRunner

from ckptstore import client
from ckptstore.client.cli import app
from ckptstore.service.errors import InvalidInputError
from tests.cli.conftest import Cli
from tests.cli.hostile_case import Says
from tests.cli.hostile_imports import BY_ID, CASES, MARKER, Case
from tests.cli.hostile_pickles import system_extension
from tests.cli.import_kit import BASES
from tests.client.models import tensors_equal

ROOT = Path(__file__).resolve().parents[2]
MAX_RSS_MIB = 1536
#: Guards, not timings: past these the process is killed and the case fails.
HANG_S = 120
KILL_RSS_MIB = 4096
MAX_FILE_BYTES = 1 << 30
LAUNCHER = Path(__file__).with_name("bounded_run.py")

IN_PROCESS = [case.id for case in CASES if not case.isolated]
ISOLATED = [case.id for case in CASES if case.isolated]
API_SAMPLE = [
    "dcp-byte-entry-evil",
    "dcp-metadata-global",
    "pt-archive-system-p2",
    "pt-archive-getattr-p0",
    "pt-archive-ext1-p4",
    "pt-legacy-evil",
    "dcp-path-parent",
    "dcp-offset-past-end",
    "dcp-chunks-empty",
    "hf-symlink-out",
    "trainer-architecture-pipeline",
    "trainer-optimizer-unknown-index",
    "safetensors-shape-2e62",
]


def _holds(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE) is not None


def missing_words(line: str, says: Says) -> list[str]:
    """The words of ``says`` that ``line`` lacks (a tuple is satisfied by any one of its words)."""
    alternatives = [(word,) if isinstance(word, str) else word for word in says]
    return [" | ".join(words) for words in alternatives if not any(_holds(line, w) for w in words)]


def names_offending(said: str, case: Case) -> bool:
    names = (case.offending,) if isinstance(case.offending, str) else case.offending
    return any(name in said for name in names)


def assert_refused(
    exit_code: int | None,
    stderr: str,
    case: Case,
    work: Path,
    runs: list[str],
    detail: str = "",
    bounds: list[str] | None = None,
) -> None:
    """The CLI contract for a hostile source: exit 2, one ``error:`` line naming the file in our words,
    no traceback, nothing stored, the marker absent; and the ``bounds`` a bounded run broke.
    ``detail`` is added to the failure message."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    # The work folder's own path may hold any word; only what the reader says counts.
    said = errors[0].replace(str(work.parent), "<work>") if errors else ""
    problems = list(bounds or [])
    if exit_code != 2:
        problems.append(f"exit {exit_code}, not 2")
    if len(errors) != 1 or len(lines) != 1:
        problems.append(f"stderr has {len(lines)} lines, {len(errors)} of them 'error: …', not exactly one")
    if "Traceback" in stderr:
        problems.append("a traceback")
    if errors and not names_offending(said, case):
        problems.append(f"the error does not name {case.offending}")
    if errors and missing_words(said, case.says):
        problems.append(f"the error lacks {missing_words(said, case.says)}")
    if (work / MARKER).exists():
        problems.append("THE PAYLOAD RAN (marker created)")
    if runs:
        problems.append(f"stored {runs}")
    assert not problems, f"{case.id}: " + "; ".join(problems) + f"{detail}\n--- stderr ---\n{stderr[-4000:]}"


def _work(tmp_path: Path) -> Path:
    work = tmp_path / "w"
    work.mkdir()
    return work


def _importing(case: Case) -> AbstractContextManager[None]:
    """What the importing process has registered: os.system as a copyreg extension, for EXT1 payloads."""
    return system_extension() if case.extension else nullcontext()


def _escaped(raised: BaseException | None) -> str:
    """An exception that left the command, by its first and last lines (DCP wraps the cause in a traceback)."""
    if raised is None:
        return ""
    lines = [line for line in str(raised).splitlines() if line.strip()] or [""]
    return f"\nraised {type(raised).__name__}: {lines[0][:300]}" + (f" … {lines[-1][:300]}" if len(lines) > 1 else "")


@pytest.mark.parametrize("case_id", IN_PROCESS)
def test_cli_refuses(cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case_id: str) -> None:
    case = BY_ID[case_id]
    work = _work(tmp_path)
    source, _, _ = case.make(work)
    monkeypatch.chdir(work)  # whatever a reader writes to its working folder stays in the case's own
    raised: BaseException | None
    with _importing(case):
        try:
            # "y" answers any prompt to run the source's code: none may be asked, let alone honoured.
            result = CliRunner().invoke(app, ["import", str(source), "run"], env=cli.env, input="y\n")
        except (Exception, torch.distributed.checkpoint.api.CheckpointException) as exc:  # a BaseException
            raised, exit_code, stderr = exc, None, ""  # it escaped the command: the user would see a traceback
        else:
            raised = None if isinstance(result.exception, (SystemExit, type(None))) else result.exception
            exit_code, stderr = result.exit_code, result.stderr
    assert_refused(exit_code, stderr, case, work, [run.run_id for run in cli.client.runs()], _escaped(raised))


@pytest.mark.parametrize("case_id", API_SAMPLE)
def test_python_api_raises_invalid_input(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case_id: str
) -> None:
    from ckptstore.client.formats.importing import import_weights

    case = BY_ID[case_id]
    work = _work(tmp_path)
    source, _, _ = case.make(work)
    monkeypatch.chdir(work)
    with _importing(case), pytest.raises(InvalidInputError) as refused:
        import_weights(cli.client, source, "run")
    said = str(refused.value).replace(str(work.parent), "<work>")
    assert names_offending(said, case) and not missing_words(said, case.says), said
    assert not (work / MARKER).exists(), "the payload ran"
    assert cli.client.runs() == []


@dataclass
class Bounded:
    """A ``ckptstore`` process run under the guards, and what it cost."""

    exit_code: int | None
    stdout: str
    stderr: str
    peak_rss_mib: float
    seconds: float
    killed: str

    def figures(self) -> str:
        killed = f", {self.killed}" if self.killed else ""
        if "File too large" in self.stderr:  # Python ignores SIGXFSZ: the write fails instead
            killed += f", a write stopped at the {MAX_FILE_BYTES >> 30} GiB file guard"
        return f"exit {self.exit_code}, peak RSS {self.peak_rss_mib:.0f} MiB, {self.seconds:.1f} s{killed}"


def run_bounded(work: Path, *args: str, answer: bytes | None = None) -> Bounded:
    """``python -m client.cli *args`` on an embedded store in ``work / "home"``, in ``work``, under the
    guards of :mod:`tests.cli.bounded_run` (which also measures its peak RSS by ``wait4``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTSTORE_URL", "CKPTSTORE_TOKEN")}
    env.update(
        CKPTSTORE_HOME=str(work / "home"),
        CKPTSTORE_DISABLE_PROGRESS_BARS="1",
        HF_HOME=str(work / "hf-home"),  # remote code a reader fetched or cached would land here, not in ~
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT),
    )
    spec = {
        "argv": [sys.executable, "-m", "ckptstore.client.cli", *args],
        "hang_s": HANG_S,
        "kill_rss_mib": KILL_RSS_MIB,
        "max_file_bytes": MAX_FILE_BYTES,
    }
    (work / "stdin").write_bytes(answer or b"")
    report = work / "bounded.json"
    with (
        open(work / "stdin", "rb") if answer else open(os.devnull, "rb") as stdin,
        open(work / "stdout", "wb") as stdout,
        open(work / "stderr", "wb") as stderr,
    ):
        subprocess.run(
            [sys.executable, str(LAUNCHER), str(report), json.dumps(spec)],
            cwd=work,
            env=env,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            check=True,
            timeout=HANG_S + 60,
        )
    ran = json.loads(report.read_text())
    return Bounded(
        exit_code=ran["exit_code"],
        stdout=(work / "stdout").read_text(errors="replace"),
        stderr=(work / "stderr").read_text(errors="replace"),
        peak_rss_mib=ran["peak_rss_kib"] / 1024,
        seconds=ran["seconds"],
        killed=ran["killed"],
    )


def _stored_runs(home: Path) -> list[str]:
    if not home.exists():
        return []
    with client.Client(home=home) as store:
        return [run.run_id for run in store.runs()]


@pytest.mark.slow
@pytest.mark.parametrize("case_id", ISOLATED)
def test_bounded_refusal(tmp_path: Path, case_id: str) -> None:
    case = BY_ID[case_id]
    work = _work(tmp_path)
    source, _, _ = case.make(work)
    try:
        ran = run_bounded(work, "import", str(source), "run", answer=case.answer)
        print(f"\n[{case.id}] {ran.figures()}")
        bounds = [ran.killed] if ran.killed else []
        max_rss = MAX_RSS_MIB if case.max_rss_mib is None else case.max_rss_mib
        if ran.peak_rss_mib >= max_rss:
            bounds.append(f"peak RSS {ran.peak_rss_mib:.0f} MiB, over {max_rss:.0f} MiB")
        if case.within_s is not None and ran.seconds >= case.within_s:
            bounds.append(f"not refused within {case.within_s} s")
        runs = _stored_runs(work / "home")
        assert_refused(ran.exit_code, ran.stderr, case, work, runs, f"\n{ran.figures()}", bounds)
    finally:
        shutil.rmtree(work / "home", ignore_errors=True)  # what a failing case stored may be GiBs


@pytest.mark.parametrize("kind", sorted(BASES))
def test_valid_checkpoints_of_each_format_still_import_bitwise(cli: Cli, tmp_path: Path, kind: str) -> None:
    source, expected = BASES[kind](_work(tmp_path))
    cli.ok("import", str(source), "run")
    loaded = cli.client.load("run")
    assert loaded.state_dict is not None and loaded.state_dict.keys() == expected.keys()
    unequal = [k for k, v in expected.items() if not tensors_equal(loaded.state_dict[k], v)]
    assert not unequal, unequal


@pytest.mark.slow
def test_a_valid_import_fits_the_bounds_its_own_process_is_held_to(tmp_path: Path) -> None:
    """The baseline the bounded cases are measured against: a small import in its own process."""
    work = _work(tmp_path)
    source, _ = BASES["pt"](work)
    ran = run_bounded(work, "import", str(source), "run")
    print(f"\n[valid pt] {ran.figures()}")
    assert ran.exit_code == 0 and not ran.killed, f"{ran.figures()}\n{ran.stderr[-4000:]}"
    assert ran.peak_rss_mib < MAX_RSS_MIB, ran.figures()
    assert _stored_runs(work / "home") == ["run"]
