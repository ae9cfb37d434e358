"""The API's own description: ``/openapi.json`` for API clients and ``/docs`` for browsers.

``/openapi.json`` takes a read token like every /v1 route. ``/docs`` is a page (read token in
the header or the /login cookie; a browser without one is sent to /login) running Swagger UI
from files shipped in the package under /static/swagger-ui (swagger-ui-dist, Apache-2.0), so
nothing is fetched from another site. The schema travels inside the page as a JSON data block,
because the browser's login cookie is not accepted by the API; a script from this server
(static/docs.js) starts Swagger UI on it, and the page's CSP allows nothing but this server.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from jinja2.utils import htmlsafe_json_dumps

from ckptstore.service.api.deps import CanRead
from ckptstore.service.api.pages.views import CanReadPages, PageRoute, render

#: As the other pages, plus what Swagger UI needs: its icons are data: images in its stylesheet,
#: and "Try it out" sends requests to this server.
DOCS_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "font-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)

api_router = APIRouter(include_in_schema=False)
page_router = APIRouter(route_class=PageRoute, include_in_schema=False)


def schema(request: Request) -> dict[str, Any]:
    """The application's OpenAPI schema (built once, then cached by FastAPI)."""
    return request.app.openapi()


@api_router.get("/openapi.json", dependencies=[CanRead])
async def openapi_json(request: Request) -> JSONResponse:
    """The OpenAPI schema of the JSON API."""
    return JSONResponse(schema(request))


@page_router.get("/docs", dependencies=CanReadPages)
async def docs_page(request: Request) -> Response:
    """The interactive API reference (Swagger UI), served entirely from this server."""
    # In route order (Jinja's tojson would sort the paths), with <, >, & and ' escaped so no text in
    # the schema can end the data block and start markup.
    response = render(request, "docs.html", spec_json=htmlsafe_json_dumps(schema(request)))
    response.headers["Content-Security-Policy"] = DOCS_CSP
    return response
