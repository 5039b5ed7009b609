"""What an image's labels say: the one place they are parsed.

The sandbox image and runner images describe themselves with labels (``sandbox.runner``,
``sandbox.language``, ``sandbox.command``, ``sandbox.extension``, ``sandbox.version``,
``sandbox.packages``; see :mod:`.runners` for a runner's). Pure: read by the backend
(:meth:`DockerBackend.describe`, runner discovery) and by ``doctor``; the labels come
from the engine and are the image author's, so every value is checked here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from mcp_code_sandbox.backends.runner_images import RunnerImage

__all__ = [
    "LANGUAGE_NAME",
    "RUNNER_FILTER",
    "info_from_labels",
    "is_runner",
    "runner_from_labels",
]

#: What a label may name as a language (it becomes an enum value in the tool's schema).
LANGUAGE_NAME = re.compile(r"[a-z][a-z0-9_+-]{0,31}")
#: The engine-side filter for runner images.
RUNNER_FILTER = {"label": "sandbox.runner=true"}


def is_runner(labels: Mapping[str, str]) -> bool:
    """Is the image labelled ``sandbox.runner=true`` (the sandbox image is, too)?"""
    return str(labels.get("sandbox.runner", "")).lower() == "true"


def _packages(labels: Mapping[str, str]) -> dict[str, Any]:
    """``sandbox.packages``, a JSON object of name → version; ``{}`` when absent or bad."""
    try:
        packages = json.loads(labels.get("sandbox.packages") or "{}")
    except ValueError:
        return {}
    return packages if isinstance(packages, dict) else {}


def info_from_labels(labels: Mapping[str, str], image: str) -> dict[str, dict[str, Any]]:
    """``sandbox.language`` names the image's language; ``sandbox.packages`` (a JSON
    object of name → version) and ``sandbox.version``, when the image has them, fill in."""
    language = labels.get("sandbox.language") or "python"
    return {
        language: {
            "version": labels.get("sandbox.version"),
            "packages": _packages(labels),
            "image": image,
        }
    }


def runner_from_labels(
    labels: Mapping[str, str], image: str, image_id: str
) -> tuple[RunnerImage | None, str | None]:
    """The runner an image's labels describe, or ``(None, why not)``."""
    if not is_runner(labels):
        return None, "not labelled sandbox.runner=true"
    language = labels.get("sandbox.language") or ""
    if not LANGUAGE_NAME.fullmatch(language):
        return None, f"sandbox.language {language!r} is not a name like 'ruby' or 'r'"
    raw_command = labels.get("sandbox.command")
    command: Any = [language, "{file}"]
    if raw_command:
        try:
            command = json.loads(raw_command)
        except ValueError:
            command = None
    if (
        not isinstance(command, list)
        or not command
        or not all(isinstance(part, str) and part for part in command)
        or not any("{file}" in part for part in command)
    ):
        return None, "sandbox.command must be a JSON array of strings with a {file} in it"
    suffix = labels.get("sandbox.extension") or ""
    if suffix and not re.fullmatch(r"\.?[A-Za-z0-9_+-]{1,16}", suffix):
        return None, f"sandbox.extension {suffix!r} is not a file suffix like '.rb'"
    if suffix and not suffix.startswith("."):
        suffix = "." + suffix
    packages = _packages(labels)
    runner = RunnerImage(
        language=language,
        image=image,
        image_id=image_id,
        command=tuple(command),
        suffix=suffix,
        version=labels.get("sandbox.version") or None,
        packages={k: v for k, v in packages.items() if isinstance(v, str)},
    )
    return runner, None
