"""What the HTML pages show, shaped from the store's records (no HTTP, no HTML, no torch).

Each ``*_page`` function reads what one page needs through the public :class:`Store` methods
(and, for the run page, the bounded listings of :mod:`service.catalog.listings`) and returns a plain
dataclass the template walks. The runs index lives in :mod:`service.api.pages.index`, the run
page in :mod:`service.api.pages.runs`, the template filters in :mod:`service.api.pages.formatting`;
this module holds the version and diff pages and names the rest for the routes. Nothing here
escapes text: the templates autoescape every value.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from ckptstore.service.api.http.streaming import PIECE_BYTES
from ckptstore.service.api.pages import snippets, tensor_values
from ckptstore.service.api.pages.formatting import (
    delta,
    full_json,
    human_size,
    number,
    percent,
    reading_json,
    shape,
    when,
)
from ckptstore.service.api.pages.index import RunsIndex, runs_index
from ckptstore.service.api.pages.model_share import trainable_share
from ckptstore.service.api.pages.numbers import NumberFormat
from ckptstore.service.api.pages.runs import (
    PER_PAGE,
    Order,
    RetentionView,
    RunFilter,
    RunPage,
    query_url,
    run_page,
    run_url,
    version_url,
)
from ckptstore.service.catalog.diff import TensorChange, VersionDiff, diff_manifests
from ckptstore.service.errors import InvalidInputError, NotFoundError
from ckptstore.service.format.encoded_reads import iter_decoded
from ckptstore.service.format.manifest import Manifest, TensorEntry
from ckptstore.service.format.names import parse_ref
from ckptstore.service.format.records import VersionInfo
from ckptstore.service.store import Store

__all__ = [
    "PER_PAGE",
    "Order",
    "RetentionView",
    "RunFilter",
    "RunPage",
    "RunsIndex",
    "human_size",
    "number",
    "percent",
    "run_page",
    "run_url",
    "runs_index",
    "shape",
    "version_url",
    "when",
]

#: Sections of a version page: (title, key prefix); the first matching prefix wins.
SECTIONS = (
    ("Model", "model/"),
    ("Optimizer state", "optim/state/"),
    ("Param groups", "optim/param_groups/"),
    ("Optimizer state", "optim/"),
    ("Scheduler", "scheduler/"),
    ("Extra", "extra/"),
    ("Resume (generators, data loader)", "resume/"),
)
#: Rows one table shows at most; a page of a million tensors would be too big to be useful.
MAX_ROWS = 5000


# -- one version --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRow:
    """One tensor of a version page; ``shared`` is None when there is no parent to compare with."""

    entry: TensorEntry
    name: str
    shared: bool | None


@dataclass
class Section:
    """The tensors of one section (model, optimizer state, …): those shown, and its totals."""

    title: str
    prefix: str
    rows: list[TensorRow] = field(default_factory=list)
    count: int = 0
    nbytes: int = 0
    matched: int = 0

    @property
    def hidden(self) -> int:
        """Matching tensors not listed because the section passed :data:`MAX_ROWS`."""
        return self.matched - len(self.rows)


@dataclass(frozen=True)
class VersionPage:
    """A version's header figures, its tensors grouped by section, and how to load it.

    ``q`` filters the tensors listed (the figures stay those of the whole version).
    """

    info: VersionInfo
    manifest: Manifest
    parent_exists: bool
    sections: list[Section]
    model_bytes: int
    shared_bytes: int | None
    q: str = ""

    @property
    def trainable_share(self) -> float | None:
        """Trainable bytes over the model's bytes, as on the run page (None with no model tensors)."""
        return trainable_share(self.info.bytes_trainable, self.model_bytes)

    @property
    def matched(self) -> int:
        """Tensors ``q`` matches (all of them without ``q``)."""
        return sum(section.matched for section in self.sections)

    def has(self, part: str) -> bool:
        """True when the version holds state under ``part`` ('optim', 'scheduler'): tensors or JSON."""
        tensors = any(section.count and section.prefix.startswith(part + "/") for section in self.sections)
        return tensors or part in self.manifest.state

    def python_snippet(self, server: str) -> str:
        """Python that loads this version from the store at ``server`` (:mod:`.snippets`)."""
        info = self.info
        return snippets.python_snippet(
            server, info.run_id, info.version, optim=self.has("optim"), scheduler=self.has("scheduler")
        )

    def cli_snippet(self, server: str) -> str:
        """Shell commands that show this version and export it (:mod:`.snippets`)."""
        return snippets.cli_snippet(server, self.info.run_id, self.info.version)


def section_of(key: str) -> tuple[str, str]:
    """(section title, prefix) of a tensor key."""
    for title, prefix in SECTIONS:
        if key.startswith(prefix) and len(key) > len(prefix):
            return title, prefix
    return "Extra", ""


def key_matcher(q: str) -> Callable[[str, str], bool]:
    """Whether (key, name in its section) matches ``q``: a glob when it holds * ? or [, else a
    substring of the key, ignoring case."""
    if any(c in q for c in "*?["):
        return lambda key, name: fnmatchcase(key, q) or fnmatchcase(name, q)
    needle = q.lower()
    return lambda key, name: needle in key.lower()


def find_version(store: Store, run_id: str, version: int) -> VersionInfo:
    """The record of one version (tags and sizes); NotFoundError if it went away meanwhile."""
    return store.version(run_id, version)


def _parent_digests(store: Store, manifest: Manifest) -> set[str] | None:
    if manifest.parent is None:
        return None
    try:
        return store.manifest(manifest.run_id, manifest.parent).digests()
    except NotFoundError:  # the parent was deleted: nothing to compare with
        return None


def version_page(store: Store, run_id: str, ref: str, q: str = "") -> VersionPage:
    """The version ``ref`` names, each tensor marked shared if its bytes are in the parent too;
    with ``q``, only the tensors whose key matches it are listed."""
    manifest = store.manifest(run_id, ref)
    info = find_version(store, run_id, manifest.version)
    parent = _parent_digests(store, manifest)
    q = q.strip()
    matches = key_matcher(q) if q else None
    sections: dict[str, Section] = {}
    shared_bytes = 0
    for entry in manifest.tensors:
        title, prefix = section_of(entry.key)
        section = sections.setdefault(title, Section(title, prefix))
        shared = None if parent is None else set(entry.digests()) <= parent
        section.count += 1
        section.nbytes += entry.nbytes
        shared_bytes += entry.nbytes if shared else 0
        name = entry.key.removeprefix(prefix)
        if matches is None or matches(entry.key, name):
            section.matched += 1
            if len(section.rows) < MAX_ROWS:
                section.rows.append(TensorRow(entry, name, shared))
    order = list(dict.fromkeys(title for title, _ in SECTIONS))
    ordered = [sections[title] for title in order if title in sections]
    model = sections.get("Model")
    return VersionPage(
        info,
        manifest,
        parent is not None,
        ordered,
        model.nbytes if model else 0,
        None if parent is None else shared_bytes,
        q,
    )


@dataclass(frozen=True)
class TensorDownload:
    """A whole stored tensor's bytes: where they are and what to call the file."""

    filename: str
    nbytes: int
    chunks: Iterator[bytes | memoryview]


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_DOTS = re.compile(r"\.{2,}")
#: Characters of a tensor key kept in a download's file name.
MAX_NAME_CHARS = 120


def download_name(entry: TensorEntry) -> str:
    """A file name for a tensor's bytes made from its key: 'model/fc.weight' -> 'model.fc.weight.f32.bin'.

    Only letters, digits, '.', '_' and '-' survive (any other run of characters becomes '_', a
    '/' becomes '.' and runs of dots one dot), so the name is safe in a Content-Disposition header and on any file
    system; a long key is cut and told apart by the start of its digest.
    """
    base = _DOTS.sub(".", _UNSAFE.sub("_", entry.key.replace("/", "."))).strip("._-") or "tensor"
    if len(base) > MAX_NAME_CHARS:
        base = base[:MAX_NAME_CHARS].rstrip("._-") + "-" + entry.digests()[0][:12]
    return f"{base}.{entry.dtype.lower()}.bin"


def tensor_download(store: Store, run_id: str, ref: str, key: str) -> TensorDownload:
    """The raw bytes of tensor ``key`` of a version (stored whole; chunked tensors are refused)."""
    manifest = store.manifest(run_id, ref)
    entry = next((e for e in manifest.tensors if e.key == key), None)
    if entry is None:
        raise NotFoundError(f"version {manifest.version} of run {run_id!r} has no tensor {key[:200]!r}")
    if entry.digest is None:
        raise InvalidInputError(
            f"tensor {key[:200]!r} is stored in {len(entry.digests())} chunks; load it with the client instead"
        )
    located = store.locate([entry.digest])
    location = located[entry.digest]
    if location.encoded:  # compressed at rest: decoded a block at a time as it is sent, and checked
        pieces = iter_decoded(store.read_into, located, entry.digest, PIECE_BYTES)
        return TensorDownload(download_name(entry), location.nbytes, pieces)
    chunks = store.iter_shard(location.shard_id, location.offset, location.nbytes, PIECE_BYTES)
    return TensorDownload(download_name(entry), location.nbytes, chunks)


# -- the diff between two versions ---------------------------------------------------------------


@dataclass(frozen=True)
class ValueRow:
    """A hyperparameter, metric or step that moved: both values rounded and in full, and the change."""

    path: str
    before: str
    after: str
    before_full: str
    after_full: str
    change: tuple[str, str, str] | None  # (difference, in full, relative), for two numbers


@dataclass(frozen=True)
class DiffRow:
    """A tensor of the diff: its change, the bytes that differ and, when asked, how its values moved.

    ``changed_bytes`` counts the bytes of the pieces (the whole tensor, or its chunks) whose
    digests differ; None when the dtype, shape or chunking changed.
    """

    change: TensorChange
    changed_bytes: int | None = None
    values: tensor_values.Comparison | str | None = None


@dataclass(frozen=True)
class DiffPage:
    """Two versions compared: totals per status, the tensors shown and the changed values."""

    run_id: str
    diff: VersionDiff
    rows: list[DiffRow]
    shown_all: bool
    hidden: int
    values: list[ValueRow]
    compared: bool = False

    def url(self, *, show_all: bool | None = None, compare: bool | None = None) -> str:
        """This diff with or without the unchanged tensors, with or without the values compared."""
        show_all = self.shown_all if show_all is None else show_all
        compare = self.compared if compare is None else compare
        path = f"{run_url(self.run_id)}/diff"
        return query_url(
            path,
            a=self.diff.version_a,
            b=self.diff.version_b,
            all=1 if show_all else None,
            values=1 if compare else None,
        )


def pick_pair(a: str | None, b: str | None, ticked: list[str]) -> tuple[str, str, bool]:
    """The two refs to compare: ``a`` and ``b``, or the two ticked rows (then in version order)."""
    if a and b:
        return a, b, False
    if len(ticked) == 2 and not (a or b):
        return ticked[0], ticked[1], True
    raise InvalidInputError("pick two versions to compare: /runs/<run>/diff?a=3&b=5 (or tick exactly two rows)")


def _value_row(path: str, before: Any, after: Any) -> ValueRow:
    fmt = NumberFormat.of([before, after])  # both sides of a row written alike
    return ValueRow(
        path,
        reading_json(before, fmt),
        reading_json(after, fmt),
        full_json(before),
        full_json(after),
        delta(before, after, path, fmt),
    )


def _tensor_rows(
    store: Store, older: Manifest, newer: Manifest, changes: list[TensorChange], compare: bool
) -> list[DiffRow]:
    before = {e.key: e for e in older.tensors}
    after = {e.key: e for e in newer.tensors}
    budget = [tensor_values.MAX_COMPARED_BYTES]
    rows = []
    for change in changes:
        if change.status != "changed":
            rows.append(DiffRow(change))
            continue
        old, new = before[change.key], after[change.key]
        pieces = tensor_values.changed_pieces(old, new)
        changed = None if pieces is None else sum(nbytes for _, _, nbytes in pieces)
        values = tensor_values.compare_entries(store, old, new, budget) if compare else None
        rows.append(DiffRow(change, changed, values))
    return rows


def diff_page(
    store: Store,
    run_id: str,
    a: str,
    b: str,
    *,
    by_number: bool = False,
    show_all: bool = False,
    compare: bool = False,
) -> DiffPage:
    """Compare versions ``a`` and ``b`` (numbers, tags or 'latest'); ``by_number`` puts the older first.

    With ``compare``, the changed tensors' values are read and compared (bounded by
    :data:`tensor_values.MAX_COMPARED_BYTES`).
    """
    refs = [parse_ref(a), parse_ref(b)]
    if by_number:
        refs.sort(key=lambda r: store.resolve(run_id, r))
    older, newer = store.manifest(run_id, refs[0]), store.manifest(run_id, refs[1])
    diff = diff_manifests(older, newer)
    changes = diff.tensors if show_all else [t for t in diff.tensors if t.status != "unchanged"]
    shown = _tensor_rows(store, older, newer, changes[:MAX_ROWS], compare)
    values = [_value_row(v.path, v.before, v.after) for v in diff.values]
    return DiffPage(run_id, diff, shown, show_all, len(changes) - len(shown), values, compare)
