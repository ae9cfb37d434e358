"""Schemathesis over the app's own OpenAPI schema: no operation ever answers 5xx.

Every operation in ``/openapi.json`` (new routes are picked up by themselves) gets up to
``EXAMPLES`` generated requests, in process against the ASGI app, with an admin token: requests
that follow the schema, requests that break it (wrong types, missing fields, bad formats), and
schema-following requests whose path names things that exist (a seeded run, version, tag and
shard), so the handlers behind the 404s run too. Each answer must pass schemathesis'
``not_a_server_error`` check, and every 4xx must be the service's JSON error (``code``,
``message``, ``X-Error-Code``). The shard upload is fuzzed like the rest (its bodies are random
bytes, so invalid shards); its hand-built hostile cases are in tests/api/test_hostile.py.

Schemathesis' pytest plugin cannot load a schema from a fixture under pytest 9, so the
operations are walked here with ``APIOperation.as_strategy`` and Hypothesis' ``given``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from ckptstore.service.api import create_app
from ckptstore.service.settings import Settings
from ckptstore.service.store import Store
from tests.api.kit import TOKENS, bearer, build_shard, commit_body, entry, tensor

pytestmark = pytest.mark.slow  # a bounded schemathesis run of every operation (about 50 s)

EXAMPLES = 120  # per operation: about 40 s for the whole file on two idle cores
SHARD = build_shard(tensor(11, "F32", (4, 4)), tensor(12, "I64", (3,)))
RUN = "run-a"
TAG = "best"
# Path parameters naming things that exist, by parameter name.
KNOWN = {"run_id": [RUN], "ref": ["1", "latest", TAG], "name": [TAG], "shard_id": [SHARD.shard_id]}
ADMIN = bearer("admin")


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The schema of an app over a store holding one run with a tagged version."""
    home = tmp_path_factory.mktemp("schemathesis") / "home"
    store = Store.open_home(home)
    try:
        path = store.staging_path()
        path.write_bytes(SHARD.data)
        store.ingest_file(path)
        app = create_app(store, Settings(home=home, tokens=TOKENS))
        schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=bearer("read"))
        case = schema["/v1/runs/{run_id}/versions"]["POST"].Case(
            path_parameters={"run_id": RUN}, body=commit_body(entry("model/w", SHARD.tensors[0]), tags=[TAG])
        )
        assert case.call(headers=ADMIN).status_code == 201
        yield schema
    finally:
        store.close()


def strategy(operation: Any) -> st.SearchStrategy[Any]:
    """Schema-following, schema-breaking, and schema-following cases with known path parameters."""
    choices = [operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)]
    names = [p.name for p in operation.path_parameters]
    if names and all(name in KNOWN for name in names):
        known = st.fixed_dictionaries({name: st.sampled_from(KNOWN[name]) for name in names})
        choices.append(known.flatmap(lambda values: operation.as_strategy(path_parameters=values)))
    return st.one_of(choices)


def is_error_body(response: Any) -> bool:
    """A schemathesis response carries the service's JSON error: code, message, X-Error-Code."""
    try:
        body = json.loads(response.content)
    except ValueError:
        return False
    return (
        isinstance(body, dict)
        and isinstance(body.get("code"), str)
        and isinstance(body.get("message"), str)
        and response.headers.get("x-error-code") == [body["code"]]
    )


def fuzz(operation: Any) -> Counter[int]:
    """Run the operation's cases; the statuses seen. Raises on the first (shrunk) failing case."""
    statuses: Counter[int] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=strategy(operation))
    def run(case: Any) -> None:
        response = case.call(headers=ADMIN)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])
        if response.status_code >= 400 and case.method.upper() == "HEAD":  # no body: the header says it
            assert response.headers.get("x-error-code"), response.status_code
        elif response.status_code >= 400:
            assert is_error_body(response), (response.status_code, response.text[:300])

    run()
    return statuses


def test_no_operation_answers_a_server_error(api_schema: Any) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    labels = [operation.label for operation in operations]
    assert {"PUT /v1/shards/{shard_id}", "POST /v1/runs/{run_id}/versions", "POST /v1/tensors/missing"} <= set(labels)
    # Destructive operations last, so the others still find the seeded run.
    operations.sort(key=lambda operation: operation.method.upper() == "DELETE")
    failures: list[str] = []
    report: list[str] = []
    started = time.perf_counter()
    for operation in operations:
        began = time.perf_counter()
        try:
            statuses = fuzz(operation)
        except Exception as exc:  # every operation runs; all failures are reported together
            failures.append(f"{operation.label}: {exc}")
            continue
        report.append(
            f"{operation.label}: {sum(statuses.values())} cases in {time.perf_counter() - began:.1f} s, "
            f"{dict(sorted(statuses.items()))}"
        )
        assert statuses and max(statuses) < 500
    print(f"{len(operations)} operations in {time.perf_counter() - started:.1f} s", *report, sep="\n")
    assert not failures, "\n\n".join(failures)
