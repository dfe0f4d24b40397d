"""NOTE [ Chosen names are shown as text ]: ``printable`` escapes every class of character that acts
on a terminal or hides text, and leaves the rest of a name as it is; the service's log lines go
through it."""

from __future__ import annotations

import logging
import sys
import unicodedata

import pytest

from loader_service.logs import TextFormatter
from protocol.printable import ESCAPED_CATEGORIES, printable

OSC_52 = "\x1b]52;c;cHduZWQ=\x07"
"""Write "pwned" to the terminal's clipboard."""
OSC_0 = "\x1b]0;owned\x1b\\"
"""Set the window's title (string terminator ESC \\)."""


@pytest.mark.parametrize("code", [*range(0x20), 0x7F])
def test_every_c0_control_and_del_is_escaped(code: int) -> None:
    """As Python writes them: tab, newline and carriage return by their letters."""
    escape = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}.get(code, f"\\x{code:02x}")
    assert printable(f"a{chr(code)}b") == f"a{escape}b"


@pytest.mark.parametrize("code", range(0x80, 0xA0))
def test_every_c1_control_is_escaped(code: int) -> None:
    """C1: U+009B is a one-character CSI, U+009D an OSC, on terminals that take 8-bit controls."""
    assert printable(f"a{chr(code)}b") == f"a\\x{code:02x}b"


@pytest.mark.parametrize(
    ("sequence", "shown"),
    [
        (OSC_52, "\\x1b]52;c;cHduZWQ=\\x07"),
        (OSC_0, "\\x1b]0;owned\\x1b\\"),
        ("\x1b[2J\x1b[31mred", "\\x1b[2J\\x1b[31mred"),
        ("ok\rforged", "ok\\rforged"),
        ("line\n2024-01-01 INFO service forged", "line\\n2024-01-01 INFO service forged"),
    ],
)
def test_escape_sequences_show_as_text(sequence: str, shown: str) -> None:
    assert printable(sequence) == shown


@pytest.mark.parametrize(
    "code",
    [
        *range(0x202A, 0x202F),  # bidi embeddings and overrides: U+202E shows "gpj.exe" as "exe.jpg"
        *range(0x2066, 0x206A),  # bidi isolates
        0x200E, 0x200F, 0x061C,  # marks
        0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF,  # zero-width characters
    ],
)  # fmt: skip
def test_bidi_controls_and_invisible_format_characters_are_escaped(code: int) -> None:
    assert printable(f"a{chr(code)}b") == f"a\\u{code:04x}b"


def test_separators_tags_and_lone_surrogates_are_escaped() -> None:
    assert printable("a\u2028b\u2029c") == "a\\u2028b\\u2029c"
    assert printable("\U000e0041tag") == "\\U000e0041tag"
    assert printable("soft\u00adhyphen") == "soft\\xadhyphen", (
        "a soft hyphen: below U+0100, as Python writes it"
    )
    undecodable = b"bad\xff.jpg".decode("utf-8", "surrogateescape")  # a file name that is not UTF-8
    shown = printable(undecodable)
    assert shown == "bad\\udcff.jpg" and shown.encode("utf-8")


@pytest.mark.parametrize(
    "name",
    ["host:123", "[/]", "train", "日本語のデータ", "café \u00a0 naïve", "🙂👍🏽", "a\\x1b b", "C:\\data", ""],
)
def test_printable_names_are_left_as_they_are(name: str) -> None:
    assert printable(name) is name or printable(name) == name


def test_anything_is_shown_through_str() -> None:
    assert printable(3) == "3" and printable(None) == "None"
    assert printable(ValueError(f"bad {OSC_52}")) == "bad \\x1b]52;c;cHduZWQ=\\x07"


def test_no_code_point_survives_that_a_terminal_would_act_on() -> None:
    """Every code point, one by one: what ``printable`` returns holds none of the escaped categories
    and always encodes as UTF-8."""
    for code in range(sys.maxunicode + 1):
        shown = printable(chr(code))
        if shown != chr(code):
            assert unicodedata.category(chr(code)) in ESCAPED_CATEGORIES
            assert shown.startswith("\\") and shown.isascii() and shown.isprintable()
        else:
            assert unicodedata.category(chr(code)) not in ESCAPED_CATEGORIES


def test_the_services_log_lines_are_one_line_of_text_each() -> None:
    """``loader_service.logs``: a message is one line whatever its arguments hold; a traceback keeps
    its own lines, each shown as text."""
    formatter = TextFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord("t", logging.WARNING, __file__, 1, "bad file %s: %s", (OSC_0, "x\ny"), None)
    assert formatter.format(record) == "WARNING bad file \\x1b]0;owned\\x1b\\: x\\ny"
    try:
        raise ValueError(f"group {OSC_52}")
    except ValueError:
        failed = logging.LogRecord("t", logging.ERROR, __file__, 1, "fatal", (), sys.exc_info())
    lines = formatter.format(failed).split("\n")
    assert lines[0] == "ERROR fatal" and lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: group \\x1b]52;c;cHduZWQ=\\x07"
