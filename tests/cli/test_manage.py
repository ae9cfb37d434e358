"""``ckptstore tag``, ``untag`` and ``rm`` (``gc`` has tests/cli/test_gc.py)."""

from __future__ import annotations

import json

from tests.cli.conftest import Cli
from tests.client.models import TinyNet


def versions(cli: Cli, run_id: str = "run") -> list[tuple[int, list[str]]]:
    return [(v["version"], v["tags"]) for v in json.loads(cli.ok("ls", run_id, "--json"))]


def test_tag_moves_and_untag_removes(cli: Cli) -> None:
    for seed in range(3):
        cli.client.save("run", TinyNet(seed=seed))
    assert cli.ok("tag", "run@1", "best").strip() == "run@best -> version 1"
    assert cli.ok("tag", "run", "release").strip() == "run@release -> version 3"  # no @REF: latest
    assert versions(cli) == [(1, ["best"]), (2, []), (3, ["release"])]
    assert cli.ok("tag", "run@release", "best").strip() == "run@best -> version 3"  # a tag moves
    assert json.loads(cli.ok("show", "run@best", "--json"))["version"]["version"] == 3
    assert cli.ok("untag", "run", "best").strip() == "removed tag best from run"
    assert versions(cli) == [(1, []), (2, []), (3, ["release"])]

    again = cli("untag", "run", "best")
    assert again.exit_code == 1 and again.stderr.strip() == "error: run 'run' has no tag 'best'"
    for bad in ("latest", "1st", "a b"):
        result = cli("tag", "run@1", bad)
        assert result.exit_code == 2 and result.stderr.startswith("error: invalid tag"), bad
    assert cli("untag", "run@1", "release").exit_code == 2
    assert cli("tag", "nope", "best").exit_code == 1


def test_rm_asks_first_and_deletes_one_version(cli: Cli) -> None:
    for seed in range(3):
        cli.client.save("run", TinyNet(seed=seed), tags=[f"v{seed + 1}"])
    declined = cli("rm", "run@v2", input="n\n")
    assert declined.exit_code == 1 and "Delete version 2 of run 'run'?" in declined.stdout
    assert [v for v, _ in versions(cli)] == [1, 2, 3]
    no_terminal = cli("rm", "run@2")  # nobody to answer: nothing is deleted
    assert no_terminal.exit_code == 1 and [v for v, _ in versions(cli)] == [1, 2, 3]

    confirmed = cli.ok("rm", "run@v2", input="y\n")
    assert "deleted run@2" in confirmed and "ckptstore gc" in confirmed
    assert versions(cli) == [(1, ["v1"]), (3, ["v3"])]
    assert "deleted run@3" in cli.ok("rm", "run", "--yes")  # no @REF: latest
    assert "deleted run@1" in cli.ok("rm", "run@1", "-y")
    assert json.loads(cli.ok("ls", "--json"))[0]["versions"] == 0

    gone = cli("rm", "run@1", "-y")
    assert gone.exit_code == 1 and "has no version 1" in gone.stderr
    assert cli("rm", "run@", "-y").exit_code == 2
