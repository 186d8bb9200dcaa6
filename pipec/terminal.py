"""Text pipec prints that may hold what a user typed (paths, specs): control characters shown
as escapes, so that a name holding ESC sequences or a carriage return cannot rewrite the
terminal or forge a line of output."""

from __future__ import annotations

import unicodedata


def printable(text: str) -> str:
    """`text` with every control or format character (Unicode categories Cc, Cf: ESC, CR, a
    newline, bidirectional overrides) written as its Python escape, e.g. `\\x1b`."""
    return "".join(
        c.encode("unicode_escape").decode() if unicodedata.category(c) in ("Cc", "Cf") else c
        for c in text
    )
