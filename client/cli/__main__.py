"""``python -m client.cli``: the ``ckptstore`` command line."""

from ckptstore.client.cli import app

app()
