"""The JSON API's routes, one module per resource: runs, data (shards and tensors), uploads,
retention, admin and ops.

It may import fastapi, :mod:`service.api.http`, the api's floor (deps, schemas, errors, metrics)
and of the engine the store's records, errors, settings and format; never :mod:`service.api.pages.views`,
SQL or stored files.
"""
