"""Run ids, tags and version references: a small printable alphabet, nothing path-like."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptstore.service.errors import CheckpointError, InvalidNameError, NotFoundError
from ckptstore.service.format.bounds import MAX_VERSION
from ckptstore.service.format.names import LATEST, parse_ref, validate_run_id, validate_tag

# Identifier attacks from HOSTILE_INPUTS.md; none is a valid run id, tag or reference.
ATTACKS = [
    "",
    "..",
    "../",
    "../etc/passwd",
    "..%2f",
    "%2e%2e%2f",
    "%2e%2e",
    "%252e%252e%252f",
    "..\\..\\",
    "a\\b",
    "/etc/passwd",
    "C:\\",
    "C:",
    "\\\\server\\share",
    "file:///etc/passwd",
    "//proc/self/root",
    "http:///#/../../etc/",
    "?x=../",
    "%c0%ae",
    "\uff0e\uff0e\uff0f",  # fullwidth ．．／
    "run\x00",
    "run%00",
    "run\r\nSet-Cookie:x",
    "run\n",
    "run\r",
    "\nrun",
    "run\t",
    "run id",
    " run",
    "run\u202e",
    "r\u00fcn",
    "\uff52\uff55\uff4e",  # fullwidth ｒｕｎ
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "a" * 256,
    "a" * 4097,
]
NOT_STRINGS = [None, 7, 7.0, b"run", ["run"], object()]


@pytest.mark.parametrize("run_id", ["run", "r", "7", "run-1", "Run_2024.01.02", "a.b-c_d", "a" * 128, "1" * 128])
def test_valid_run_ids(run_id: str) -> None:
    assert validate_run_id(run_id) == run_id


@pytest.mark.parametrize(
    "run_id",
    [*ATTACKS, "a" * 129, ".hidden", "-rf", "_x", "a..b", "run..", "a/b", "a:b", "run!", "run@host"],
)
def test_invalid_run_ids(run_id: str) -> None:
    with pytest.raises(InvalidNameError, match="invalid run id"):
        validate_run_id(run_id)


@pytest.mark.parametrize("value", NOT_STRINGS)
def test_run_id_must_be_a_string(value: object) -> None:
    with pytest.raises(InvalidNameError):
        validate_run_id(value)


@pytest.mark.parametrize("tag", ["best", "v1", "v1.0", "Best_2", "release-candidate", "latest2", "x", "a" * 64])
def test_valid_tags(tag: str) -> None:
    assert validate_tag(tag) == tag


@pytest.mark.parametrize(
    "tag",
    [
        *ATTACKS,
        "latest",
        "LATEST",
        "Latest",
        "lAtEsT",
        "7",
        "1best",
        "007",
        "a" * 65,
        ".x",
        "-x",
        "_x",
        "a/b",
        "best\n",
    ],
)
def test_invalid_tags(tag: str) -> None:
    with pytest.raises(InvalidNameError, match="invalid tag"):
        validate_tag(tag)


@pytest.mark.parametrize("value", NOT_STRINGS)
def test_tag_must_be_a_string(value: object) -> None:
    with pytest.raises(InvalidNameError):
        validate_tag(value)


@pytest.mark.parametrize(
    ("ref", "parsed"),
    [
        ("7", 7),
        ("1", 1),
        (7, 7),
        (1, 1),
        (MAX_VERSION, MAX_VERSION),
        (str(MAX_VERSION), MAX_VERSION),
        ("latest", LATEST),
        ("best", "best"),
        ("v2", "v2"),
    ],
)
def test_valid_refs(ref: object, parsed: object) -> None:
    result = parse_ref(ref)
    assert result == parsed
    assert type(result) is type(parsed)


@pytest.mark.parametrize(
    "ref",
    [
        *ATTACKS,
        "0",
        "007",
        "07",
        "-1",
        "+7",
        "7.0",
        "1e3",
        " 7",
        "7 ",
        "7\n",
        "latest\n",
        "\u0663",  # ARABIC-INDIC DIGIT THREE
        "\uff17",  # fullwidth 7
        "0x10",
        0,
        -1,
        -(2**63),
        pytest.param(-(10**5000), id="-10**5000"),  # too long for str(): the message must not try to print it
        True,
        False,
        7.0,
        None,
        b"7",
        [7],
    ],
)
def test_invalid_refs(ref: object) -> None:
    with pytest.raises(InvalidNameError, match="invalid version"):
        parse_ref(ref)


def test_name_errors_are_value_errors_with_a_code() -> None:
    with pytest.raises(InvalidNameError) as info:
        validate_run_id("../x")
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, CheckpointError)
    assert info.value.code == "invalid_name"
    assert info.value.http_status == 400


@pytest.mark.parametrize("call", [validate_run_id, validate_tag, parse_ref])
def test_messages_do_not_echo_huge_input(call) -> None:
    with pytest.raises(InvalidNameError) as info:
        call("\u202e" + "a" * 100_000)
    assert len(str(info.value)) < 300


@given(st.text(max_size=140))
def test_accepted_run_ids_are_plain_and_never_traverse(text: str) -> None:
    try:
        validate_run_id(text)
    except InvalidNameError:
        return
    assert 1 <= len(text) <= 128
    assert text.isascii() and text.isprintable()
    assert ".." not in text and "/" not in text and "\\" not in text and "%" not in text
    assert text[0].isalnum()


@given(st.text(max_size=70))
def test_accepted_tags_are_never_numbers_or_latest(text: str) -> None:
    try:
        validate_tag(text)
    except InvalidNameError:
        return
    assert text.lower() != LATEST
    assert text[0].isascii() and text[0].isalpha()
    assert parse_ref(text) == text


@given(st.integers(1, MAX_VERSION))
def test_version_numbers_round_trip_through_text(number: int) -> None:
    assert parse_ref(str(number)) == number


@pytest.mark.parametrize(
    "ref",
    [
        MAX_VERSION + 1,
        str(MAX_VERSION + 1),
        2**63,
        "9223372036854775807",
        "1234567890123456789012345",
        pytest.param(10**5000, id="10**5000"),
        pytest.param("1" * 5000, id="5000-digits"),
    ],
)
def test_version_numbers_no_run_can_have_are_not_found_naming_the_bound(ref: object) -> None:
    with pytest.raises(NotFoundError, match=f"cannot exist: version numbers run from 1 to {MAX_VERSION}") as info:
        parse_ref(ref)
    assert len(str(info.value)) < 300
