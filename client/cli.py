"""The ``ckptstore`` command line."""

from __future__ import annotations

import typer

app = typer.Typer(help="ckptstore: a checkpoint store for PyTorch training.", no_args_is_help=True)


@app.command()
def quickstart() -> None:
    """Save and load a small model on the embedded store, printing what was stored."""
    from client.quickstart import run

    run()


if __name__ == "__main__":
    app()
