"""Saving client processes SIGKILLed at seeded moments while they save through a server.

The clients are the crash test's victims (:mod:`tests.stress.victim`, one forked process per
job of a few saves) and each kill point is drawn as the crash test draws it
(:func:`tests.stress.harness.choose_target`): a phase of the save, exactly there or a moment
later. Afterwards the store must hold no partial version, no gap in the numbering, and every
save a client reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
from pathlib import Path

from ckptstore.client.api import Client
from ckptstore.service.api import create_app
from ckptstore.service.errors import NotFoundError
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.faults.scenarios.checks import check_store
from tests.faults.scenarios.record import ScenarioResult, Tally
from tests.faults.scenarios.savers import CountedApp
from tests.servers import running_server
from tests.stress.checks import RUN
from tests.stress.harness import JOB_SAVES, SHARD_BYTES, KillSwitch, choose_target
from tests.stress.model import expected_state, state_sha
from tests.stress.procs import Peer, Stuck, child_env, start_victims

KILLS = 6


def run(workdir: Path, seed: int, scale: int) -> ScenarioResult:
    """Kill ``KILLS * scale`` saving clients, then check the store."""
    home, tmp = workdir / "home", workdir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    tally = Tally()
    kills = jobs = 0
    store = Store.open_home(home)
    try:
        with running_server(CountedApp(create_app(store, Settings(home=home)), tally)) as url:  # type: ignore[arg-type]
            victims = start_victims(child_env(home, tmp), workdir / "victims.log")
            try:
                while kills < KILLS * scale and jobs < 4 * KILLS * scale:
                    jobs += 1
                    kills += _kill_one_job(victims, url, store, seed, rng, tally)
            finally:
                victims.stop()
            shas: dict[int, str] = {}

            def expected(run: str, step: int) -> str:
                if step not in shas:
                    shas[step] = state_sha(expected_state(seed, step))
                return shas[step]

            with Client(url) as ckpt:
                findings = check_store(ckpt, [RUN], tally.acknowledged, expected)
    finally:
        store.close()
    return ScenarioResult.of("client-kill", seed, scale, tally, findings, kills=kills, jobs=jobs)


def _next_step(store: Store) -> int:
    try:
        steps = [info.step for info in store.versions(RUN) if info.step is not None]
    except NotFoundError:
        steps = []
    return max(steps, default=-1) + 1


def _kill_one_job(victims: Peer, url: str, store: Store, seed: int, rng: random.Random, tally: Tally) -> int:
    """Run one job of saves, killing its process at a drawn phase; 1 if the kill landed."""

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):  # already gone: how it ended says so
            os.kill(victims.child_pid, signal.SIGKILL)

    switch = KillSwitch(choose_target(rng, "http-client"), victims.send, kill)
    victims.on_phase = switch
    job = {"run": RUN, "seed": seed, "start": _next_step(store), "count": JOB_SAVES, "wait": True}
    victims.send(json.dumps({**job, "shard_bytes": SHARD_BYTES, "home": None, "url": url}))
    while True:
        line = victims.next_line()
        if line is None:
            raise Stuck("the victims' fork server died")
        if line.startswith("saved "):
            saved = json.loads(line[len("saved ") :])
            tally.attempt()
            tally.acknowledge(RUN, int(saved["version"]), str(saved["sha"]))
        elif line.startswith("error "):
            name, _, message = line[len("error ") :].partition(" ")
            tally.attempt()
            tally.failed_with(name, message, clean=True)  # the victim reports only CheckpointErrors
        elif line.startswith("exit "):
            how = line.split()[2]
            break
    if how == f"signal:{signal.SIGKILL.value}" and switch.fired:
        tally.attempt()  # the save it was in the middle of
        return 1
    if how not in ("code:0", "code:3"):
        tally.failed_with("crash", f"a saving client ended with {how}", clean=False)
    return 0
