"""The access log keeps harmless query values readable (``diff?a=run@1&b=run@2``, ``page=2``) and
masks those that may bear a secret: a secret-named parameter's whatever its value, a token under
any name (one this server accepts, or as random as one), a value naming a secret, a value too
long to be a harmless one."""

from __future__ import annotations

from urllib.parse import quote

from hypothesis import given
from hypothesis import strategies as st

from ckptstore.service.api import redact
from ckptstore.service.api.redact import MASK, loggable_target

SECRET_WORDS = ["token", "key", "auth", "bearer", "secret", "pass", "session", "sig", "signature", "credential"]
HARMLESS_NAMES = ["a", "b", "page", "sort", "q", "order", "metric", "run", "version", "step", "per_page"]
#: Run references, page numbers, sort keys and metric names: what the pages and API are asked for.
HARMLESS_VALUES = st.from_regex(
    r"[a-z][a-z0-9_\-]{0,10}(@[0-9]{1,4}|@latest)?|[0-9]{1,6}|-?[a-z_]{1,10}", fullmatch=True
).filter(lambda value: not redact._SECRET_WORD.search(value))  # "keys", "passes": masked, as secrets may be
AFFIX = st.from_regex(r"[a-z_\-]{0,4}", fullmatch=True)


def _cased(word: str, flips: list[bool]) -> str:
    return "".join(c.upper() if flip else c for c, flip in zip(word, flips + [False] * len(word), strict=False))


@st.composite
def secret_names(draw: st.DrawFn) -> str:
    """A parameter name holding a secret word, in any case, maybe percent-encoded."""
    word = draw(st.sampled_from(SECRET_WORDS))
    name = draw(AFFIX) + _cased(word, draw(st.lists(st.booleans(), max_size=len(word)))) + draw(AFFIX)
    return quote(name, safe="") if draw(st.booleans()) else name


TOKEN_VALUES = st.one_of(
    st.binary(min_size=8, max_size=32).map(bytes.hex),  # openssl rand -hex
    st.from_regex(r"[A-Za-z0-9_\-]{16,64}", fullmatch=True),
)


@given(secret_names(), st.text(min_size=1, max_size=80))
def test_a_secret_named_parameters_value_is_masked_whatever_it_is(name: str, value: str) -> None:
    shown = loggable_target(f"/v1/runs?{name}={quote(value, safe='')}&page=2")
    head, _, tail = shown.partition("?")[2].rpartition("&")
    assert tail == "page=2" and head.count("=") == 1 and head.endswith(f"={MASK}"), shown


@given(st.sampled_from(HARMLESS_NAMES), TOKEN_VALUES.filter(lambda v: redact._random_run(v)))
def test_a_token_under_a_harmless_name_is_masked(name: str, token: str) -> None:
    assert loggable_target(f"/v1/runs?{name}={token}") == f"/v1/runs?{name}={MASK}"


def test_an_accepted_token_under_any_name_is_masked() -> None:
    accepted = "plainwordsonlyaccepted"  # no digits: only the list of accepted tokens finds it
    redact.remember([accepted])
    assert loggable_target(f"/v1/runs?x={accepted}&page=3") == f"/v1/runs?x={MASK}&page=3"


@given(st.lists(st.tuples(st.sampled_from(HARMLESS_NAMES), HARMLESS_VALUES), min_size=1, max_size=redact.MAX_NAMES))
def test_harmless_values_stay_readable(pairs: list[tuple[str, str]]) -> None:
    query = "&".join(f"{name}={value}" for name, value in pairs)
    assert loggable_target(f"/v1/runs/run-a/diff?{query}") == f"/v1/runs/run-a/diff?{query}"


def test_the_diff_link_the_bug_masked_is_readable_and_control_characters_stay_encoded() -> None:
    assert loggable_target("/runs/r/diff?a=r@1&b=r@2") == "/runs/r/diff?a=r@1&b=r@2"
    assert loggable_target("/runs?q=a%0d%0aforged%20line") == "/runs?q=a%0D%0Aforged%20line"
    assert loggable_target("/login?next=/runs%3Fckptstore_token%3Dabc") == f"/login?next={MASK}"
    assert loggable_target(f"/runs?q={'x' * (redact.LONGEST_VALUE + 1)}") == f"/runs?q={MASK}"
