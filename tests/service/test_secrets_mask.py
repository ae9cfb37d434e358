"""URLs shown to people keep no secret: the user-info password and every password-, secret-,
token- or key-named query value are masked, however the URL is written, and a URL that cannot be
read is shown as its scheme alone."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import make_url

from ckptstore.service.secrets_mask import MASK, is_secret_name, mask_url, mask_urls

#: Every generated secret starts and ends with a marker no other part of a URL holds, so a secret
#: shown even in part (cut where a parser would cut it) leaves a marker in the output.
HEAD, TAIL = "Qz8SEK", "KESq8Z"
PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x10FFFF, exclude_categories=["Cc", "Cs", "Zl", "Zp"])


def secrets(alphabet: st.SearchStrategy[str] = PRINTABLE) -> st.SearchStrategy[str]:
    return st.text(alphabet, max_size=12).map(lambda middle: HEAD + middle + TAIL)


def assert_hidden(shown: str, *secret_values: str) -> None:
    for value in secret_values:
        assert value not in shown and quote(value, safe="") not in shown, shown
    assert HEAD not in shown and TAIL not in shown, shown


@st.composite
def encoded(draw: st.DrawFn, name: str) -> str:
    """``name`` with some characters percent-encoded, once or twice."""
    out = []
    for char in name:
        if draw(st.booleans()):
            escape = "".join(f"%{byte:02X}" for byte in char.encode())
            out.append(escape.replace("%", "%25") if draw(st.booleans()) else escape)
        else:
            out.append(char)
    return "".join(out)


SECRET_NAMES = ["password", "sslpassword", "PASSWORD", "PassWord", "passfile", "my_secret", "Client_Secret"]
SECRET_NAMES += ["api_key", "apikey", "KEY", "access_token", "Token", "x-api-key", "pass word", "passphrase"]
BENIGN = st.sampled_from(["host", "port", "sslmode", "application_name", "connect_timeout", "user", "dbname", "target"])
BENIGN_VALUES = st.text("abcdefghijklmnopqrstuvwxyz0123456789_/.", max_size=10)


@st.composite
def secret_names(draw: st.DrawFn) -> str:
    word = draw(st.sampled_from(["pass", "secret", "token", "key"]))
    word = "".join(c.upper() if draw(st.booleans()) else c for c in word)
    made = draw(st.text("abc_-.", max_size=4)) + word + draw(st.text("xyz_-.", max_size=4))
    return draw(encoded(draw(st.sampled_from(SECRET_NAMES) | st.just(made))))


@st.composite
def urls(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A URL and the secret values in it (as written into it: percent-encoded, or raw)."""
    scheme = draw(st.sampled_from(["postgresql", "postgresql+psycopg", "mysql+pymysql", "s3", "http", "sqlite"]))
    values: list[str] = []
    userinfo = ""
    if draw(st.booleans()):
        user = draw(st.text("abcdefghij_.-", max_size=8))
        if draw(st.booleans()):
            password = draw(secrets())
            # As it should be written, or as people write it (a raw "/", "?", "#" or "@").
            written = quote(password, safe="") if draw(st.booleans()) else password
            values.append(written)
            userinfo = f"{user}:{written}@"
        else:
            userinfo = f"{user}@"
    host = draw(st.sampled_from(["", "db", "db.example:5432", "127.0.0.1:5432", "[::1]:5432", "h1:5432,h2:5433"]))
    path = draw(st.sampled_from(["", "/", "/ckpt", "/tmp/some dir/metadata.db"]))
    parameters = []
    for _ in range(draw(st.integers(0, 4))):
        value = draw(secrets())
        written = quote(value, safe="") if draw(st.booleans()) else value.replace("&", "")
        values.append(written)
        parameters.append(f"{draw(secret_names())}={written}")
    parameters += [f"{draw(BENIGN)}={draw(BENIGN_VALUES)}" for _ in range(draw(st.integers(0, 3)))]
    parameters = draw(st.permutations(parameters))
    query = "?" + "&".join(parameters) if parameters or draw(st.booleans()) else ""
    return f"{scheme}://{userinfo}{host}{path}{query}", values


ISSUE_URL = "postgresql+psycopg:///db?host=/tmp&password=hunter2&sslpassword=x&api_key=y"


def test_the_reported_url_shows_no_secret() -> None:
    assert mask_url(ISSUE_URL) == "postgresql+psycopg:///db?host=/tmp&password=***&sslpassword=***&api_key=***"


@settings(max_examples=500, deadline=None)
@given(case=urls())
@example(case=(f"postgresql://u:{HEAD}a/b{TAIL}@host/db", [f"{HEAD}a/b{TAIL}"]))
@example(case=(f"postgresql://u:{HEAD}a@b{TAIL}@host/db", [f"{HEAD}a@b{TAIL}"]))
@example(case=(f"postgresql://u:{HEAD}a/b@c/d{TAIL}@host/db", [f"{HEAD}a/b@c/d{TAIL}"]))
@example(case=(f"postgresql://u:{HEAD}a?b@c?d{TAIL}@host/db", [f"{HEAD}a?b@c?d{TAIL}"]))
@example(case=(f"postgresql://host:5432/db?password={HEAD}a@b{TAIL}", [f"{HEAD}a@b{TAIL}"]))
@example(case=(f"postgresql://host/db?password={HEAD}a;b#c{TAIL}", [f"{HEAD}a;b#c{TAIL}"]))
@example(case=(f"postgresql://host/db?a=1;pass%2577ord={HEAD}{TAIL}", [f"{HEAD}{TAIL}"]))
@example(case=(f"postgresql://u:{HEAD}{TAIL}/db", [f"{HEAD}{TAIL}"]))
def test_no_secret_value_reaches_the_output(case: tuple[str, list[str]]) -> None:
    url, values = case
    shown = mask_url(url)
    assert_hidden(shown, *values)
    if not any(char.isspace() or char in "\"'<>`" for char in url):  # where a URL in free text ends
        assert_hidden(mask_urls(f'could not connect to "{url}" (timed out)'), *values)


@settings(max_examples=300, deadline=None)
@given(case=urls())
def test_what_sqlalchemy_reads_as_the_password_is_never_shown(case: tuple[str, list[str]]) -> None:
    """The password the database driver would get, however SQLAlchemy cuts the URL."""
    url, _ = case
    try:
        password = make_url(url).password
    except Exception:  # a URL SQLAlchemy refuses sends no password
        return
    if password:
        assert str(password) not in mask_url(url) and quote(str(password), safe="") not in mask_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:////home/me/.ckptstore/metadata.db",
        "sqlite:////home/some dir/metadata.db",
        "postgresql+psycopg://ckpt@db:5432/ckpt?sslmode=require&application_name=ckptstore",
        "postgresql+psycopg:///ckpt?host=/var/run/postgresql",
        "postgresql://[::1]:5432/ckpt",
        "s3://bucket/prefix",
        "file:///srv/blobs",
    ],
)
def test_a_url_without_secrets_is_shown_as_it_is(url: str) -> None:
    assert mask_url(url) == url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://ckpt:hunter2@db:5432/ckpt", "postgresql+psycopg://ckpt:***@db:5432/ckpt"),
        ("postgresql://u:p@ss@host/db", "postgresql://u:***@host/db"),
        ("postgresql://u:pa/ss@host/db", "postgresql://u:***@host/db"),
        ("postgresql://host/db?PassWord=x&user=me", "postgresql://host/db?PassWord=***&user=me"),
        ("postgresql://host/db?pass%77ord=x", "postgresql://host/db?pass%77ord=***"),
        ("postgresql://host/db?%2570assword=x", "postgresql://host/db?%2570assword=***"),
        ("postgresql://host/db?a=1;password=x&b=2", "postgresql://host/db?a=1;password=***&b=2"),
        ("s3://AKIA:wJalr@bucket/prefix", "s3://AKIA:***@bucket/prefix"),
        ("http://minio:minio123@127.0.0.1:9000/", "http://minio:***@127.0.0.1:9000/"),
    ],
)
def test_what_is_masked(url: str, shown: str) -> None:
    assert mask_url(url) == shown


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://user:hunter2/db", "postgresql://***"),  # no "@": the "port" may be a password
        ("postgresql://u:hun/ter@2@host/db", "postgresql://***"),
        ("postgresql://u:x@host/db\nINFO forged log line", "postgresql://***"),
        ("http://[::1", "http://***"),
        ("hunter2", MASK),
        ("", MASK),
        ("://hunter2@", MASK),
    ],
)
def test_a_url_that_cannot_be_read_shows_only_its_scheme(url: str, shown: str) -> None:
    assert mask_url(url) == shown


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=80) | st.text("abc:/?#@&=%;[]5", max_size=40).map(lambda t: "postgresql://" + t))
def test_masking_never_raises(text: str) -> None:
    assert isinstance(mask_url(text), str)
    assert isinstance(mask_urls(f"see {text} and {text}"), str)


@pytest.mark.parametrize(
    "name", ["password", "SSLPASSWORD", "pass%77ord", "%2570assword", "api_key", "x-token", "pass+w"]
)
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["host", "user", "sslmode", "application_name", "options", "dbname"])
def test_plain_names(name: str) -> None:
    assert not is_secret_name(name)


def test_a_storage_error_quoting_an_endpoint_url_shows_no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore names the endpoint it could not reach, user-info and all; so does the error a
    caller of the Python API gets (and logs)."""
    from ckptstore.service.blobs.s3 import S3BlobStore
    from ckptstore.service.errors import StorageError

    for name, value in {
        "AWS_ACCESS_KEY_ID": "a",
        "AWS_SECRET_ACCESS_KEY": "b",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    store = S3BlobStore("bucket", "prefix", endpoint_url="http://minio:Hunter2Endpoint@127.0.0.1:1/")
    with pytest.raises(StorageError) as raised:
        store.size("a" * 64)
    assert "http://minio:***@127.0.0.1:1/" in str(raised.value)
    assert "Hunter2Endpoint" not in str(raised.value) and "Hunter2Endpoint" not in raised.value.message
    assert "Hunter2" not in str(StorageError("metadata database error: postgresql://u:Hunter2@h/d?password=Hunter2"))


def test_the_server_log_filter_masks_urls_in_lines_and_keeps_templates_whole() -> None:
    import logging

    from ckptstore.service.api.redact import RedactTokens

    def logged(msg: str, *args: object) -> str:
        record = logging.LogRecord("ckptstore.api", logging.ERROR, __file__, 1, msg, args, None)
        RedactTokens().filter(record)
        return record.getMessage()

    url = "postgresql+psycopg://ckpt:Hunter2@db/ckpt?sslpassword=Hunter2"
    assert logged("storage failed: %s", f"could not reach {url}") == (
        "storage failed: could not reach postgresql+psycopg://ckpt:***@db/ckpt?sslpassword=***"
    )
    assert "Hunter2" not in logged(f"opened {url}")
    assert (
        logged("Uvicorn running on %s://%s:%d", "http", "127.0.0.1", 8000) == "Uvicorn running on http://127.0.0.1:8000"
    )


def test_punctuation_after_a_url_in_text_is_the_texts_not_the_urls() -> None:
    from ckptstore.service.secrets_mask import mask_urls

    said = "cannot reach the server at http://127.0.0.1:45661: [Errno 111]. Is it running at http://h:1/x?"
    assert mask_urls(said) == said
    assert mask_urls("see (http://u:hunter2@h:5/db), then http://u:hunter2@h/x.") == (
        "see (http://u:***@h:5/db), then http://u:***@h/x."
    )
