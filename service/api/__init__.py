"""The HTTP face of the store: FastAPI routes over the engine, and the web pages.

It may import fastapi, starlette, uvicorn, jinja2 and the engine (:class:`service.store.Store`
with its records, errors, settings and format); never torch or ``client``. Routes run no SQL and
open no stored file themselves: every read and write of a checkpoint goes through the Store,
and its errors become HTTP answers in one place (:mod:`service.api.errors`).
"""

from ckptstore.service.api.app import create_app

__all__ = ["create_app"]
