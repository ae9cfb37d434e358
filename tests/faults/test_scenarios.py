"""The fault scenarios at small scale: no acknowledged version is ever lost, whatever breaks.

Each scenario (tests/faults/scenarios/) runs against real parts: a private PostgreSQL cluster
stopped and started, moto behind a TCP gate that cuts the link, the server process SIGKILLed
and restarted, saving client processes SIGKILLed, an embedded store on a full tmpfs, bits
flipped in blobs and in the metadata file, gc at grace 0 beside saves. Every one must end
with nothing acknowledged lost, no partial version, no gap in the numbering, no 500 answer,
and every failure a clean error of the store's error tree. bench/faults.py runs them larger.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from tests.faults.scenarios import bitflips, client_kill, disk_full
from tests.faults.scenarios.record import ScenarioResult, format_results
from tests.faults.scenarios.runner import SCENARIOS, run_scenario
from tests.faults.scenarios.s3_link import TcpGate

pytestmark = pytest.mark.slow  # servers, subprocesses, a PostgreSQL cluster: seconds each

SEED = 16


def run_small(name: str, tmp_path: Path) -> ScenarioResult:
    result = run_scenario(name, tmp_path, SEED)
    print(format_results([result]))
    return result


def assert_nothing_lost(result: ScenarioResult) -> None:
    """The invariants every scenario keeps."""
    why = result.describe()
    assert result.attempted >= 1 and result.acknowledged >= 1, why
    assert result.findings.lost == 0, why
    assert result.findings.partial == 0, why
    assert result.findings.gaps == 0, why
    assert result.findings.problems == [], why
    assert result.findings.committed >= result.acknowledged, why
    assert 500 not in result.status_5xx, why
    assert result.unclean == [], why


@pytest.mark.parametrize("name", ["database", "s3-link", "worker-kill"])
def test_an_outage_under_saving_clients_commits_every_save_once(name: str, tmp_path: Path) -> None:
    result = run_small(name, tmp_path)
    assert_nothing_lost(result)
    why = result.describe()
    # The fault was felt: the clients met 503 answers (database, S3) or dropped connections.
    assert sum(result.status_5xx.values()) + result.network_errors > 0, why
    assert set(result.status_5xx) <= {503}, why
    # Every save rode it out and committed exactly once.
    assert result.failed_saves == 0, why
    assert result.acknowledged == result.attempted == result.findings.committed, why


def test_killed_saving_clients_leave_no_partial_version_and_no_gap(tmp_path: Path) -> None:
    result = run_small("client-kill", tmp_path)
    assert_nothing_lost(result)
    assert result.notes["kills"] == client_kill.KILLS, result.describe()
    assert not result.status_5xx, result.describe()


def test_a_full_disk_fails_saves_cleanly_and_loses_nothing_saved_before(tmp_path: Path) -> None:
    result = run_small("disk-full", tmp_path)
    assert_nothing_lost(result)
    why = result.describe()
    assert result.failed_saves >= disk_full.FAILURES_IN_A_ROW, why  # the disk did fill up
    assert result.acknowledged >= 10, why  # ... after a good part of it held versions
    # Deleting half the versions and collecting at grace 0 works on the full disk and frees it.
    assert result.notes["freed_mib"] >= 4 and result.notes["saved_after_freeing"] == 1, why


def test_every_flipped_bit_is_detected_or_harmless(tmp_path: Path) -> None:
    result = run_small("bit-flips", tmp_path)
    assert_nothing_lost(result)
    notes, why = result.notes, result.describe()
    shard_flips = (bitflips.FLIPS + 1) // 2
    assert notes.get("shard_detected", 0) == shard_flips, why  # every shard byte is covered by a digest
    metadata = notes.get("metadata_detected", 0) + notes.get("metadata_harmless", 0)
    assert metadata == bitflips.FLIPS - shard_flips, why
    assert notes.get("metadata_detected", 0) >= 1, why


def test_saves_beside_a_gc_loop_at_grace_zero_all_commit(tmp_path: Path) -> None:
    result = run_small("gc-loop", tmp_path)
    assert_nothing_lost(result)
    why = result.describe()
    assert result.notes["gc_passes"] >= 1 and result.notes["gc_errors"] == 0, why
    assert result.failed_saves == 0, why


def test_every_scenario_has_a_test() -> None:
    assert set(SCENARIOS) == {"database", "s3-link", "worker-kill", "client-kill", "disk-full", "bit-flips", "gc-loop"}


def _echo_server() -> tuple[socket.socket, tuple[str, int]]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(4096):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    host, port = server.getsockname()[:2]
    return server, (host, port)


def assert_cut(sock: socket.socket) -> None:
    """Nothing comes back through ``sock``: it is reset or closed."""
    try:
        sock.sendall(b"x")
        assert sock.recv(16) == b""
    except (ConnectionResetError, BrokenPipeError):
        pass


def test_the_gate_relays_bytes_resets_them_while_cut_and_relays_again_once_restored() -> None:
    server, address = _echo_server()
    gate = TcpGate(address)
    port = int(gate.url.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as before:
            before.sendall(b"ping")
            assert before.recv(16) == b"ping"
            gate.cut()
            assert_cut(before)  # the open connection is cut...
        with socket.create_connection(("127.0.0.1", port), timeout=10) as during:
            assert_cut(during)  # ... and so is every new one
        gate.restore()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as after:
            after.sendall(b"pong")
            assert after.recv(16) == b"pong"
        assert gate.cuts == 1
    finally:
        gate.close()
        server.close()
