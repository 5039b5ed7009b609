"""The languages ``run_code`` offers, and how each one runs.

Python runs in the session's persistent interpreter; every other language runs per call
as a subprocess of the agent in the same sandbox and workspace (issue 4 adds them here).
The docker backend adds the languages of runner images (:mod:`.backends.docker_runner`):
one process per call in another container that shares the session's workspace.
A backend may offer fewer (its runtime env or image lacks the interpreter): the agent's
``ready`` message lists what it really found.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcp_code_sandbox.backends.base import RunnerImage

__all__ = ["RUNTIMES", "Runtime", "runner_summary"]


@dataclass(frozen=True)
class Runtime:
    language: str
    #: Persistent interpreter state across calls (Python) or files only (subprocesses).
    stateful: bool
    summary: str


RUNTIMES: dict[str, Runtime] = {
    "python": Runtime(
        "python",
        stateful=True,
        summary="Python 3 in a persistent IPython interpreter: variables and imports survive "
        "between calls; the last expression's value is returned; matplotlib figures come "
        "back as images",
    ),
}


def runner_summary(runner: RunnerImage) -> str:
    command = " ".join(runner.command).replace("{file}", "<file>")
    return (
        f"{runner.language} from the image {runner.image}: each call runs `{command}` on "
        "the code saved as a file; no variables survive between calls, files in /mnt/data "
        "do and are shared with the session's other languages"
    )
