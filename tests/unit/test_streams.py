"""Reading a sandbox's stream: bounded lines, escaped controls (backends/streams.py)."""

from __future__ import annotations

import asyncio

from mcp_code_sandbox.backends.streams import LineSplitter, escape_control, escape_line, read_lines


def split(chunks: list[bytes], max_bytes: int = 8) -> list[tuple[bytes, bool]]:
    splitter = LineSplitter(max_bytes)
    out = [line for chunk in chunks for line in splitter.feed(chunk)]
    return out + list(splitter.flush())


def test_lines_across_chunks() -> None:
    assert split([b"ab", b"c\nde", b"f\n\ng"]) == [
        (b"abc", False),
        (b"def", False),
        (b"", False),
        (b"g", False),
    ]


def test_a_long_line_is_cut_once_and_its_rest_dropped() -> None:
    assert split([b"0123456789", b"abcdef", b"ghi\nok\n"]) == [(b"01234567", True), (b"ok", False)]
    # Exactly the cap is not cut; one more byte is.
    assert split([b"01234567\n012345678\n"]) == [(b"01234567", False), (b"01234567", True)]
    # A cut line that never ends: nothing more at EOF.
    assert split([b"x" * 100]) == [(b"x" * 8, True)]


def test_memory_stays_bounded_for_an_endless_line() -> None:
    splitter = LineSplitter(16)
    for _ in range(1000):
        list(splitter.feed(b"y" * 4096))
        assert len(splitter._line) <= 16


def test_control_characters_become_visible_escapes() -> None:
    raw = "a\x1b[2J\x1b]52;c;QUJD\x07b\rc\x00d\ne\x7f\x9b\u2028\u202etab\t"
    escaped = escape_control(raw)
    assert escaped == ("a\\x1b[2J\\x1b]52;c;QUJD\\x07b\\rc\\x00d\\ne\\x7f\\x9b\\u2028\\u202etab\\t")
    assert escaped.isprintable()
    assert escape_control("plain text, ünïcødé ✓") == "plain text, ünïcødé ✓"


async def test_read_lines_never_raises_on_a_line_past_the_streams_limit() -> None:
    # StreamReader.readline() raises past its 64 KiB limit: this reader must not.
    stream = asyncio.StreamReader(limit=64 * 1024)
    stream.feed_data(b"\x1b[31m" + b"A" * 200_000 + b"\nINFO fake server line\r\n")
    stream.feed_data(b"tail without newline")
    stream.feed_eof()
    seen: list[tuple[str, bool]] = []
    await read_lines(stream, 500, lambda line, cut: seen.append((escape_line(line), cut)))
    assert [cut for _, cut in seen] == [True, False, False]
    first, fake, tail = (text for text, _ in seen)
    assert first.startswith("\\x1b[31mAAA") and len(first) <= 500 + 3
    assert fake == "INFO fake server line\\r"
    assert tail == "tail without newline"
