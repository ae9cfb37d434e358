"""What ``--help`` shows for each option's value: plain names, as git, hf and mlflow write them
(``--dry-run``, ``--keys PATTERN``, ``ls [RUN]``), never typer's type placeholders (``<bool>``,
``<list[str]>``, ``<int range>``).

:class:`PlainHelpGroup` is the command line's group: before it parses anything it gives every
parameter of every command (the help option included) a metavar: nothing for a flag, the name
:data:`METAVARS` gives a parameter, else its name in capitals.
"""

from __future__ import annotations

import functools
from typing import Any

from typer.core import TyperGroup

#: The value names shown for parameters, by parameter name (others: the name in capitals).
METAVARS = {
    "run_id": "RUN",
    "target": "RUN@REF",
    "older": "RUN@REF",
    "newer": "RUN@REF",
    "name": "TAG",
    "tag": "TAG",
    "directory": "DIR",
    "source": "PATH",
    "keys": "PATTERN",
    "keep_last": "N",
    "keep_best": "N",
    "metric": "NAME",
    "mode": "min|max",
    "max_shard_size": "SIZE",
    "format": "FORMAT",
    "as_format": "FORMAT",
    "peft_config": "FILE",
    "host": "ADDRESS",
    "port": "PORT",
    "workers": "N",
}


def _no_type(ctx: Any) -> None:
    return None


def _usage_name(param: Any) -> str:
    """An argument on the usage line: ``RUN`` when required, ``[RUN]`` when not (typer writes ``{RUN}``)."""
    name = param.metavar or (param.name or "value").upper()
    return (name if param.required else f"[{name}]") + ("..." if param.nargs != 1 else "")


def plain_metavar(param: Any) -> None:
    """Give ``param`` (a click parameter) a plain metavar unless it has one: none for a flag.
    An argument, which typer shows by its metavar and then its type, shows no type."""
    if param is None:
        return
    if getattr(param, "param_type_name", "") == "argument":
        param.display_type_rich = _no_type  # its name column already says what it is
        param._usage_display_name = functools.partial(_usage_name, param)
    if param.metavar is not None:
        return
    if getattr(param, "is_flag", False) and not getattr(param, "count", False):
        param.metavar = ""
    else:
        param.metavar = METAVARS.get(param.name or "", (param.name or "value").upper())


def plain_names(command: Any, ctx: Any) -> None:
    """:func:`plain_metavar` for every parameter of ``command`` and of every command under it."""
    for param in [*command.params, command.get_help_option(ctx)]:
        plain_metavar(param)
    for sub in getattr(command, "commands", {}).values():
        plain_names(sub, ctx)


class PlainHelpGroup(TyperGroup):
    """The command line's group: every command's parameters shown by plain names (see the module)."""

    def get_params(self, ctx: Any) -> list[Any]:
        """The group's parameters, once every command's parameters have plain metavars."""
        plain_names(self, ctx)
        return super().get_params(ctx)


__all__ = ["METAVARS", "PlainHelpGroup", "plain_metavar", "plain_names"]
