"""The web pages: views, the data they show, charts, tensor values, and their templates and
static files.

It may import fastapi, jinja2, :mod:`service.api.http`, the api's floor (deps, errors, redact)
and of the engine the Store, its records, errors and format; never :mod:`service.api.routes`.
"""
