"""Manifest parts: where a manifest's entries split, and that assembling gives back the same text."""

from __future__ import annotations

from datetime import datetime, timezone
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_core import to_json

from ckptstore.service.format import parts
from ckptstore.service.format.digest import tensor_digest
from ckptstore.service.format.manifest import Manifest, ManifestBody, TensorEntry, manifest_to_json, stamp
from ckptstore.service.format.parts import MAX_ENTRIES, MIN_ENTRIES, assemble, boundaries, head_json, split


def entry(key: str, seed: int) -> TensorEntry:
    return TensorEntry(
        key=key,
        dtype="F32",
        shape=[1],
        dtype_class="floating",
        digest=tensor_digest("F32", [1], seed.to_bytes(4, "little")),
        placement="target",
        device_type="cpu",
        trainable=True if key.startswith("model/") else None,
    )


def model(count: int, changed: dict[int, int] | None = None) -> list[TensorEntry]:
    seeds = {index: index for index in range(count)} | (changed or {})
    return [entry(f"model/layers.{index}.weight", seeds[index]) for index in range(count)]


def stamped(entries: list[TensorEntry]) -> Manifest:
    body = ManifestBody(tensors=entries, state={"extra": {"lr": 0.5}}, step=7, metrics={"loss": 1.5})
    return stamp(body, run_id="run", version=3, parent=2, created_at=datetime(2027, 1, 2, tzinfo=timezone.utc))


def test_parts_cover_the_entries_in_order_within_their_size_bounds() -> None:
    keys = [e.key for e in model(5000)]
    ends = boundaries(keys)
    assert ends[-1] == len(keys) and ends == sorted(set(ends))
    sizes = [b - a for a, b in zip([0, *ends], ends, strict=False)]
    assert all(MIN_ENTRIES <= size <= MAX_ENTRIES for size in sizes[:-1])
    assert 5000 / len(sizes) < 64  # a changed tensor rewrites a few dozen entries, not thousands


def test_changing_one_tensor_changes_exactly_one_part() -> None:
    before = split(model(3000))
    after = split(model(3000, {1234: 99_999}))
    assert len(before) == len(after)
    assert sum(a.digest != b.digest for a, b in zip(before, after, strict=True)) == 1


def test_adding_a_key_changes_only_the_parts_around_it() -> None:
    entries = model(3000)
    before = {part.digest for part in split(entries)}
    grown = split([*entries[:1500], entry("model/added.weight", 123_456), *entries[1500:]])
    assert len([part for part in grown if part.digest not in before]) <= 3


def test_assembling_gives_back_the_manifest_text() -> None:
    for count in (0, 1, 17, 2500):
        manifest = stamped(model(count))
        text = assemble(head_json(manifest), [part.body for part in split(manifest.tensors)])
        assert text == manifest_to_json(manifest)


# Any JSON tree a state may hold, large containers included (several slices' worth).
_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False)
)
_json_trees = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=6),
    max_leaves=40,
)


@settings(max_examples=200, deadline=None)
@given(_json_trees, st.integers(1, 8))
def test_state_text_written_in_slices_is_what_pydantic_writes(tree: object, slice_values: int) -> None:
    with patch.object(parts, "SLICE_VALUES", slice_values):
        assert parts.json_text(tree) == to_json(tree).decode()


def test_a_state_of_many_keys_is_written_exactly_and_its_head_as_before() -> None:
    wide = {f"x{i}": [i, {"y": str(i)}] if i % 3 else i * 0.5 for i in range(20_000)}
    deep_and_wide = {"a": wide, "b": [list(range(10_000)), {"c": wide}]}
    assert parts.json_text(deep_and_wide) == to_json(deep_and_wide).decode()
    manifest = stamp(
        ManifestBody(tensors=model(3), state={"extra": deep_and_wide}, step=1),
        run_id="run",
        version=1,
        parent=None,
        created_at=datetime(2027, 1, 2, tzinfo=timezone.utc),
    )
    expected = manifest.model_copy(update={"tensors": []}).model_dump_json(exclude_none=True)
    assert head_json(manifest) == expected
