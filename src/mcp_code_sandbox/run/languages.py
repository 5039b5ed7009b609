"""The languages ``run_code`` offers, and how each one runs.

Python runs in the session's persistent interpreter; every other language here runs per
call as a subprocess of the agent in the same sandbox and workspace
(:mod:`.agent.languages`).
The docker backend adds the languages of runner images (:mod:`.backends.docker_runner`):
one process per call in another container that shares the session's workspace.
A backend may offer fewer (its runtime env or image lacks the interpreter): the agent's
``ready`` message lists what it really found.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcp_code_sandbox.backends.runner_images import RunnerImage

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
    "javascript": Runtime(
        "javascript",
        stateful=False,
        summary="JavaScript on Node.js, run as an ES module (import, top-level await; "
        "require works too); pg, postgres, csv-parser and papaparse import by bare name. "
        "Each call is a new process: no variables survive between calls, files in "
        "/mnt/data do and are shared with the session's other languages",
    ),
    "typescript": Runtime(
        "typescript",
        stateful=False,
        summary="TypeScript run from source by bun (import, require, top-level await); "
        "pg, postgres, csv-parser and papaparse import by bare name. Each call is a new "
        "process: no variables survive between calls, files in /mnt/data do and are "
        "shared with the session's other languages",
    ),
    "bash": Runtime(
        "bash",
        stateful=False,
        summary="A bash script with the sandbox's command-line tools (python, node and "
        "bun among them). Each call is a new process: no variables or cd survive "
        "between calls, files in /mnt/data do and are shared with the session's other "
        "languages",
    ),
}


def runner_summary(runner: RunnerImage) -> str:
    command = " ".join(runner.command).replace("{file}", "<file>")
    return (
        f"{runner.language} from the image {runner.image}: each call runs `{command}` on "
        "the code saved as a file; no variables survive between calls, files in /mnt/data "
        "do and are shared with the session's other languages"
    )
