"""The languages ``run_code`` offers, how each one runs, and the one place that decides
which are available (:class:`Languages`).

Python runs in the session's persistent interpreter; every other language here runs per
call as a subprocess of the agent in the same sandbox and workspace
(:mod:`.agent.languages`).
The docker backend adds the languages of runner images (:mod:`backends.docker.runners`):
one process per call in another container that shares the session's workspace.
A backend may offer fewer (its runtime env or image lacks the interpreter): the agent's
``ready`` message lists what it really found.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mcp_code_sandbox.backends.runner_images import RunnerImage
from mcp_code_sandbox.errors import UnsupportedLanguage
from mcp_code_sandbox.run.probe import RuntimeProbe, clean_languages

__all__ = ["RUNTIMES", "Languages", "Runtime", "runner_summary"]


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


class Languages:
    """Which languages ``run_code`` offers: the one place that decides it.

    Semantics: the agent's languages (:data:`RUNTIMES`) in their order, then the runner
    images' (docker). Python is always offered. Another built-in language is offered
    unless something says the sandboxes lack it: the backend's ``describe().runtimes``
    (``"available": false``), or the server's own probe sandbox (not listed). A backend
    that says nothing about a language is not taken to lack it. A session's sandbox that
    lacks a language (:meth:`check_sandbox`) makes the service ask its probe again.

    The service owns one, refreshes its inputs (:attr:`info`, :meth:`set_runners`,
    ``probe``) and asks it; the MCP layer gets the list through the service.
    """

    def __init__(self, probe: RuntimeProbe) -> None:
        #: The server's own look into a sandbox (never a tenant's: see :mod:`.probe`).
        self.probe = probe
        #: What ``backend.describe().runtimes`` said at the latest refresh.
        self.info: dict[str, dict[str, Any]] = {}
        #: Runner images by language (docker), as last discovered; never a built-in one.
        self.runners: dict[str, RunnerImage] = {}

    def offered(self) -> list[str]:
        """What ``run_code`` offers now, in order (its ``language`` enum)."""
        builtin = [lang for lang in RUNTIMES if lang == "python" or not self._lacking(lang)]
        return [*builtin, *self.runners]

    def _lacking(self, language: str) -> bool:
        reported = self.info.get(language, {}).get("available", True) is False
        seen = self.probe.languages
        return reported or (seen is not None and language not in seen)

    def set_runners(self, found: Mapping[str, RunnerImage]) -> None:
        """Take the runner images a backend found; a built-in language's name is kept
        for the agent (an image cannot replace it)."""
        self.runners = {lang: r for lang, r in found.items() if lang not in RUNTIMES}

    def runner(self, language: str) -> RunnerImage | None:
        """The runner image of an offered ``language``; ``None``: the agent runs it."""
        return None if language in RUNTIMES else self.runners[language]

    def check(self, language: str) -> None:
        """Raise ``UnsupportedLanguage`` unless ``language`` is offered."""
        offered = self.offered()
        if language not in offered:
            raise UnsupportedLanguage(
                f"language {language!r} is not offered here; available: "
                + ", ".join(sorted(offered))
            )

    def check_sandbox(self, ready: Mapping[str, Any] | None, language: str) -> None:
        """Raise ``UnsupportedLanguage`` when a session's sandbox, by its agent's ``ready``
        message, has no interpreter for built-in ``language``. Nothing is raised when
        the message lists no languages (a backend that does not keep it)."""
        listed = clean_languages(ready, RUNTIMES)
        if language in RUNTIMES and listed is not None and language not in listed:
            raise UnsupportedLanguage(
                f"this sandbox has no interpreter for {language!r} (its runtime environment "
                "lacks it: the operator runs `mcp-code-sandbox setup` for bwrap, or "
                "`mcp-code-sandbox image build` for docker); available: "
                + ", ".join(sorted(listed))
            )
