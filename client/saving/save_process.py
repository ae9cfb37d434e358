"""Background saves in a save process, so the training process's interpreter stays with training.

A background save on a thread of the training process holds that process's interpreter while it
hashes, builds the manifest and commits: a loop that launches its work from Python pays for
every millisecond of it (``bench/async_save.py`` measures it). With ``Client(background="process")``
the snapshot is copied into a shared file (:mod:`client.saving.shared_staging`) and the rest of
the save runs in a helper process this client starts on its first background save and keeps:
it opens the same store (the same server, with the client's token; else the same ``home`` and
environment) and runs the same save
(:class:`client.saving.saver.SaveRun`) on the staged copies. The client's background thread
only sends the save's records and reads the answer.

The two processes talk in JSON lines over the helper's stdin and a private copy of its stdout
(no pickling): the helper's own output goes to stderr. It answers the opening line once it has
opened the store, so a client may start it ahead of its first save (:meth:`SaveProcess.start`).
The helper keeps the last request's records (each tensor's key, placement, dtype, shape and
place in the file) and state (the JSON naming them), which a training loop's saves repeat: the
client sends them again only when they change, and asks back only for the digests its cache
must learn. A tensor whose digest the client's cache knew was not staged; if the store lacks it
(another process deleted its versions), the helper says so and the client saves from its own
thread, which can read the live tensor. If the helper dies, the save fails with a StorageError
(the version may or may not exist, as for a process killed while it commits) and the next
background save starts a new one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from ckptstore.client.connection import open_transport
from ckptstore.client.results import SaveResult
from ckptstore.client.saving.hashing import DigestCache, SaveLedger
from ckptstore.client.saving.packed_staging import views
from ckptstore.client.saving.saver import SaveRun, SaveSettings, Snapshot
from ckptstore.client.saving.shared_staging import SharedSnapshot
from ckptstore.client.state import FlatState, TensorRecord
from ckptstore.client.tensors import NAME_TO_TORCH, dtype_name
from ckptstore.service.errors import CheckpointError, MissingTensorsError, StorageError, error_class_for_code
from ckptstore.service.secrets_mask import mask_urls

#: How the helper starts: ``python -c _LAUNCH FD``, :data:`BOOTSTRAP` then :func:`main`.
#: ``python -m`` would put the working folder first on its path, where a folder named
#: ``ckptstore`` (a project's own, a checkout of this one) would be imported in place of the
#: installed package, so the working folder is dropped: the helper imports ckptstore from where the
#: installation put it (site-packages, or an editable install's finder), as the client did.
BOOTSTRAP = (
    "'ckptstore save process'; "  # what ps and top show first
    # Ctrl-C in a terminal interrupts every process of the foreground job, this one too; the client
    # decides when the helper ends (its end line), so a save under way finishes, as on its thread.
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
)
_LAUNCH = BOOTSTRAP + "from ckptstore.client.saving.save_process import main; main()"
#: Seconds ``close`` waits for the helper to finish after it was asked to (:data:`END`).
CLOSE_SECONDS = 30.0
#: Shared files the helper keeps mapped: a client alternates between two (see client.saving.background).
FILES_KEPT = 2
#: A request's records or state when they are those of the request before (most saves of a
#: training loop repeat both: the same tensors, and the optimizer's state naming them).
SAME = "same"
#: The line that ends the helper. Closing its input alone would not: a process forked from the
#: client's (a data loader's worker) holds a copy of the input's write end, so no end of input comes.
END = b'"end"\n'
#: The fields of a request the helper keeps from one to the next.
REPEATED = ("records", "state")
#: How often the helper looks whether the client's process is still its parent (:func:`watch_parent`).
PARENT_CHECK_SECONDS = 1.0


class SaveProcess:
    """The helper process of one client; :meth:`save` is called from that client's background thread."""

    def __init__(
        self,
        home: str | None,
        shard_bytes: int,
        uploads_in_flight: int,
        *,
        url: str | None = None,
        token: str | None = None,
        retry_seconds: float | None = None,
    ) -> None:
        """The helper opens the store the client opened: the server at ``url`` (with ``token``
        and ``retry_seconds``, sent over its input, never its arguments or environment), else
        the embedded store in ``home``, else the one the environment names."""
        self._opening = {
            "home": home,
            "shard_bytes": shard_bytes,
            "uploads_in_flight": uploads_in_flight,
            "url": url,
            "token": token,
            "retry_seconds": retry_seconds,
        }
        self._process: subprocess.Popen[bytes] | None = None
        self._answers: IO[bytes] | None = None
        self._lock = threading.Lock()
        #: The :data:`REPEATED` fields of the last request the running helper was sent.
        self._sent: dict[str, Any] = {}
        #: Whether a helper has answered a save (one that never did may not be able to start).
        self.answered = False
        #: Set once a :meth:`start` has ended: the helper is ready to save, or :attr:`start_error` says why not.
        self.started = threading.Event()
        self.start_error: Exception | None = None
        self._starting = False

    def start(self) -> None:
        """Start the helper now, on a thread of its own, and return at once: :attr:`started` is
        set once it has opened the store (a save then goes ahead without waiting for its start)."""

        self._starting = True

        def run() -> None:
            try:
                with self._lock:
                    self._started()
            except Exception as exc:  # whatever stops it (subprocess refuses pass_fds on Windows): no helper
                self.start_error = exc
            finally:
                self.started.set()

        threading.Thread(target=run, name="ckptstore-save-process-start", daemon=True).start()

    @property
    def pid(self) -> int | None:
        """The helper's process id while it runs."""
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    def save(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one save to the helper and return its answer (see :func:`serve`).

        Raises:
            StorageError: the helper ended before it answered.
        """
        with self._lock:
            process, answers = self._started()
            sent, self._sent = self._sent, {name: message[name] for name in REPEATED}
            # The helper keeps the last ones: say so only.
            message = {**message, **{name: SAME for name in REPEATED if name in sent and sent[name] == message[name]}}
            try:
                assert process.stdin is not None
                process.stdin.write(json.dumps(message).encode() + b"\n")
                process.stdin.flush()
                line = answers.readline()
            except OSError:
                line = b""
            if not line:
                code = self._ended()
                raise StorageError(
                    f"the save process ended (exit status {code}) before it answered; the version may not exist"
                )
            answer: dict[str, Any] = json.loads(line)
            self.answered = True
            return answer

    def close(self) -> None:
        """End the helper: its input is closed, it finishes and exits (killed if it does not).
        One that :meth:`start` is still waiting for is killed first: it reads no input until it
        has opened the store, and its start holds the lock until then."""
        starting = self._process
        if self._starting and not self.started.is_set() and starting is not None:
            starting.kill()
        with self._lock:
            self._ended()

    def _started(self) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
        if self._process is not None and self._process.poll() is None and self._answers is not None:
            return self._process, self._answers
        self._ended()
        self._sent = {}  # a new helper holds none
        read, write = os.pipe()
        env = {**os.environ, "CKPTSTORE_DISABLE_PROGRESS_BARS": "1"}
        process = subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, str(write)],
            stdin=subprocess.PIPE,
            pass_fds=(write,),
            env=env,
        )
        os.close(write)
        self._process, self._answers = process, os.fdopen(read, "rb")
        assert process.stdin is not None
        try:
            process.stdin.write(json.dumps(self._opening).encode() + b"\n")
            process.stdin.flush()
            ready = self._answers.readline()  # once the helper has opened the store
        except OSError:
            ready = b""
        if not ready:
            code = self._ended()
            raise StorageError(f"the save process ended (exit status {code}) before it opened the store")
        return process, self._answers

    def _ended(self) -> int | None:
        """Forget the helper: ask it to end (:data:`END`), close its input, wait for it to exit
        (kill it after :data:`CLOSE_SECONDS`); its exit status (None if there was none)."""
        process, self._process = self._process, None
        if self._answers is not None:
            self._answers.close()
            self._answers = None
        if process is None:
            return None
        if process.stdin is not None:
            try:
                process.stdin.write(END)
                process.stdin.flush()
            except OSError:  # it has exited already
                pass
            try:
                process.stdin.close()
            except OSError:
                pass
        try:
            return process.wait(CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()


def message(
    shared: SharedSnapshot,
    flat: FlatState,
    run_id: str,
    *,
    step: int | None,
    metrics: dict[str, float] | None,
    tags: list[str],
    ledger: SaveLedger,
) -> dict[str, Any]:
    """What the helper needs of a save: each record's place, the state tree, step, metrics, tags,
    and which staged tensors changed in place since the client's last save (``ledger``, which
    follows the live tensors: the helper sees only their copies)."""
    snapshot = shared.snapshot
    marks = snapshot.marks or {}
    live = [record.tensor for record in flat.records]
    moved = [index for index, changed in enumerate(ledger.changed(live, marks)) if changed]
    records = [
        [
            record.key,
            record.placement,
            record.param,
            record.trainable,
            record.requires_grad,
            dtype_name(tensor, record.key),
            list(tensor.shape),
            device,
            known,
            offset,
        ]
        for record, tensor, device, known, offset in zip(
            flat.records, snapshot.tensors, snapshot.device_types, snapshot.known, shared.offsets, strict=True
        )
    ]
    return {
        "run_id": run_id,
        "step": step,
        "metrics": metrics,
        "tags": tags,
        "file": shared.path,
        "size": shared.size,
        "records": records,
        "state": flat.state,
        "optimizer_class": flat.optimizer_class,
        "digests_of": sorted(snapshot.teach),
        "moved": moved,
    }


def save_elsewhere(
    helper: SaveProcess, shared: SharedSnapshot, request: Callable[[], dict[str, Any]], *, started: float,
    cache: DigestCache | None, ledger: SaveLedger,
) -> SaveResult | None:  # fmt: skip
    """Have ``helper`` save ``shared`` (``request`` builds its :func:`message`); None if it cannot
    (the store lacks a tensor only the live model holds: the client saves on its own thread
    instead). Teaches ``cache`` the digests of the frozen tensors the snapshot staged, and
    ``ledger`` the marks of the live tensors it copied."""
    snapshot = shared.snapshot
    if snapshot.copied is not None:
        snapshot.copied.synchronize()  # the copies from the device are in the shared file
    answer = helper.save(request())
    done = answer_to_result(answer, snapshot)
    if done is None:
        return None
    result, digests = done
    if cache is not None:
        for index, (live, taken) in snapshot.teach.items():
            cache.put(live, digests[index], taken)
    if snapshot.marks is not None:
        ledger.follow(snapshot.marks)
    return dataclasses.replace(result, seconds=time.perf_counter() - started)


def answer_to_result(answer: dict[str, Any], snapshot: Snapshot) -> tuple[SaveResult, dict[int, str]] | None:
    """The SaveResult and the digests the request asked for (those of ``snapshot.teach``), by
    record index, from the helper's answer; None if the helper found a digest the client knew
    missing from the store (save on the client's thread then).

    Raises:
        CheckpointError: the save's error, of the class the helper raised (by its code).
    """
    if "missing" in answer:
        return None
    if "error" in answer:
        kind = error_class_for_code(str(answer["error"].get("code")))
        if kind is MissingTensorsError:  # swept since the helper looked: the live model has it
            return None
        raise kind(str(answer["error"].get("message")))
    result = SaveResult(**answer["result"])
    digests = {int(index): str(digest) for index, digest in answer["digests"].items()}
    if digests.keys() != snapshot.teach.keys():
        raise CheckpointError("the save process answered with other digests than the save asked for")
    return result, digests


# -- the helper ------------------------------------------------------------------------


def serve(requests: IO[bytes], answers: IO[bytes], busy: threading.Lock) -> None:
    """The helper's loop: open the store the first line names, say so (a ready line), then answer
    each save line until the :data:`END` line (or the end of the input); ``busy`` is held while a
    save runs."""
    opening = json.loads(requests.readline() or b"null")
    if not isinstance(opening, dict):
        return
    url, home, token, retry = (opening.get(name) for name in ("url", "home", "token", "retry_seconds"))
    transport = open_transport(url, home, token, retry_seconds=retry)
    try:
        prepare_writes = getattr(transport, "prepare_writes", None)
        if prepare_writes is not None:
            prepare_writes()
        answers.write(b'{"ready": true}\n')  # the client may send saves without waiting for this start
        answers.flush()
        # No digest cache: every tensor comes staged or with its digest. Its own ledger: what its
        # last version references need not be asked about again.
        settings = SaveSettings(
            transport, int(opening["shard_bytes"]), int(opening["uploads_in_flight"]), None, SaveLedger()
        )
        held = _Held()
        for line in requests:
            if line == END:
                break
            with busy:
                try:
                    answer = _save(settings, json.loads(line), held)
                except CheckpointError as exc:
                    answer = {"error": {"code": exc.code, "message": str(exc)}}
                except Exception as exc:  # anything else is this save's failure, not the helper's end
                    text = mask_urls(f"{type(exc).__name__}: {exc}")  # a driver's text may hold a URL's secrets
                    answer = {"error": {"code": CheckpointError.code, "message": text}}
                answers.write(json.dumps(answer).encode() + b"\n")
                answers.flush()
    finally:
        transport.close()


@dataclass
class _Held:
    """What the helper keeps from save to save: the shared files it maps, the last request's
    :data:`REPEATED` fields."""

    files: dict[str, torch.Tensor] = field(default_factory=dict)
    repeated: dict[str, Any] = field(default_factory=dict)

    def resolve(self, request: dict[str, Any]) -> None:
        """Put back into ``request`` the fields it says are as before, and keep its others."""
        for name in REPEATED:
            if request[name] == SAME:  # as in the last request: the client sends them when they change
                if name not in self.repeated:
                    raise CheckpointError(f"the save process was sent no {name} to reuse")
                request[name] = self.repeated[name]
            self.repeated[name] = request[name]


def _save(settings: SaveSettings, request: dict[str, Any], held: _Held) -> dict[str, Any]:
    """Run one save of the staged copies in the shared file ``request`` names."""
    path, size = str(request["file"]), int(request["size"])
    files = held.files
    host = files.get(path)
    if host is None:
        while len(files) >= FILES_KEPT:  # the client has removed the oldest (a new layout)
            del files[next(iter(files))]
        host = files[path] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    held.resolve(request)
    records = request["records"]
    flat = FlatState()
    tensors: list[torch.Tensor] = []
    known: list[str | None] = []
    devices: list[str] = []
    for key, placement, param, trainable, requires_grad, dtype, shape, device, digest, offset in records:
        kind = NAME_TO_TORCH[dtype]
        if offset is None:  # known to the client's cache, not staged: only its digest is needed
            tensor = torch.empty(shape, dtype=kind, device="meta")
        else:
            tensor = views(host, [(kind, torch.Size(shape))], [offset])[0]
        flat.records.append(TensorRecord(key, tensor, placement, param, trainable, requires_grad))
        tensors.append(tensor)
        known.append(digest)
        devices.append(device)
    flat.state = request["state"]
    flat.optimizer_class = request.get("optimizer_class")
    moved = [False] * len(records)
    for index in request.get("moved", ()):
        if type(index) is not int or not 0 <= index < len(records):
            raise CheckpointError(f"the save process was sent a record index it does not have: {index!r}")
        moved[index] = True
    # Digests the client knew are not staged: ask the store for those the last committed
    # version does not reference (after a first save, none of a LoRA model's frozen weights),
    # as the save itself, so that those it has are held for it until its commit.
    save_key = uuid.uuid4().hex
    unasked = [d for d in known if d is not None and d not in settings.ledger.committed]
    if unasked and settings.transport.missing(unasked, save_key=save_key):
        return {"missing": True}
    run = SaveRun(
        settings,
        request["run_id"],
        flat,
        step=request["step"],
        metrics=request["metrics"],
        tags=list(request["tags"]),
        started=time.perf_counter(),
        snapshot=Snapshot(tensors, known, {}, 0, devices, None, moved=moved),
        save_key=save_key,
    )
    result = run.run()
    return {"result": dataclasses.asdict(result), "digests": {i: run.digests[i] for i in request["digests_of"]}}


def main() -> None:
    """Entry point of the helper, started by :data:`_LAUNCH` (``sys.argv[1]``: the descriptor its
    answers go to)."""
    answers = os.fdopen(int(sys.argv[1]), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the answers
    busy = threading.Lock()
    watch_parent(busy)
    serve(sys.stdin.buffer, answers, busy)


def watch_parent(busy: threading.Lock) -> None:
    """End this helper once the client's process is gone (it has another parent then), when no
    save runs (``busy`` free): a killed client sends no end line, and a process forked from it (a
    worker of its own pool) may hold the helper's input open, so no end of input comes either."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_SECONDS)
        with busy:  # a save under way finishes (its version may exist, as for a client killed mid-save)
            os._exit(0)

    threading.Thread(target=watch, name="ckptstore-parent-watch", daemon=True).start()
