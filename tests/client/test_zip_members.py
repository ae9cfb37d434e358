"""What a ``torch.save`` file may make from its own bytes: archive members are distinct regions, tensors over
one storage share it (a misaligned one copied once), every tensor is charged before it is made, and a
malformed field of a legacy file is one ``InvalidInputError``.

Archives are written by hand (:mod:`tests.cli.hostile_pt_reuse`), so an entry may point anywhere.
"""

from __future__ import annotations

import io
import pickle  # noqa: TID251 - making the files under test; nothing here is unpickled
import struct
import zipfile
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.client.formats import budget
from ckptstore.client.formats.torch_save.constructors import Storage
from ckptstore.client.formats.torch_save.files import read_torch_file
from ckptstore.client.formats.torch_save.zip_members import Region, check_disjoint, member_regions
from ckptstore.service.errors import InvalidInputError
from tests.cli.hostile_pickles import torch_saved
from tests.cli.hostile_pt_reuse import Member, StorageRef, TensorRef, layout, one_storage, raw_zip, tensors_pickle
from tests.client.models import tensors_equal

FUNCTION_SCOPED = [HealthCheck.function_scoped_fixture]


def meets(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Two half-open regions share a start or a byte."""
    return a[0] == b[0] or max(a[0], b[0]) < min(a[1], b[1])


regions = st.lists(
    st.tuples(st.integers(0, 300), st.integers(1, 40), st.integers(0, 60)),  # header at, header bytes, data bytes
    max_size=12,
)


@settings(max_examples=500, deadline=None)
@given(found=regions)
def test_regions_are_refused_exactly_when_two_share_a_header_or_overlap(found: list[tuple[int, int, int]]) -> None:
    made = [Region(f"m{i}", at, at + header, size) for i, (at, header, size) in enumerate(found)]
    spans = [(r.header_at, r.end) for r in made]
    expected = any(meets(a, b) for a, b in combinations(spans, 2))
    try:
        check_disjoint("x.pt", made)
    except InvalidInputError as exc:
        assert expected, spans
        assert "x.pt" in str(exc) and ("overlap" in str(exc) or "share one local header" in str(exc))
    else:
        assert not expected, spans


@st.composite
def archives(draw: st.DrawFn) -> tuple[list[Member | bytes], list[tuple[str, Member]], bool]:
    """Members of random sizes with gaps between them; some entries pointing at another's header, some
    members claiming bytes past their own (over the gap and the next header); and whether any two meet."""
    count = draw(st.integers(1, 6))
    pieces: list[Member | bytes] = []
    members = []
    for i in range(count):
        member = Member(f"m/{i}", draw(st.binary(max_size=40)))
        members.append(member)
        pieces += [member, bytes(draw(st.integers(0, 20)))]
    end = layout(pieces)
    central = [(m.name, m) for m in members]
    for i in draw(st.lists(st.integers(0, count - 1), max_size=2)):  # an entry reusing a member's header
        central.append((f"m/shared{len(central)}", members[i]))
    for i in draw(st.lists(st.integers(0, count - 1), max_size=2, unique=True)):  # a member running on
        members[i].size = len(members[i].data) + draw(st.integers(0, 80))
    # The claimed sizes must stay inside the archive's local part: past it is another refusal.
    for member in members:
        if member.size is not None:
            member.size = min(member.size, end - member.data_at)
    spans = [(m.offset, m.data_at + m.recorded) for _, m in central]
    return pieces, central, any(meets(a, b) for a, b in combinations(spans, 2))


@settings(max_examples=300, deadline=None, suppress_health_check=FUNCTION_SCOPED)
@given(made=archives())
def test_archive_members_are_refused_exactly_when_they_share_or_overlap(
    tmp_path: Path, made: tuple[list[Member | bytes], list[tuple[str, Member]], bool]
) -> None:
    pieces, central, expected = made
    path = raw_zip(tmp_path / "a.zip", pieces, central)
    data = path.read_bytes()
    members = zipfile.ZipFile(path).infolist()
    try:
        found = member_regions("a.zip", members, data, 0, len(data))
    except InvalidInputError as exc:
        assert expected, [(name, m.offset, m.recorded) for name, m in central]
        assert "overlap" in str(exc) or "share one local header" in str(exc)
    else:
        assert not expected
        assert {name: (r.data_at, r.size) for name, r in found.items()} == {
            name: (m.data_at, m.recorded) for name, m in central
        }


def _storage_archive(path: Path, data: bytes, views: list[tuple[int, int]], at: int, untyped: bool) -> Path:
    """float32 tensors ``(offset, numel)`` over one storage of ``data`` at offset ``at`` mod 64: by
    ``_rebuild_tensor_v3`` over an untyped storage, or ``_rebuild_tensor_v2`` over a FloatStorage."""
    if untyped:
        storage = StorageRef("0", len(data), torch.UntypedStorage)
        tensors = {f"w{i}": TensorRef(storage, n, torch.float32, offset) for i, (offset, n) in enumerate(views)}
    else:
        storage = StorageRef("0", len(data) // 4, torch.FloatStorage)
        tensors = {f"w{i}": TensorRef(storage, n, None, offset) for i, (offset, n) in enumerate(views)}
    return one_storage(path, tensors_pickle(tensors), data, at)


@st.composite
def shared_storages(draw: st.DrawFn) -> tuple[bytes, list[tuple[int, int]], int, bool]:
    numel = draw(st.integers(1, 32))
    views = draw(
        st.lists(
            st.integers(0, numel - 1).flatmap(lambda o: st.tuples(st.just(o), st.integers(0, numel - o))),
            min_size=1,
            max_size=6,
        )
    )
    untyped = draw(st.booleans())
    return (
        draw(st.binary(min_size=4 * numel, max_size=4 * numel)),
        views,
        draw(st.sampled_from([0, 1, 2, 3, 4] if untyped else [0, 4])),
        untyped,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=FUNCTION_SCOPED)
@given(made=shared_storages())
def test_tensors_over_one_storage_read_bitwise_and_share_one_copy(
    tmp_path: Path, made: tuple[bytes, list[tuple[int, int]], int, bool]
) -> None:
    data, views, at, untyped = made
    path = _storage_archive(tmp_path / "t.pt", data, views, at, untyped)
    whole = torch.frombuffer(bytearray(data), dtype=torch.float32)
    with budget.budgeted(path, 1000) as allowed:
        loaded = read_torch_file(path)
    for i, (offset, numel) in enumerate(views):
        assert tensors_equal(loaded[f"w{i}"], whole[offset : offset + numel]), (i, offset, numel)
    assert len({t.untyped_storage().data_ptr() for t in loaded.values()}) == 1  # tied: one storage, one copy at most
    assert allowed.made == sum(4 * numel for _, numel in views)


def test_a_tensor_is_charged_before_it_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 2 << 20  # past the budget's 1 MiB slack on its own
    path = _storage_archive(tmp_path / "t.pt", bytes(size), [(0, size // 4)] * 3, at=1, untyped=True)
    copied: list[str] = []
    aligned_for = Storage.aligned_for
    monkeypatch.setattr(Storage, "aligned_for", lambda self, n: copied.append(self.key) or aligned_for(self, n))
    with budget.budgeted(path, 1e-9), pytest.raises(InvalidInputError, match=r"t\.pt: .*past the limit"):
        read_torch_file(path)
    assert copied == []  # refused before the misaligned storage was copied
    with budget.budgeted(path, 2) as allowed, pytest.raises(InvalidInputError, match="limit"):
        read_torch_file(path)  # two of the three fit
    assert allowed.made == 2 * size and copied == ["0", "0"]


def test_an_expanded_tensor_is_charged_its_storage_bytes(tmp_path: Path) -> None:
    storage = StorageRef("0", 4, torch.FloatStorage)

    class Expanded(TensorRef):
        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
            return torch._utils._rebuild_tensor_v2, (self.storage, 0, (1000,), (0,), False, {})

    path = one_storage(tmp_path / "e.pt", tensors_pickle({"w": Expanded(storage, 1000)}), bytes(16))
    with budget.budgeted(path, 4) as allowed:
        assert read_torch_file(path, expand_limit=1 << 20)["w"].shape == (1000,)
    assert allowed.made == 16


def _legacy(*parts: Any, keys: Any = ("0",), tail: bytes = struct.pack("<q", 4) + bytes(16)) -> bytes:
    magic, protocol, info = parts or (0x1950A86A20F9469CFC6C, 1001, {"little_endian": True})
    value = tensors_pickle({"w": TensorRef(StorageRef("0", 4, torch.FloatStorage), 4)})
    dumped = [pickle.dumps(x, protocol=2) for x in (magic, protocol, info)]
    return b"".join([*dumped, value, pickle.dumps(list(keys) if isinstance(keys, tuple) else keys, protocol=2), tail])


def test_a_handmade_legacy_file_reads(tmp_path: Path) -> None:
    (tmp_path / "l.pt").write_bytes(_legacy())
    assert tensors_equal(read_torch_file(tmp_path / "l.pt")["w"], torch.zeros(4))


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (_legacy(keys=[1, "0"]), "holds 1, not a string key"),
        (_legacy(keys=[["0"]]), "holds a list, not a string key"),
        (_legacy(keys={"0": 1}), "is a dict, not a list"),
        (_legacy(keys="0"), "not a list"),
        (_legacy(keys=["0", "0"]), "does not match"),
        (_legacy(keys=[]), "does not match"),
        (_legacy(keys=["0", "1"]), "does not match"),
        (_legacy("magic", 1001, {"little_endian": True}), "no torch magic number"),
        (_legacy(0x1950A86A20F9469CFC6C, "1001", {"little_endian": True}), "does not read"),
        (_legacy(0x1950A86A20F9469CFC6C, 1001, [1]), "does not read"),
        (_legacy(tail=struct.pack("<q", 5) + bytes(16)), "holds 5 elements"),
        (_legacy(tail=struct.pack("<q", 4) + bytes(15)), "past the end"),
    ],
)
def test_malformed_legacy_fields_are_one_error_naming_the_file(tmp_path: Path, data: bytes, says: str) -> None:
    path = tmp_path / "weights.pt"
    path.write_bytes(data)
    with pytest.raises(InvalidInputError, match="weights.pt") as refused:
        read_torch_file(path)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def _flips(data: bytes) -> st.SearchStrategy[bytes]:
    at = st.integers(0, len(data) - 1)
    flip = st.tuples(at, st.integers(0, 255)).map(lambda p: data[: p[0]] + bytes([p[1]]) + data[p[0] + 1 :])
    return st.lists(flip | at.map(lambda i: data[:i]), min_size=1, max_size=3).map(lambda edits: edits[-1])


def _saved(legacy: bool) -> bytes:
    buffer = io.BytesIO()
    value = {"w": torch.arange(6, dtype=torch.float32), "tied": None, "step": 3, "names": ("a", 1)}
    value["tied"] = value["w"][2:]
    torch.save(value, buffer, _use_new_zipfile_serialization=not legacy)  # noqa: TID251 - making the file under test
    return buffer.getvalue()


@settings(max_examples=300, deadline=None, suppress_health_check=[*FUNCTION_SCOPED, HealthCheck.too_slow])
@given(data=st.sampled_from([_saved(True), _saved(False)]).flatmap(_flips))
def test_no_mutation_of_a_torch_file_escapes_as_another_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "m.pt"
    path.write_bytes(data)
    try:
        read_torch_file(path)
    except InvalidInputError as exc:
        assert "m.pt" in str(exc)


def test_valid_tied_and_legacy_files_still_read(tmp_path: Path) -> None:
    for legacy in (False, True):
        weight = torch.randn(4, 3)
        path = torch_saved({"a": weight, "b": weight, "c": weight[1:]}, tmp_path / f"{legacy}.pt", legacy=legacy)
        loaded = read_torch_file(path)
        assert tensors_equal(loaded["a"], weight) and tensors_equal(loaded["c"], weight[1:])
        assert loaded["a"].untyped_storage().data_ptr() == loaded["b"].untyped_storage().data_ptr()
