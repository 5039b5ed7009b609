"""The host's result shaper: every run result fits the budget as serialized, and says
what was cut (pure functions over a RunReport, no sandbox)."""

from __future__ import annotations

import io
import random
from typing import Any

import pytest
from mcp_types import CallToolResult, TextContent
from PIL import Image

from mcp_code_sandbox.run.execute import ImageFile, RunReport
from mcp_code_sandbox.server.fit import fit_count, message_bytes, text_cost
from mcp_code_sandbox.server.tool_results import MAX_FILES_LISTED, run_result
from mcp_code_sandbox.sessions.executor import Display
from mcp_code_sandbox.settings import ConfigError, Settings, load_settings
from mcp_code_sandbox.workspace import Change


def settings(**values: Any) -> Settings:
    return load_settings(values, environ={})


def report(**fields: Any) -> RunReport:
    base: dict[str, Any] = dict(
        session_id="s1",
        session_created=False,
        notice=None,
        language="python",
        status="ok",
        exit_code=None,
        stdout="",
        stderr="",
        stdout_truncated=False,
        stderr_truncated=False,
        full_output_path=None,
        result=None,
        error=None,
        files=[],
        execution_count=1,
        duration_ms=5,
        state_lost=False,
    )
    base.update(fields)
    return RunReport(**base)


def noise_png(side: int, seed: int) -> bytes:
    rng = random.Random(seed)
    image = Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def structured(result: CallToolResult) -> dict[str, Any]:
    assert isinstance(result.structured_content, dict)
    return result.structured_content


def test_a_small_result_is_left_alone() -> None:
    result = run_result(report(stdout="hi\n", result="42"), settings())
    data = structured(result)
    assert data["stdout"] == "hi\n" and data["result"] == "42" and data["notice"] is None
    assert not any(data[f"{k}_truncated"] for k in ("result", "error", "displays", "files"))
    first = result.content[0]
    assert isinstance(first, TextContent) and '"result": "42"' in first.text


def test_everything_at_once_fits_and_says_what_was_cut() -> None:
    # Quotes cost 2 bytes in the JSON and 3 more in its text copy (control characters
    # would cost more, but the shaper removes them before it measures: sanitize).
    hostile = report(
        stdout='"' * 100 * 1024,
        stderr="\n" * 100 * 1024,
        result="r" * 262_144,
        error={"name": "ValueError", "value": "v" * 262_144, "traceback": "t" * 262_144},
        displays=[Display("display", "text/markdown", b"m" * 200_000) for _ in range(10)],
        image_files=[ImageFile(f"p{i}.png", "image/png", noise_png(400, i)) for i in range(4)],
        files=[Change(f"f/{i:05}.txt", 0, "text/plain", "created") for i in range(30_000)],
    )
    # The byte budget, apart from the text's (SANDBOX_MAX_RESULT_TOKENS: raised here).
    roomy = settings(max_result_tokens=10**6)
    budget = roomy.max_result_bytes
    result = run_result(hostile, roomy, lambda path: f"http://h/files/{path}?sig=" + "s" * 80)
    data = structured(result)
    assert message_bytes(result) <= budget
    assert data["result_truncated"] and data["error_truncated"] and data["displays_truncated"]
    assert data["stdout_truncated"] and data["files_truncated"]
    assert len(data["files"]) <= MAX_FILES_LISTED
    assert "30000 files changed" in data["notice"] and "list_files" in data["notice"]
    assert "too large for one message" in data["notice"]
    assert "characters cut" in data["result"] and data["result"].startswith("rrr")


def test_the_biggest_part_is_cut_first_and_small_ones_stay_whole() -> None:
    result = run_result(report(stdout="small and precious\n", result="x" * 2_000_000), settings())
    data = structured(result)
    assert data["stdout"] == "small and precious\n" and not data["stdout_truncated"]
    assert data["result_truncated"] and message_bytes(result) <= settings().max_result_bytes


def test_images_share_the_budget() -> None:
    images = [ImageFile(f"p{i}.png", "image/png", noise_png(500, i)) for i in range(4)]
    result = run_result(report(image_files=images), settings())
    blocks = [b for b in result.content if b.type == "image"]
    assert blocks and message_bytes(result) <= settings().max_result_bytes


@pytest.mark.parametrize("limit", [64 * 1024, 200 * 1024, 2 * 1024 * 1024])
def test_the_setting_moves_the_bound(limit: int) -> None:
    big = report(stdout="o" * 90_000, result="y" * 5_000_000, stderr="\x1b" * 90_000)
    result = run_result(big, settings(max_result_bytes=limit, max_result_tokens=10**6))
    assert message_bytes(result) <= limit
    assert len(structured(result)["result"]) > limit // 8  # not cut to nothing either


def test_the_budget_has_a_floor_and_bounds_each_stream() -> None:
    with pytest.raises(ConfigError):
        settings(max_result_bytes=1000)
    # Two fifths of the text a result may carry (20,000 tokens at 3 bytes each)...
    assert settings().stream_bytes == 20_000 * 3 * 2 // 5
    # ...and a fifth of the message, where the text may be longer.
    roomy = settings(max_output_bytes=1024**2, max_result_tokens=10**6)
    assert roomy.stream_bytes == 512 * 1024 // 5


def test_the_text_of_a_result_stays_within_its_token_budget() -> None:
    loud = report(stdout="o" * 8_000, stderr="e" * 8_000, result="r" * 200_000)
    result = run_result(loud, settings())
    text = sum(len(b.text) for b in result.content if isinstance(b, TextContent))
    assert text <= 20_000 * 3
    data = structured(result)
    assert data["result_truncated"] and not data["stdout_truncated"]  # the biggest, first
    assert "SANDBOX_MAX_RESULT_TOKENS" in data["notice"]


def test_text_cost_counts_both_copies() -> None:
    assert text_cost("ab") == 4 + 6  # "ab" and \"ab\"
    assert text_cost("\x01") == 8 + 11  # "\u0001" and \"\\u0001\"


def test_fit_count_keeps_the_most_entries_that_fit() -> None:
    def build(count: int) -> CallToolResult:
        text = TextContent(type="text", text="e" * 1000 * count)
        return CallToolResult(content=[text], structured_content={"n": count})

    fitted = fit_count(build, 5000, 100_000)
    kept = structured(fitted)["n"]
    assert message_bytes(fitted) <= 100_000 and 90 <= kept <= 99
