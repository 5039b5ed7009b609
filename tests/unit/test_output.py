"""Bounded output capture: head + tail within budget, the full text spooled when cut."""

import io
from pathlib import Path

from mcp_code_sandbox.run.output import MAX_SPOOL_BYTES, OutputCapture


def test_small_output_is_kept_whole() -> None:
    cap = OutputCapture(100, lambda: None)
    cap.add("stdout", "hello ")
    cap.add("stdout", "world")
    cap.add("stderr", "warn")
    out = cap.render("stdout", None)
    assert (out.text, out.truncated) == ("hello world", False)
    assert cap.render("stderr", None).text == "warn"


def test_large_output_keeps_head_and_tail_and_spools_everything(tmp_path: Path) -> None:
    spool_path = tmp_path / "full.txt"
    cap = OutputCapture(100, lambda: open(spool_path, "w+b"))  # noqa: SIM115 - closed by finish
    for i in range(1000):
        cap.add("stdout", f"line {i}\n")
    full_bytes = cap.finish()
    out = cap.render("stdout", "/mnt/data/.outputs/run-1.txt")
    assert out.truncated
    assert out.text.startswith("line 0\n")
    assert out.text.rstrip().endswith("line 999")
    assert "bytes cut; full output in /mnt/data/.outputs/run-1.txt" in out.text
    assert len(out.text.encode()) < 100 + 200
    full = spool_path.read_text()
    assert full == "".join(f"line {i}\n" for i in range(1000))
    assert full_bytes == full.encode()


def test_memory_stays_bounded_without_a_spool() -> None:
    cap = OutputCapture(1000, lambda: None)
    for _ in range(10_000):
        cap.add("stdout", "x" * 1000)
    assert cap.spool is None
    assert cap.total_bytes == 10_000_000
    assert len(cap.render("stdout", None).text) < 1200


def test_spool_is_capped() -> None:
    cap = OutputCapture(10, io.BytesIO)
    chunk = "y" * (1024 * 1024)
    for _ in range(MAX_SPOOL_BYTES // len(chunk) + 3):
        cap.add("stdout", chunk)
    full = cap.finish()
    assert cap.spool_cut and full is not None
    assert MAX_SPOOL_BYTES <= len(full) < MAX_SPOOL_BYTES + 200
    assert full.endswith(b"bytes]\n")


def test_cut_inside_a_multibyte_character_does_not_raise() -> None:
    cap = OutputCapture(11, lambda: None)
    cap.add("stdout", "é" * 50)
    assert cap.render("stdout", None).truncated
