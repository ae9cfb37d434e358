"""``ckptstore ls``, ``show`` and ``diff``: readable tables by default, stable JSON with --json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from ckptstore.service.format.records import RunInfo, VersionInfo
from tests.cli.conftest import Cli
from tests.client.models import TinyNet, train

ROOT = Path(__file__).resolve().parents[2]
RUN_FIELDS = {"run_id", "created_at", "updated_at", "versions", "latest_version", "bytes_total", "bytes_new"}
VERSION_FIELDS = {
    "run_id",
    "version",
    "parent",
    "created_at",
    "tags",
    "step",
    "metrics",
    "tensors_total",
    "tensors_new",
    "bytes_total",
    "bytes_new",
    "bytes_trainable",
}


def two_versions(cli: Cli, run_id: str = "run") -> TinyNet:
    """Version 1 (tagged best) and version 2 after two more steps and a lower learning rate."""
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    train(model, optim, range(2), sched)
    cli.client.save(run_id, model, optim, scheduler=sched, step=2, metrics={"loss": 1.5}, tags=["best"])
    train(model, optim, range(2, 4), sched)
    cli.client.save(run_id, model, optim, scheduler=sched, step=4, metrics={"loss": 1.25, "acc": 0.5})
    return model


def test_json_shapes_are_the_records_fields() -> None:
    # A field added to the records changes `ls --json`; this makes it a deliberate change.
    assert set(RunInfo.model_fields) == RUN_FIELDS
    assert set(VersionInfo.model_fields) == VERSION_FIELDS


def test_ls_lists_runs_and_versions_as_tables_and_json(cli: Cli) -> None:
    two_versions(cli)
    cli.client.save("other", TinyNet(seed=3), step=7)
    text = cli.ok("ls")
    header, *rows = text.splitlines()
    assert header.split() == ["RUN", "VERSIONS", "LATEST", "LOGICAL", "STORED", "UPDATED"]
    assert {row.split()[0] for row in rows} == {"run", "other"}
    runs = json.loads(cli.ok("ls", "--json"))
    assert [set(r) for r in runs] == [RUN_FIELDS, RUN_FIELDS]
    assert {r["run_id"]: (r["versions"], r["latest_version"]) for r in runs} == {"run": (2, 2), "other": (1, 1)}

    header, first, second = cli.ok("ls", "run").splitlines()
    # One column per metric, sorted; '-' where a version has none.
    assert header.split() == ["VERSION", "STEP", "acc", "loss", "LOGICAL", "NEW", "DEDUP", "CREATED", "TAGS"]
    assert first.split()[:4] == ["1", "2", "-", "1.5"] and first.split()[-1] == "best"
    assert second.split()[:4] == ["2", "4", "0.5", "1.25"]
    versions = json.loads(cli.ok("ls", "run", "--json"))
    assert [set(v) for v in versions] == [VERSION_FIELDS, VERSION_FIELDS]
    assert [(v["version"], v["step"], v["tags"]) for v in versions] == [(1, 2, ["best"]), (2, 4, [])]
    assert versions[1]["metrics"] == {"loss": 1.25, "acc": 0.5}


def test_ls_of_a_run_shows_at_most_eight_metrics_compactly_and_notes_the_rest(cli: Cli) -> None:
    model = TinyNet()
    metrics = {f"m{i:02d}": 1 / 3 + i * 1000 for i in range(11)}
    cli.client.save("many", model, step=1, metrics=metrics)
    cli.client.save("many", model, step=2, metrics={"m00": 123456789.0})
    result = cli("ls", "many")
    assert result.exit_code == 0, result.output
    header, first, second = result.stdout.splitlines()
    assert header.split()[:11] == ["VERSION", "STEP", *(f"m{i:02d}" for i in range(8)), "LOGICAL"]
    assert first.split()[2:5] == ["0.3333", "1000", "2000"]
    assert second.split()[2:5] == ["1.235e+08", "-", "-"]
    assert "m08" not in result.stdout
    assert result.stderr == "note: 3 more metrics not shown (m08, m09, m10); --json lists every metric\n"
    assert json.loads(cli.ok("ls", "many", "--json"))[0]["metrics"] == metrics
    # A run without metrics shows no metric column and no note.
    cli.client.save("plain", model, step=1)
    quiet = cli("ls", "plain")
    assert quiet.stdout.split()[:3] == ["VERSION", "STEP", "LOGICAL"] and quiet.stderr == ""


def test_ls_of_an_empty_store_and_of_an_unknown_run(cli: Cli) -> None:
    assert json.loads(cli.ok("ls", "--json")) == []
    assert cli.ok("ls").split() == ["RUN", "VERSIONS", "LATEST", "LOGICAL", "STORED", "UPDATED"]
    missing = cli("ls", "nope")
    assert missing.exit_code == 1 and missing.stderr.strip() == "error: run 'nope' does not exist"
    bad = cli("ls", "../etc")
    assert bad.exit_code == 2 and bad.stderr.startswith("error: invalid run id")


def test_show_prints_the_summary_and_tensors_by_section(cli: Cli) -> None:
    two_versions(cli)
    text = cli.ok("show", "run@best")
    lines = text.splitlines()
    summary = {line.split()[0]: line.split(None, 1)[1] for line in lines[:7]}
    assert summary["run"] == "run" and summary["version"].startswith("1, created ")
    assert summary["step"] == "2" and summary["metrics"] == "loss=1.5" and summary["tags"] == "best"
    assert "logical" in summary["size"] and "deduplicated" in summary["size"] and "trainable" in summary["size"]
    titles = [line.split(":")[0] for line in lines if line and not line.startswith(" ") and ": " in line]
    assert [t for t in titles if t in {"model", "optimizer state", "scheduler"}] == [
        "model",
        "optimizer state",
        "scheduler",
    ]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("  ") and "NAME" not in line}
    assert rows["body.0.weight"] == ["body.0.weight", "F32", "[32,16]", "target", "cpu", "yes", "2.0", "KiB"]
    assert rows["bn.num_batches_tracked"][1:6] == ["I64", "[]", "target", "cpu", "no"]
    assert rows["body.0.weight/step"][1:6] == ["F32", "[]", "host", "cpu", "-"]
    assert rows["body.0.weight/exp_avg"][3] == "param"
    assert "version   2 (parent 1)" in cli.ok("show", "run")  # no @REF: latest


def test_show_json_has_the_version_and_the_manifest(cli: Cli) -> None:
    two_versions(cli)
    shown = json.loads(cli.ok("show", "run@2", "--json"))
    assert set(shown) == {"version", "manifest"}
    assert set(shown["version"]) == VERSION_FIELDS and shown["version"]["parent"] == 1
    manifest = shown["manifest"]
    assert manifest["run_id"] == "run" and manifest["version"] == 2 and manifest["step"] == 4
    assert manifest["format"] == "ckptstore.manifest/1" and set(manifest["state"]) == {"optim", "scheduler", "resume"}
    keys = [t["key"] for t in manifest["tensors"]]
    assert "model/head.weight" in keys and "optim/state/body.0.weight/exp_avg" in keys
    assert shown["version"]["tensors_total"] == len(keys)


def test_diff_reports_tensors_and_values_and_dumps_json(cli: Cli) -> None:
    model = two_versions(cli)
    text = cli.ok("diff", "run@1", "run@2")
    assert text.splitlines()[0] == "run@1 -> run@2"
    totals = {line.split()[0]: line.split()[1] for line in text.splitlines()[2:6]}
    assert set(totals) == {"added", "removed", "changed", "unchanged"} and int(totals["changed"]) > 0
    assert "optim/param_groups/0/lr" in text and "metrics/loss" in text and "metrics/acc" in text
    diff = json.loads(cli.ok("diff", "run@1", "run@latest", "--json"))
    assert set(diff) == {"run_a", "version_a", "run_b", "version_b", "totals", "tensors", "values"}
    values = {v["path"]: (v["before"], v["after"]) for v in diff["values"]}
    assert values["step"] == (2, 4) and values["metrics/loss"] == (1.5, 1.25) and values["metrics/acc"] == (None, 0.5)
    changed = {t["key"] for t in diff["tensors"] if t["status"] == "changed"}
    assert "model/body.0.weight" in changed and "model/bn.num_batches_tracked" in changed

    # Across runs: the same weights, model only, so the optimizer and scheduler show as removed.
    cli.client.save("copy", model)
    across = json.loads(cli.ok("diff", "run@2", "copy", "--json"))
    assert across["run_b"] == "copy" and across["totals"]["changed"]["count"] == 0
    assert across["totals"]["unchanged"]["count"] == len(model.state_dict())
    assert across["totals"]["removed"]["count"] > 0 and across["totals"]["added"]["count"] == 0
    same = cli.ok("diff", "run@2", "run@2")
    assert same.rstrip().endswith("no differences")


def test_bad_targets_are_clear_errors(cli: Cli) -> None:
    two_versions(cli)
    cases = {
        ("show", "run@"): (2, "nothing after '@'"),
        ("show", "run@@1"): (2, "invalid version reference"),
        ("show", "run@0"): (2, "invalid version reference"),
        ("show", "bad run"): (2, "invalid run id"),
        ("diff", "run@1", "run@x y"): (2, "invalid version reference"),
        ("show", "run@9"): (1, "run 'run' has no version 9"),
        ("show", "run@nosuchtag"): (1, "run 'run' has no tag 'nosuchtag'"),
        ("show", "nope@1"): (1, "run 'nope' does not exist"),
        ("diff", "run@1", "nope@1"): (1, "run 'nope' does not exist"),
    }
    for args, (code, message) in cases.items():
        result = cli(*args)
        assert result.exit_code == code, (args, result.output)
        assert result.stderr.startswith("error: ") and message in result.stderr, (args, result.stderr)
        assert result.stdout == ""
    usage = cli("diff", "run@1")
    assert usage.exit_code == 2  # a missing argument is Click's own usage error


def test_the_cli_module_imports_without_torch() -> None:
    # The service image has no torch but runs `ckptstore serve` and `ckptstore db`.
    probe = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None; "
        "from ckptstore.client.cli import app; app()"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, "db", "--help"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "upgrade" in done.stdout
