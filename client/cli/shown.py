"""Text as the terminal is shown it: every control character written as its escape.

What the CLI prints holds names it did not choose: file names in a checkpoint folder, keys of a
pickled dict, tensor names and paths in a store. A name holding an escape sequence (``ESC ]`` sets
the window title or a link, ``ESC [`` colours and moves the cursor, and so do their one-byte C1
forms ``\\x9d``, ``\\x9b``), a carriage return or a bidi override (``U+202E`` shows the text after it
reversed) would act on the user's terminal instead of being read. So everything the CLI prints
passes through :func:`shown`: a character of Unicode category Cc (C0, DEL, C1), Cf (format: bidi
controls, zero-width characters), Zl or Zp (line and paragraph separators) or Cs (a lone
surrogate, what an undecodable byte of a file name becomes) is written as ``\\x1b``, ``\\u202e`` or
``\\U000e0001``; every printable character, backslash included, is left as it is.

Torch-free, like every module of :mod:`client.cli`.
"""

from __future__ import annotations

import unicodedata

#: The categories written as escapes (see the module docstring); none is printable (``str.isprintable``).
ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def escape(char: str) -> str:
    """``char`` as its escape: ``\\x1b``, ``\\u202e``, ``\\U000e0001``."""
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def shown(text: str) -> str:
    """``text`` with every control, format and separator character written as its escape, newlines
    included: one line, whatever ``text`` holds."""
    if text.isprintable():  # the common case, checked in C
        return text
    return "".join(escape(char) if unicodedata.category(char) in ESCAPED_CATEGORIES else char for char in text)


def shown_lines(text: str) -> str:
    """``text`` as :func:`shown` writes it, but for its newlines (the layout of a message the CLI
    composed); a name printed inside it should be :func:`shown` first, so it stays on its line."""
    return "\n".join(shown(line) for line in text.split("\n"))


__all__ = ["ESCAPED_CATEGORIES", "escape", "shown", "shown_lines"]
