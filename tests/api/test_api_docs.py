"""docs/http-api.md's HTTP API table against the app's OpenAPI schema, so the two cannot drift apart.

The table's first column holds routes (`` `METHOD /path?query=…` ``, several joined by ``·``),
each optionally followed by its JSON body (`` `{"field", …}` ``); the second the token scope;
the third a description whose `` `{…}` `` parts name fields of the response. Every route the app
serves under /v1 (and /healthz, /metrics) must be in the table with its scope, every query
parameter and every body field, and every response field the table names must exist.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute, iter_route_contexts

from ckptstore.service.api.deps import ScopeCheck

API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"
_ROUTE = re.compile(r"^(GET|HEAD|POST|PUT|DELETE|PATCH) (/\S*)$")
_QUOTED = re.compile(r'"([A-Za-z_][A-Za-z0-9_]*)"')


@dataclass
class Row:
    """One route as the HTTP API page documents it."""

    scope: str
    query: set[str] = field(default_factory=set)
    body: set[str] | None = None
    response: set[str] = field(default_factory=set)


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def readme_rows() -> dict[tuple[str, str], Row]:
    """``(METHOD, path) -> Row`` for every route in docs/http-api.md's table."""
    section = API_PAGE.read_text().split("# HTTP API (v1)\n", 1)[1].split("\n#", 1)[0]
    rows: dict[tuple[str, str], Row] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        routes, scope, what = cells
        response = {name for span in _code_spans(what) if span.startswith("{") for name in _QUOTED.findall(span)}
        for part in routes.split(" · "):
            spans = _code_spans(part)
            match = _ROUTE.match(spans[0]) if spans else None
            assert match is not None, f"not a route in the HTTP API page's table: {part!r}"
            path, _, query = match.group(2).partition("?")
            row = Row(scope=scope, query={p.split("=")[0] for p in query.split("&") if p}, response=response)
            bodies = [span for span in spans[1:] if span.startswith("{")]
            if bodies:
                row.body = set(_QUOTED.findall(bodies[0]))
            key = (match.group(1), path)
            assert key not in rows, f"{key} is listed twice"
            rows[key] = row
    return rows


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        schema = spec["components"]["schemas"][name]
    return schema


def _fields(spec: dict[str, Any], schema: dict[str, Any]) -> set[str]:
    """Property names of an object schema, of its array items or of its map values."""
    schema = _resolve(spec, schema)
    names = set(schema.get("properties", {}))
    for nested in ("items", "additionalProperties"):
        if isinstance(schema.get(nested), dict):
            names |= _fields(spec, schema[nested])
    for option in schema.get("anyOf", []):
        names |= _fields(spec, option)
    return names


def documented_routes(app: FastAPI) -> Iterator[tuple[str, str, APIRoute]]:
    """Every (METHOD, path, route) of the API proper: /v1 and the operational routes."""
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, APIRoute) and route.include_in_schema:
            for method in sorted(context.methods or ()):
                yield method, str(context.path), route


def scope_of(route: APIRoute) -> str:
    checks = [d.dependency.scope for d in route.dependencies if isinstance(d.dependency, ScopeCheck)]
    return checks[0] if checks else "none"


@pytest.fixture
def spec(app: FastAPI) -> dict[str, Any]:
    return app.openapi()


def test_the_readme_lists_every_route_and_no_other(app: FastAPI) -> None:
    served = {(method, path) for method, path, _ in documented_routes(app)}
    assert len(served) >= 16
    assert set(readme_rows()) == served


def test_the_readme_names_each_routes_scope(app: FastAPI) -> None:
    rows = readme_rows()
    wrong = {
        (method, path): (rows[method, path].scope, scope_of(route))
        for method, path, route in documented_routes(app)
        if (method, path) in rows and rows[method, path].scope != scope_of(route)
    }
    assert wrong == {}


def test_the_readme_names_every_query_parameter_and_body_field(spec: dict[str, Any]) -> None:
    wrong = {}
    for (method, path), row in readme_rows().items():
        operation = spec["paths"][path][method.lower()]
        query = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
        content = operation.get("requestBody", {}).get("content", {})
        body = _fields(spec, content["application/json"]["schema"]) if "application/json" in content else None
        if (row.query, row.body) != (query, body):
            wrong[method, path] = {"readme": (row.query, row.body), "openapi": (query, body)}
    assert wrong == {}


def test_the_response_fields_the_readme_names_exist(spec: dict[str, Any]) -> None:
    wrong = {}
    for (method, path), row in readme_rows().items():
        operation = spec["paths"][path][method.lower()]
        ok = next(code for code in operation["responses"] if code.startswith("2"))
        content = operation["responses"][ok].get("content", {})
        returned = _fields(spec, content["application/json"]["schema"]) if "application/json" in content else set()
        if row.response - returned:
            wrong[method, path] = sorted(row.response - returned)
    assert wrong == {}


def test_the_parser_sees_what_the_table_says() -> None:
    """A check of the checker: fields known to be in the table are read from it."""
    rows = readme_rows()
    assert rows["POST", "/v1/tensors/locate"].response >= {"shard_id", "offset", "nbytes"}
    assert rows["PUT", "/v1/runs/{run_id}/retention"].query == {"create"}
    assert rows["PUT", "/v1/runs/{run_id}/tags/{name}"].body == {"version"}
    assert rows["DELETE", "/v1/runs/{run_id}/tags/{name}"].body is None
    assert rows["GET", "/healthz"].scope == "none"
