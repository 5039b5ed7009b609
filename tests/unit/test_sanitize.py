"""Control sequences out of output, control characters escaped in names (pure)."""

from __future__ import annotations

import pytest

from mcp_code_sandbox.sanitize import clean_text, escape_name, unescape_name

OSC52 = "\x1b]52;c;aGVsbG8=\x07"


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain\ttext\nand more\n", "plain\ttext\nand more\n"),
        (f"before{OSC52}after", "beforeafter"),
        ("a\x1b]52;c;aGk=\x1b\\b", "ab"),  # OSC ended by ST
        ("\x1b]0;fake title\x07x", "x"),
        ("\x1b[2J\x1b[H\x1b[3Jcleared", "cleared"),
        ("\x1b[31mred\x1b[0m", "red"),
        ("\x1bcreset \x1b7saved \x1b(Bcharset", "reset saved charset"),
        ("\x9b2J8-bit \x9d52;c;aGk=\x9cdone", "8-bit done"),
        ("\x1bP+q544e\x1b\\dcs", "dcs"),
        ("nul\x00bel\x07bs\x08del\x7f", "nulbelbsdel"),
        ("progress 10%\rprogress 20%\r\ndone\r\n", "progress 10%\nprogress 20%\ndone\n"),
        ("\x1b]52;c;unterminated", "52;c;unterminated"),  # the rest stays text
        ("\x1b\x1b[2Jdouble", "double"),
        ("ünïcode ✓ \u2028", "ünïcode ✓ \u2028"),
    ],
)
def test_clean_text(raw: str, shown: str) -> None:
    assert clean_text(raw) == shown
    assert len(clean_text(raw)) <= len(raw)


def test_clean_text_leaves_no_control_character_but_newline_and_tab() -> None:
    every = "".join(chr(c) for c in range(0x00, 0xA0)) * 3 + OSC52
    left = clean_text(every)
    assert {c for c in left if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F} <= {"\n", "\t"}


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("report.csv", "report.csv"),
        ("dir/a b.txt", "dir/a b.txt"),
        ("evil\x1b]52;c;aGk=\x07.txt", "evil\\x1b]52;c;aGk=\\x07.txt"),
        ("two\nlines", "two\\x0alines"),
        ("tab\there", "tab\\x09here"),
        ("back\\slash", "back\\\\slash"),
        ("c1\x9b", "c1\\x9b"),
        ("literal\\x1b", "literal\\\\x1b"),  # a backslash then x1b: not an escape
    ],
)
def test_names_are_escaped_visibly_and_come_back(name: str, shown: str) -> None:
    escaped = escape_name(name)
    assert escaped == shown
    assert escaped.isprintable()
    assert unescape_name(escaped) == name


@pytest.mark.parametrize("bad", ["a\\", "a\\n", "a\\x00", "a\\x2f", "a\\x1B", "a\\x4"])
def test_only_escapes_this_server_writes_are_taken_back(bad: str) -> None:
    with pytest.raises(ValueError):
        unescape_name(bad)
