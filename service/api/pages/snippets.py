"""How a version page says to load its version: the Python to paste and the shell commands.

Both name the store by the URL the browser used for the page (``server``), and only when it is
a plain http(s) URL: a Host header holding anything else becomes ``http://HOST:PORT``, so no
text from a request reaches a shell line or Python source as it came. A token is never written:
the snippets read it from ``CKPTSTORE_TOKEN``.
"""

from __future__ import annotations

import re

_SERVER = re.compile(r"^https?://[A-Za-z0-9.\[\]:-]{1,200}(/[A-Za-z0-9._~/-]{0,200})?$")


def server_url(server: str) -> str:
    """``server`` if it is a plain http(s) URL, else a placeholder (nothing else goes into a snippet)."""
    return server if _SERVER.fullmatch(server) else "http://HOST:PORT"


def python_snippet(server: str, run_id: str, version: int, *, optim: bool, scheduler: bool) -> str:
    """Python that loads ``version`` of ``run_id`` into a model (and its optimizer and scheduler,
    when the version holds them) from the store at ``server``, ready to paste and run."""
    parts = [f'"{run_id}"', f"version={version}", "model=model"]  # run ids need no escaping
    parts += ["optim=optim"] if optim else []
    parts += ["scheduler=scheduler"] if scheduler else []
    made = ", ".join(["model"] + [name for name, held in (("optim", optim), ("scheduler", scheduler)) if held])
    return (
        "import os\n\n"
        "from ckptstore import client\n\n"
        f"# {made}: built as for training. The token, when the server has tokens: CKPTSTORE_TOKEN.\n"
        f'store = client.Client("{server_url(server)}", token=os.environ.get("CKPTSTORE_TOKEN"))\n'
        f"loaded = store.load({', '.join(parts)})\n"
        "print(loaded.step, loaded.metrics)"
    )


def cli_snippet(server: str, run_id: str, version: int) -> str:
    """Shell commands that show ``version`` of ``run_id`` and write it out as a Hugging Face folder."""
    target = f"{run_id}@{version}"
    return (
        "# with CKPTSTORE_TOKEN set too when the server has tokens\n"
        f"export CKPTSTORE_URL={server_url(server)}\n"
        f"ckptstore show {target}\n"
        f"ckptstore export {target} ./{run_id}-v{version}"
    )
