"""``python -m client.cli``: the ``ckptstore`` command line."""

from client.cli import app

app()
