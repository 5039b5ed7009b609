"""The agent's side of the result budget, on the real agent process (see test_agent.py).

The kernel drops displays past the run's budget before framing them and cuts the result
and error texts; the supervisor does it again on what the kernel sends, because user
code runs in the kernel and can switch the kernel's checks off.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mcp_code_sandbox.agent.budget import MAX_DISPLAYS, Budget, DisplayGate, cut_text
from mcp_code_sandbox.agent.protocol import MAX_FRAME_BYTES

from .test_agent import KINDS, Agent, start_agent

SMALL = {"result_bytes": 64 * 1024, "images": 2}
LIMIT = Budget(**SMALL).text_chars

PNG_CLASS = """
import base64
PNG = base64.b64decode(
    'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=='
)
class Pic:
    def _repr_png_(self):
        return PNG
"""

# User code switching the kernel's own checks off (it runs in the kernel's process).
SUBVERT = """
import sys
for name, module in list(sys.modules.items()):
    if name.endswith('.budget') and hasattr(module, 'DisplayGate'):
        module.DisplayGate.admit = lambda self, data: data
    if name.endswith('.kernel') and hasattr(module, 'cut_text'):
        module.cut_text = lambda text, limit, why='': (text, False)
        module.cut_error = lambda error, limit: (error, False)
"""


@pytest.fixture(params=KINDS)
def agent(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Agent]:
    a = start_agent(request.param, tmp_path)
    yield a
    assert a.close() == 0


def test_a_huge_result_is_cut_head_and_tail(agent: Agent) -> None:
    done = agent.run("'a' + 'x' * 5_000_000 + 'z'", budget=SMALL).done
    assert done["status"] == "ok" and done["cut"]["result"] is True
    assert len(done["result"]) <= LIMIT
    assert done["result"].startswith("'ax") and done["result"].endswith("xz'")
    assert "characters cut" in done["result"]


def test_a_huge_error_is_cut_and_the_traceback_kept(agent: Agent) -> None:
    code = (
        "def f(n):\n"
        "    if n == 0:\n"
        "        raise ValueError('e' * 1_000_000)\n"
        "    return f(n - 1)\n"
        "f(50)"
    )
    done = agent.run(code, budget=SMALL).done
    assert done["status"] == "error" and done["cut"]["error"] is True
    error = done["error"]
    assert error["name"] == "ValueError"
    assert len(error["value"]) <= LIMIT and len(error["traceback"]) <= LIMIT
    assert "return f(n - 1)" in error["traceback"]


def test_displays_past_the_budget_are_dropped_as_they_arrive(agent: Agent) -> None:
    code = PNG_CLASS + "for i in range(100):\n    display('t' * 10_000)\n    display(Pic())\n"
    result = agent.run(code, budget=SMALL)
    images = [d for d in result.displays if "image/png" in d["data"]]
    texts = sum(len(v) for d in result.displays for k, v in d["data"].items() if k != "image/png")
    assert len(images) == 2
    assert texts <= SMALL["result_bytes"] + 2 * 200
    assert len(result.displays) <= MAX_DISPLAYS
    cut = result.done["cut"]
    assert cut["images_dropped"] == 98
    assert cut["displays_dropped"] + cut["images_dropped"] == 200 - len(result.displays)


def test_the_supervisor_bounds_a_kernel_whose_checks_were_switched_off(agent: Agent) -> None:
    assert agent.run(SUBVERT).status == "ok"
    flood = agent.run(PNG_CLASS + "for i in range(50):\n    display(Pic())\n", budget=SMALL)
    assert len(flood.displays) == 2 and flood.done["cut"]["images_dropped"] == 48
    big = agent.run("'x' * 3_000_000", budget=SMALL).done
    assert len(big["result"]) <= LIMIT and big["cut"]["result"] is True


def test_a_result_larger_than_a_frame_keeps_the_interpreter(agent: Agent) -> None:
    # Before the budget, the kernel could not frame its done: it died, variables lost.
    agent.run("kept = 7")
    done = agent.run(f"'y' * {MAX_FRAME_BYTES + 1000}").done
    assert done["status"] == "ok" and done["state_lost"] is False
    assert agent.run("kept").done["result"] == "7"


def test_an_error_with_a_lone_surrogate_is_an_error_not_a_dead_kernel(agent: Agent) -> None:
    done = agent.run("raise ValueError('\\ud800')").done
    assert done["status"] == "error" and done["error"]["name"] == "ValueError"
    assert done["state_lost"] is False


def test_the_gate_keeps_text_until_the_budget_then_cuts_once_and_drops() -> None:
    gate = DisplayGate(Budget(result_bytes=10_000, images=1))
    assert gate.admit({"text/plain": "a" * 6000}) == {"text/plain": "a" * 6000}
    cut = gate.admit({"text/plain": "b" * 6000})
    assert cut is not None and len(cut["text/plain"]) <= 4000 and gate.cut == 1
    assert gate.admit({"text/plain": "c"}) is None and gate.dropped == 1
    assert gate.admit({"image/png": "AAAA", "text/plain": "p" * 500}) == {
        "image/png": "AAAA",
        "text/plain": "p" * 200,
    }
    assert gate.admit({"image/png": "AAAA"}) is None and gate.images_dropped == 1
    assert gate.admit("not a dict") is None and gate.dropped == 2


def test_budget_from_a_message_falls_back_to_defaults() -> None:
    assert Budget.from_message(None) == Budget()
    assert Budget.from_message({"result_bytes": -1, "images": True}) == Budget()
    assert Budget.from_message({"result_bytes": 70_000, "images": 0}) == Budget(70_000, 0)


def test_cut_text() -> None:
    assert cut_text("short", 10) == ("short", False)
    text, cut = cut_text("h" * 500 + "t" * 500, 200)
    assert cut and len(text) <= 200 and text.startswith("h") and text.endswith("t")
