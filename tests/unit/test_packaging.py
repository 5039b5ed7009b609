"""What a release publishes: the package metadata (pyproject.toml), the MCP Registry's
``server.json``, and the command line MCP clients are given (``uvx mcp-code-sandbox``).
The wheel itself, built and installed: tests/e2e/test_wheel.py."""

from __future__ import annotations

import json
import tomllib
from typing import Any

import pytest

import mcp_code_sandbox
from mcp_code_sandbox.cli import build_parser, default_command
from mcp_code_sandbox.settings import Settings, load_settings

from ..conftest import REPO


def server_json() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((REPO / "server.json").read_text(encoding="utf-8"))
    return data


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_the_version_is_written_in_one_place() -> None:
    project = pyproject()
    assert "version" not in project and project["dynamic"] == ["version"]
    tool = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]
    assert tool["hatch"]["version"]["path"] == "src/mcp_code_sandbox/__init__.py"
    entry = server_json()
    assert entry["version"] == mcp_code_sandbox.__version__
    assert entry["packages"][0]["version"] == mcp_code_sandbox.__version__


def test_the_metadata_is_publish_ready() -> None:
    project = pyproject()
    assert project["readme"] == "README.md" and (REPO / "README.md").is_file()
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert "MIT License" in (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Programming Language :: Python :: 3.11" in project["classifiers"]
    # PEP 639: a license expression and a License classifier exclude each other.
    assert not any(c.startswith("License ::") for c in project["classifiers"])
    assert project["scripts"]["mcp-code-sandbox"] == "mcp_code_sandbox.cli:main"
    assert any(dep.startswith("pip") for dep in project["dependencies"])


def test_server_json_describes_the_pypi_package_run_by_uvx() -> None:
    entry = server_json()
    assert entry["$schema"].endswith("/server.schema.json")
    assert entry["name"].count("/") == 1 and len(entry["description"]) <= 100
    (package,) = entry["packages"]
    assert package["registryType"] == "pypi"
    assert package["identifier"] == pyproject()["name"] == "mcp-code-sandbox"
    assert package["runtimeHint"] == "uvx" and package["transport"] == {"type": "stdio"}


def test_server_json_settings_are_real_settings_with_their_defaults() -> None:
    variables = server_json()["packages"][0]["environmentVariables"]
    assert len(variables) >= 8
    defaults = load_settings(environ={})
    for variable in variables:
        name = variable["name"]
        field = name.removeprefix("SANDBOX_").lower()
        assert name.startswith("SANDBOX_") and field in Settings.model_fields, name
        assert variable["description"].strip(), name
        if "default" in variable:  # the default said is the default the server has
            given = load_settings(environ={name: variable["default"]})
            assert getattr(given, field) == getattr(defaults, field), name
        for choice in variable.get("choices", []):  # every choice is accepted
            load_settings(environ={name: choice})


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ["serve"]),
        (["--memory-limit", "1g"], ["serve", "--memory-limit", "1g"]),
        (["serve", "--transport", "http"], ["serve", "--transport", "http"]),
        (["setup"], ["setup"]),
        (["--version"], ["--version"]),
        (["--help"], ["--help"]),
    ],
)
def test_no_command_means_serve(argv: list[str], expected: list[str]) -> None:
    assert default_command(argv) == expected
    if expected[0] == "serve":
        assert build_parser().parse_args(default_command(argv)).command == "serve"


def test_run_code_names_the_packages_this_server_preinstalls(tmp_path: Any) -> None:
    from mcp_code_sandbox.server.app import descriptions

    standard = descriptions(load_settings({"state_dir": str(tmp_path)}, environ={}))
    assert (
        "Preinstalled: pandas, numpy, matplotlib, seaborn, scipy, openpyxl" in standard["run_code"]
    )
    small = load_settings(
        {"state_dir": str(tmp_path)}, {"SANDBOX_RUNTIME_PACKAGES": "ipython,tabulate"}
    )
    assert "Preinstalled: ipython, tabulate." in descriptions(small)["run_code"]
