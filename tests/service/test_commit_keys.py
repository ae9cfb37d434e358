"""A commit named by a key commits once: sent again with the same key (its answer was lost), it
answers with the version the key made. In the store, on SQLite and on PostgreSQL."""

from __future__ import annotations

import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shardkit import Ingest, body, entry, raw

from ckptstore.service.errors import InvalidNameError
from ckptstore.service.format.names import COMMIT_KEY_PATTERN, validate_commit_key
from ckptstore.service.store import Store

RUN = "run"
W = raw("F32", (4,), 1)
V = raw("F32", (4,), 2)


def test_a_commit_sent_again_with_its_key_answers_with_the_version_it_made(store: Store, ingest: Ingest) -> None:
    ingest(W, V)
    key = uuid.uuid4().hex
    first = store.commit(RUN, body(entry("model/w", W), step=3), tags=["best"], commit_key=key)
    again = store.commit(RUN, body(entry("model/w", W), step=3), tags=["best"], commit_key=key)
    assert again == first
    assert [v.version for v in store.versions(RUN)] == [1]
    # Another key, or none, is another commit; a key is one run's: the same key in another run commits there.
    assert store.commit(RUN, body(entry("model/w", V)), commit_key=uuid.uuid4().hex).version == 2
    assert store.commit(RUN, body(entry("model/w", V))).version == 3
    assert store.commit(RUN, body(entry("model/w", V))).version == 4
    assert store.commit("other", body(entry("model/w", W)), commit_key=key).version == 1
    assert store.commit(RUN, body(entry("model/w", W)), commit_key=key) == first
    assert [v.version for v in store.versions(RUN)] == [1, 2, 3, 4]
    assert store.resolve(RUN, "best") == 1


def test_the_same_commit_sent_at_once_from_many_threads_commits_once(store: Store, ingest: Ingest) -> None:
    ingest(W)
    key = uuid.uuid4().hex
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: store.commit(RUN, body(entry("model/w", W)), commit_key=key), range(8)))
    assert {answer.version for answer in answers} == {1}
    assert [v.version for v in store.versions(RUN)] == [1]


@settings(max_examples=40, deadline=None)
@given(
    key=st.one_of(
        st.text(max_size=80),
        st.text(alphabet="abcdefABCDEF0123456789_-", max_size=15),
        st.text(alphabet="abcdef0123456789", min_size=65, max_size=70),
        st.integers(),
        st.just(b"0123456789abcdef0123"),
    )
)
def test_a_key_not_of_its_pattern_is_refused_before_anything_is_committed(key: object) -> None:
    if isinstance(key, str) and re.fullmatch(COMMIT_KEY_PATTERN, key):
        assert validate_commit_key(key) == key
        return
    with pytest.raises(InvalidNameError, match="invalid commit key"):
        validate_commit_key(key)


def test_a_bad_key_commits_nothing(store: Store, ingest: Ingest) -> None:
    ingest(W)
    with pytest.raises(InvalidNameError, match="invalid commit key 'short'"):
        store.commit(RUN, body(entry("model/w", W)), commit_key="short")
    assert store.runs() == []
