"""Strict patterns for every name a caller chooses: run ids, tags, metric names, refs; and the
values a metric may hold.

Names never become paths (storage keys derive from digests only), but they are shown in
pages, logs and URLs, so they are kept to a small, printable alphabet.

A metric is any float, NaN and the infinities included: a diverging run must still save the
version that shows it diverged. JSON has no NaN, so wherever a metric is written as JSON (the
manifest, the metadata database, the HTTP API) a non-finite value is the string ``"NaN"``,
``"Infinity"`` or ``"-Infinity"`` (the spelling of Python's ``json`` and JSON5), and is read
back as the float (:data:`MetricValue`). Nowhere else is a string or a bare ``NaN`` token a number.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PlainSerializer, StringConstraints, ValidationInfo, WithJsonSchema

from ckptstore.service.errors import InvalidNameError, NotFoundError
from ckptstore.service.format.bounds import MAX_VERSION

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: Tags start with a letter so they can never be read as a version number.
TAG_PATTERN = r"^[A-Za-z][A-Za-z0-9._-]{0,63}$"
METRIC_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_./:-]{0,127}$"
#: A commit's key (``Idempotency-Key``): a client's random token, such as a UUID.
COMMIT_KEY_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"
LATEST = "latest"

RunId = Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN)]
TagName = Annotated[str, StringConstraints(pattern=TAG_PATTERN)]
MetricName = Annotated[str, StringConstraints(pattern=METRIC_PATTERN)]

#: How JSON spells each non-finite metric value.
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def metric_to_json(value: float) -> float | str:
    """A metric as JSON holds it: the float, or ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"``."""
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def metrics_to_json(metrics: Mapping[str, float]) -> dict[str, float | str]:
    """Metrics as JSON holds them (:func:`metric_to_json` of each)."""
    return {name: metric_to_json(value) for name, value in metrics.items()}


def _metric_in(value: Any, info: ValidationInfo) -> Any:
    """A metric from JSON's spelling: ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` become the float; a
    non-finite number parsed from JSON text (a bare ``NaN`` token, which JSON does not have) is refused."""
    if isinstance(value, str) and value in NON_FINITE:
        return NON_FINITE[value]
    if info.mode == "json" and isinstance(value, float) and not math.isfinite(value):
        raise ValueError("a non-finite metric is written as the string 'NaN', 'Infinity' or '-Infinity' in JSON")
    return value


#: A metric's value: any float, NaN and the infinities included, written to JSON as
#: :func:`metric_to_json` spells it.
MetricValue = Annotated[
    float,
    Field(allow_inf_nan=True),
    BeforeValidator(_metric_in),
    PlainSerializer(metric_to_json, return_type=float | str, when_used="json"),
    WithJsonSchema({"anyOf": [{"type": "number"}, {"enum": list(NON_FINITE)}]}),
]

_RUN_ID_RE = re.compile(RUN_ID_PATTERN)
_TAG_RE = re.compile(TAG_PATTERN)
_COMMIT_KEY_RE = re.compile(COMMIT_KEY_PATTERN)
#: A version number as text: no sign, no leading zero (its value is checked against MAX_VERSION).
_VERSION_RE = re.compile(r"^[1-9][0-9]*$")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_run_id(run_id: object) -> str:
    """Return ``run_id`` if it matches the run id pattern, else raise InvalidNameError."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id) or ".." in run_id:
        raise InvalidNameError(
            f"invalid run id {_shown(run_id)}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit, with no '..'"
        )
    return run_id


def validate_commit_key(key: object) -> str:
    """Return ``key`` if it may name a commit, else raise InvalidNameError naming it."""
    if not isinstance(key, str) or not _COMMIT_KEY_RE.fullmatch(key):
        raise InvalidNameError(
            f"invalid commit key {_shown(key)}: use 16-64 characters from A-Z a-z 0-9 _ - (a UUID's hex will do)"
        )
    return key


def validate_tag(tag: object, *, allow_reserved: bool = False) -> str:
    """Return ``tag`` if it is a valid tag name, else raise InvalidNameError naming it.

    'latest' is reserved in any case ('LATEST', 'Latest'): a tag spelled so would read like the
    newest version. ``allow_reserved`` lets such a tag other than 'latest' itself, made before
    this rule, be removed.
    """
    if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag):
        raise InvalidNameError(
            f"invalid tag {_shown(tag)}: use 1-64 characters from A-Z a-z 0-9 . _ -, starting "
            "with a letter; 'latest' is reserved"
        )
    if tag.lower() == LATEST and (tag == LATEST or not allow_reserved):
        raise InvalidNameError(
            f"invalid tag {tag!r}: '{LATEST}' is reserved, in any case, for a run's newest version; choose another name"
        )
    return tag


def _no_such_version(shown: object) -> NotFoundError:
    return NotFoundError(f"version {shown} cannot exist: version numbers run from 1 to {MAX_VERSION}")


def parse_ref(ref: object) -> int | str:
    """Parse a version reference: a version number, ``"latest"`` or a tag name.

    Returns the version as an int, or the string ``"latest"`` or the tag.

    Raises:
        InvalidNameError: ``ref`` is none of these (e.g. ``0``, ``"007"``, ``"-1"``).
        NotFoundError: a version number above :data:`MAX_VERSION`, which no run can have.
    """
    if isinstance(ref, bool):
        raise InvalidNameError(f"invalid version reference {ref!r}")
    if isinstance(ref, int):
        # str() of a huge int is slow, and refused past 4300 digits.
        shown = ref if ref.bit_length() <= 256 else f"of {ref.bit_length()} bits"
        if ref > MAX_VERSION:
            raise _no_such_version(shown)
        if ref < 1:
            raise InvalidNameError(f"invalid version number {shown}: version numbers run from 1 to {MAX_VERSION}")
        return ref
    if isinstance(ref, str):
        if ref.isascii() and _VERSION_RE.fullmatch(ref):
            if len(ref) > len(str(MAX_VERSION)) or int(ref) > MAX_VERSION:
                raise _no_such_version(ref if len(ref) <= 40 else ref[:37] + "...")
            return int(ref)
        if ref == LATEST:
            return LATEST
        if _TAG_RE.fullmatch(ref):
            return ref
    raise InvalidNameError(
        f"invalid version reference {_shown(ref)}: use a version number (1, 2, …), 'latest' or a tag"
    )
