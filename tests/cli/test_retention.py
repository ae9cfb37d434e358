"""``ckptstore retention``: show, set, clear and apply a run's retention policy."""

from __future__ import annotations

import json

from tests.cli.conftest import Cli
from tests.client.models import TinyNet


def versions(cli: Cli, run_id: str = "run") -> list[int]:
    return [v["version"] for v in json.loads(cli.ok("ls", run_id, "--json"))]


def saved(cli: Cli, losses: list[float], tags: dict[int, str] | None = None) -> None:
    for index, loss in enumerate(losses):
        tag = (tags or {}).get(index + 1)
        cli.client.save("run", TinyNet(seed=index), metrics={"loss": loss}, tags=[tag] if tag else [])


def test_show_set_and_the_next_commit_applies(cli: Cli) -> None:
    saved(cli, [4.0, 3.0, 2.0, 1.0])
    assert cli.ok("retention", "run").splitlines() == ["run:    run", "policy: none (every version is kept)"]
    out = cli.ok("retention", "run", "--keep-last", "2")
    assert out.splitlines() == [
        "run:    run",
        "policy: keep the last 2 versions, plus every tagged version and the newest",
        "not kept: versions 1, 2 (removed at the next commit, or now with --apply)",
    ]
    assert versions(cli) == [1, 2, 3, 4]  # setting removes nothing
    cli.client.save("run", TinyNet(seed=9))
    assert versions(cli) == [4, 5]
    last_line = cli.ok("retention", "run").splitlines()[-1]
    assert last_line == "not kept: none (the policy keeps every version as the run stands)"


def test_apply_asks_first_then_removes_now(cli: Cli) -> None:
    saved(cli, [4.0, 1.0, 2.0, 3.0], tags={1: "first"})
    declined = cli("retention", "run", "--keep-best", "1", "--metric", "loss", "--apply", input="n\n")
    assert declined.exit_code == 1 and "Remove version 3 of run 'run' now?" in declined.stdout
    assert versions(cli) == [1, 2, 3, 4]
    policy = json.loads(cli.ok("retention", "run", "--json"))  # the policy was set before the question
    assert policy == {
        "run_id": "run",
        "keep_last": None,
        "keep_best": 1,
        "metric": "loss",
        "mode": "min",
        "would_remove": [3],
    }
    out = cli.ok("retention", "run", "--apply", input="y\n")
    assert "removed versions: 3" in out and "ckptstore gc" in out
    assert versions(cli) == [1, 2, 4]  # 1 tagged, 2 best, 4 newest
    assert "removed versions: none" in cli.ok("retention", "run", "--apply")  # nothing to remove: no question


def test_max_mode_json_and_clear(cli: Cli) -> None:
    saved(cli, [0.2, 0.9, 0.5])
    data = json.loads(cli.ok("retention", "run", "--keep-best", "1", "--metric", "loss", "--mode", "max", "--json"))
    assert (data["keep_best"], data["mode"], data["would_remove"]) == (1, "max", [1])
    applied = json.loads(cli.ok("retention", "run", "--apply", "--yes", "--json"))
    assert (applied["removed"], applied["would_remove"]) == ([1], [])
    assert versions(cli) == [2, 3]
    cleared = cli.ok("retention", "run", "--clear")
    assert "policy: none (every version is kept)" in cleared
    assert json.loads(cli.ok("retention", "run", "--json"))["keep_best"] is None


def test_command_line_mistakes_are_usage_errors(cli: Cli) -> None:
    saved(cli, [1.0])
    for args, message in (
        (("--clear", "--keep-last", "2"), "--clear removes the policy"),
        (("--keep-best", "2"), "--keep-best needs --metric"),
        (("--metric", "loss"), "--metric and --mode go with --keep-best"),
        (("--keep-last", "2", "--mode", "min"), "--metric and --mode go with --keep-best"),
        (("--keep-best", "2", "--metric", "loss", "--mode", "lowest"), "--mode must be min or max"),
        (("--keep-best", "2", "--metric", "no spaces"), "metric"),
        (("--keep-last", "0"), "Usage:"),  # typer's own range check
    ):
        result = cli("retention", "run", *args)
        assert result.exit_code == 2 and message in result.stderr, (args, result.stderr)
    assert cli("retention", "bad/run").exit_code == 2
    missing = cli("retention", "nope")
    assert missing.exit_code == 1 and missing.stderr.strip() == "error: run 'nope' does not exist"
    assert json.loads(cli.ok("retention", "run", "--json"))["keep_last"] is None  # nothing was set


def test_help_says_when_a_policy_applies(cli: Cli) -> None:
    text = " ".join(cli.ok("retention", "--help").split())
    assert "the next commit applies it, or --apply does now" in text
    assert "needs an admin token" in text


def test_retention_on_every_backend(any_cli: Cli) -> None:
    for seed in range(3):
        any_cli.client.save("run", TinyNet(seed=seed))
    data = json.loads(any_cli.ok("retention", "run", "--keep-last", "1", "--apply", "--yes", "--json"))
    assert (data["keep_last"], data["removed"], data["would_remove"]) == (1, [1, 2], [])
    assert versions(any_cli) == [3]
    any_cli.client.save("run", TinyNet(seed=5))
    assert versions(any_cli) == [4]
