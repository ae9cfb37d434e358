"""Counts in the command line's messages, in proper English: ``1 version``, ``2 versions``,
``0 versions``; ``1 blob has``, ``2 blobs have``. Every message that counts things says it
through :func:`counted` (and :func:`agree` for its verb)."""

from __future__ import annotations

#: Nouns whose plural is not the noun plus ``s``.
IRREGULAR = {"entry": "entries", "child": "children", "process": "processes"}


def plural(noun: str) -> str:
    """The plural of ``noun`` (its last word): ``version`` -> ``versions``, ``entry`` -> ``entries``."""
    head, _, last = noun.rpartition(" ")
    many = IRREGULAR.get(last, last + "s")
    return f"{head} {many}" if head else many


def counted(count: int, noun: str, many: str | None = None) -> str:
    """``count`` then ``noun``, plural unless ``count`` is 1 (``many``: the plural, if not
    :func:`plural`'s): ``counted(1, "version")`` is ``1 version``, ``counted(2, "version")`` ``2 versions``."""
    return f"{count} {noun if count == 1 else (many or plural(noun))}"


def agree(count: int, one: str, many: str) -> str:
    """The verb form for ``count`` things: ``one`` for 1, else ``many`` (``has``/``have``)."""
    return one if count == 1 else many


__all__ = ["IRREGULAR", "agree", "counted", "plural"]
