"""The save planner on plain integers and strings: no tensors, no store, no I/O."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ckptstore.client.saving.plan import MIN_BALANCED_SHARD_BYTES, SeparatePacker, balanced_shard_bytes, plan_save
from ckptstore.service.format.sharding import ShardPacker


def test_changed_tensors_of_a_store_that_takes_them_go_unhashed() -> None:
    plan = plan_save(
        [10, 10, 0, 10, 10],
        [None, None, None, "cached", None],
        shard_bytes=100,
        likely_new=[True, False, True, True, True],
        holders=[1, 1, 1, 1, 2],
    )
    # 2 is empty, 3 is cached, 4 is a tied weight: each of those is hashed (or known) instead.
    assert plan.write_first == [0]
    assert plan.groups == [[1, 2, 3, 4]]


def test_without_the_capability_nothing_goes_unhashed() -> None:
    plan = plan_save([10, 10], [None, None], shard_bytes=100, likely_new=None)
    assert plan.write_first == [] and plan.groups == [[0, 1]]


def test_groups_hold_about_one_shard_of_bytes_still_to_hash() -> None:
    plan = plan_save([40, 40, 40, 999, 40], [None, None, None, "known", None], shard_bytes=100)
    # The known digest weighs nothing: it rides along in the group it falls in.
    assert plan.groups == [[0, 1], [2, 3, 4]]


def test_ask_only_about_new_non_empty_digests_not_in_the_last_version() -> None:
    plan = plan_save([5, 5, 0, 5, 5], [None] * 5, shard_bytes=100, committed=frozenset({"c"}))
    assert plan.to_ask([0, 1, 2, 3], ["a", "a", "e", "c"]) == ["a"]
    assert plan.to_ask([4], ["a"]) == []  # asked about in an earlier group
    assert plan.sizes == {"a": 5, "c": 5}


def test_send_each_absent_digest_once_and_count_the_rest_as_skipped() -> None:
    plan = plan_save([5, 6, 7, 8], [None] * 4, shard_bytes=100)
    digests = ["a", "a", "b", "c"]
    plan.to_ask([0, 1, 2, 3], digests)
    sending = plan.to_send([0, 1, 2, 3], digests, absent={"a", "c"})
    assert sending.indexes == [0, 3]
    assert sending.skipped_bytes == 6 + 7
    plan.took_unhashed(2, "z")
    assert plan.sent == {"a", "c", "z"} and plan.bytes_sent() == 5 + 8 + 7


@given(
    st.lists(st.tuples(st.integers(0, 300), st.booleans(), st.booleans(), st.integers(1, 3)), min_size=0, max_size=40),
    st.integers(1, 500),
    st.booleans(),
)
def test_every_index_is_planned_once_in_order(
    tensors: list[tuple[int, bool, bool, int]], shard_bytes: int, capable: bool
) -> None:
    lengths = [n for n, _, _, _ in tensors]
    known = ["d" if cached else None for _, cached, _, _ in tensors]
    changed = [moved for _, _, moved, _ in tensors] if capable else None
    holders = [held for _, _, _, held in tensors]
    plan = plan_save(lengths, known, shard_bytes=shard_bytes, likely_new=changed, holders=holders)
    hashed = [i for group in plan.groups for i in group]
    assert sorted(hashed + plan.write_first) == list(range(len(tensors)))
    assert hashed == sorted(hashed) and not set(hashed) & set(plan.write_first)
    for index in plan.write_first:
        assert changed is not None and changed[index] and known[index] is None
        assert lengths[index] > 0 and holders[index] == 1
    for group in plan.groups:
        to_hash = sum(lengths[i] for i in group if known[i] is None)
        assert group and (to_hash <= shard_bytes or len([i for i in group if known[i] is None and lengths[i]]) == 1)


def test_frozen_and_trainable_tensors_never_share_a_shard() -> None:
    packer: SeparatePacker[int] = SeparatePacker(100)
    assert packer.add(0, 60, "frozen") is None
    assert packer.add(1, 60, "trainable") is None  # a shard of its own: 0 is frozen
    assert packer.add(2, 30, "frozen") is None
    assert packer.add(3, 30, "frozen") == [0, 2]  # the frozen shard is full; 3 starts the next
    assert packer.flush() == [[3], [1]]
    assert packer.flush() == []


@given(
    items=st.lists(st.tuples(st.integers(1, 120), st.sampled_from(["frozen", "trainable", "state"])), max_size=40),
    target=st.integers(1, 200),
)
def test_every_shard_holds_one_kind_and_every_item_once(items: list[tuple[int, str]], target: int) -> None:
    packer: SeparatePacker[int] = SeparatePacker(target)
    shards: list[list[int]] = []
    for index, (nbytes, kind) in enumerate(items):
        closed = packer.add(index, nbytes, kind)
        if closed is not None:
            shards.append(closed)
    shards += packer.flush()
    assert sorted(i for shard in shards for i in shard) == list(range(len(items)))
    for shard in shards:
        assert len({items[i][1] for i in shard}) == 1
        assert shard == sorted(shard)  # each kind keeps the order its items came in
        assert len(shard) == 1 or sum(items[i][0] for i in shard) <= target


@given(sizes=st.lists(st.integers(0, 1000), min_size=1, max_size=60), groups=st.integers(1, 8))
def test_filling_to_a_share_of_the_total_makes_at_most_that_many_shards_and_no_small_remainder(
    sizes: list[int], groups: int
) -> None:
    total = sum(sizes)
    target = max(1, -(-total // groups))
    packer: ShardPacker[int] = ShardPacker(target, fill=True)
    shards = [closed for index, nbytes in enumerate(sizes) if (closed := packer.add(index, nbytes)) is not None]
    if (last := packer.flush()) is not None:
        shards.append(last)
    kept = [i for i, nbytes in enumerate(sizes) if nbytes > 0]
    assert [i for shard in shards for i in shard] == kept  # every item once, in order
    assert len(shards) <= groups
    for shard in shards[:-1]:  # every shard but the last holds its share; none by more than one item
        held = sum(sizes[i] for i in shard)
        assert target <= held < target + max(sizes[i] for i in shard)


@given(total=st.integers(0, 1 << 36), shard_bytes=st.integers(1 << 20, 1 << 31), writers=st.integers(1, 8))
def test_a_balanced_shard_size_fills_whole_rounds_of_writers(total: int, shard_bytes: int, writers: int) -> None:
    size = balanced_shard_bytes(total, shard_bytes, writers)
    assert 0 < size <= shard_bytes
    if total == 0 or writers == 1:
        assert size == shard_bytes
        return
    rounds = -(-total // (writers * shard_bytes))  # as few rounds as shards of shard_bytes allow
    assert -(-total // size) <= rounds * writers  # never more shards than those rounds hold
    if MIN_BALANCED_SHARD_BYTES < size < shard_bytes:
        assert size == -(-total // (rounds * writers))  # each writer of each round gets an equal share


def test_the_first_full_save_of_750_mib_is_four_shards_two_rounds_of_two() -> None:
    mib = 1 << 20
    size = balanced_shard_bytes(750 * mib, 256 * mib, 2)
    assert size == -(-750 * mib // 4)
    assert balanced_shard_bytes(30 * mib, 256 * mib, 2) == MIN_BALANCED_SHARD_BYTES  # a LoRA save: one shard
    assert balanced_shard_bytes(256 * mib, 256 * mib, 2) == 128 * mib
