"""HTTP plumbing under the routes: the uvicorn protocol that hands large bodies over piecewise,
socket bodies, sendfile, streaming, body limits, strict JSON, byte ranges and range batches,
middleware, same-site checks and garbage-collection pauses.

It may import starlette, uvicorn, fastapi, the api's errors, schemas and metrics, and of the engine
the Store, its records, errors, format and intake receivers; never :mod:`service.api.routes` or
:mod:`service.api.pages.views`.
"""
