"""A name a peer or a dataset chose, shown to a person as text: what would act on a terminal escaped.

NOTE [ Chosen names are shown as text ]
    Trainers choose their client and broadcast group names; a dataset chooses its files', sources'
    and fields' names; a service chooses what it says in a refusal. Each may hold a terminal
    escape (ESC ] 52 writes the clipboard, ESC ] 0 the window's title), a carriage return that
    overwrites a log line, a newline that forges one, or a bidi override that shows text reversed.
    Wherever a person reads such a name (``loader-service status`` and ``top``, the service's log
    lines, the trainer's), it goes through ``printable`` first: every control character (C0, DEL,
    C1), every invisible format character (Unicode's Cf: bidi controls such as U+202E, zero-width
    characters, tags), line and paragraph separators and lone surrogates (a file name that is not
    UTF-8) become visible escapes as Python writes them (``\\n``, ``\\x1b``, ``\\u202e``, ``\\udcff``).
    Printable text, other scripts and emoji included, is left as it is; a backslash is not
    doubled, so an escape is readable at a glance (a name may spell one, but can then only show
    as text). Markup (rich's ``[bold]``) is the drawing code's to escape, not this function's.
"""

from __future__ import annotations

import unicodedata
from typing import Final

__all__ = ["printable"]

ESCAPED_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Unicode categories shown as escapes: controls, format characters, surrogates, line and
paragraph separators."""
SHORT_ESCAPES: Final = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
"""Tab, newline and carriage return, by their letters as Python writes them."""


def printable(value: object) -> str:
    """``str(value)`` with each character of ``ESCAPED_CATEGORIES`` replaced by its escape
    (NOTE [ Chosen names are shown as text ]); a string with none is returned as it is."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # the usual case, in C: no control, format, separator but a space
        return text
    return "".join(_escape(ch) if unicodedata.category(ch) in ESCAPED_CATEGORIES else ch for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch in SHORT_ESCAPES:
        return SHORT_ESCAPES[ch]
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
