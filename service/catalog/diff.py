"""Comparing two versions: which tensors were added, removed, changed or kept, and which
hyperparameters and metrics moved. Works on manifests alone (no tensor bytes are read)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ckptstore.service.format.manifest import Manifest, TensorEntry
from ckptstore.service.format.names import metrics_to_json


class TensorChange(BaseModel):
    """One tensor key present in either version."""

    key: str
    status: str  # added | removed | changed | unchanged
    before: str | None = None  # "F32[4,4]" of the older version
    after: str | None = None
    nbytes: int


class GroupTotals(BaseModel):
    """Count and bytes of tensors with one status."""

    count: int = 0
    nbytes: int = 0


class ValueChange(BaseModel):
    """A JSON value (hyperparameter, metric, step) that differs between the versions."""

    path: str
    before: Any = None
    after: Any = None


class VersionDiff(BaseModel):
    """Everything that differs between version ``a`` and version ``b`` of a run (or two runs)."""

    run_a: str
    version_a: int
    run_b: str
    version_b: int
    totals: dict[str, GroupTotals]
    tensors: list[TensorChange]
    values: list[ValueChange]


def _describe(entry: TensorEntry) -> str:
    return f"{entry.dtype}{list(entry.shape)}".replace(" ", "")


def _same(a: TensorEntry, b: TensorEntry) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.digests() == b.digests()


def _flatten(value: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value and not (len(value) == 1 and next(iter(value)).startswith("__")):
        for key, item in value.items():
            _flatten(item, f"{path}/{key}", out)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for index, item in enumerate(value):
            _flatten(item, f"{path}/{index}", out)
    else:
        out[path] = value


def hyperparameters(manifest: Manifest) -> dict[str, Any]:
    """A version's values a diff compares, by path: each param group's settings
    (``optim/param_groups/0/lr``), the scheduler's state, ``metrics/<name>`` and ``step``."""
    flat: dict[str, Any] = {}
    optim: Any = manifest.state.get("optim")
    if isinstance(optim, dict):
        for index, group in enumerate(optim.get("param_groups") or []):
            if isinstance(group, dict):
                _flatten({k: v for k, v in group.items() if k != "params"}, f"optim/param_groups/{index}", flat)
    if "scheduler" in manifest.state:
        _flatten(manifest.state["scheduler"], "scheduler", flat)
    # As JSON writes them ("NaN" for NaN): NaN is then the same as NaN, and a diff stays JSON.
    flat.update({f"metrics/{k}": v for k, v in metrics_to_json(manifest.metrics).items()})
    flat["step"] = manifest.step
    return flat


def diff_manifests(a: Manifest, b: Manifest) -> VersionDiff:
    """The differences from ``a`` (older) to ``b`` (newer)."""
    before = {e.key: e for e in a.tensors}
    after = {e.key: e for e in b.tensors}
    changes: list[TensorChange] = []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        if old is None and new is not None:
            changes.append(TensorChange(key=key, status="added", after=_describe(new), nbytes=new.nbytes))
        elif new is None and old is not None:
            changes.append(TensorChange(key=key, status="removed", before=_describe(old), nbytes=old.nbytes))
        elif old is not None and new is not None:
            status = "unchanged" if _same(old, new) else "changed"
            changes.append(
                TensorChange(key=key, status=status, before=_describe(old), after=_describe(new), nbytes=new.nbytes)
            )
    totals = {status: GroupTotals() for status in ("added", "removed", "changed", "unchanged")}
    for change in changes:
        totals[change.status].count += 1
        totals[change.status].nbytes += change.nbytes
    old_values, new_values = hyperparameters(a), hyperparameters(b)
    values = [
        ValueChange(path=path, before=old_values.get(path), after=new_values.get(path))
        for path in sorted(old_values.keys() | new_values.keys())
        if old_values.get(path) != new_values.get(path)
    ]
    return VersionDiff(
        run_a=a.run_id,
        version_a=a.version,
        run_b=b.run_id,
        version_b=b.version,
        totals=totals,
        tensors=changes,
        values=values,
    )
