"""The derived image of ``SANDBOX_RUNTIME_PACKAGES`` on Docker, without an engine: its
tag, which image the backend uses, and its Dockerfile. Built for real in
tests/integration/test_docker_derived.py."""

from __future__ import annotations

from pathlib import Path

from mcp_code_sandbox.backends.docker.derived import dockerfile, packages_tag, sandbox_image
from mcp_code_sandbox.settings import load_settings


def test_the_tag_names_the_image_and_a_hash_of_the_list_as_pip_reads_it() -> None:
    tag = packages_tag("mcp-code-sandbox:latest", ["tabulate", "Python_Dateutil"])
    assert tag.startswith("mcp-code-sandbox:latest-packages-")
    # Order, case and -_. runs do not make another image; another list does.
    assert tag == packages_tag("mcp-code-sandbox:latest", ["python-dateutil", "tabulate"])
    assert tag != packages_tag("mcp-code-sandbox:latest", ["tabulate"])
    assert packages_tag("mcp-code-sandbox", ["six"]).startswith("mcp-code-sandbox:latest-")
    registry = packages_tag("registry.local:5000/team/sandbox:v2", ["six"])
    assert registry.startswith("registry.local:5000/team/sandbox:v2-packages-")
    by_digest = packages_tag("sandbox@sha256:" + "a" * 64, ["six"])
    assert by_digest.startswith("sandbox:digest-packages-")
    assert len(packages_tag("x:" + "t" * 128, ["six"]).split(":", 1)[1]) == 128


def test_the_backend_uses_the_derived_image_only_when_packages_are_named(tmp_path: Path) -> None:
    plain = load_settings({"state_dir": str(tmp_path), "image": "sbx:1"}, environ={})
    assert sandbox_image(plain) == "sbx:1"
    extra = load_settings(
        {"state_dir": str(tmp_path), "image": "sbx:1"}, {"SANDBOX_RUNTIME_PACKAGES": "tabulate"}
    )
    assert sandbox_image(extra) == packages_tag("sbx:1", ["tabulate"])


def test_the_dockerfile_installs_the_list_into_the_venv_and_gives_the_user_back() -> None:
    text = dockerfile("sbx:1", ["Tabulate", "six"])
    assert text.startswith("FROM sbx:1\nUSER 0:0\n")
    assert "/opt/sandbox/venv/bin/python -m pip install" in text and " six tabulate;" in text
    assert text.rstrip().endswith("USER 1000:1000")
