"""What a release publishes: the package metadata (pyproject.toml), the MCP Registry's
``server.json``, and the command line MCP clients are given (``uvx mcp-code-sandbox``).
The wheel itself, built and installed: tests/e2e/test_wheel.py."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
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
    package, _ = entry["packages"]
    assert package["registryType"] == "pypi"
    assert package["identifier"] == pyproject()["name"] == "mcp-code-sandbox"
    assert package["runtimeHint"] == "uvx" and package["transport"] == {"type": "stdio"}


def test_server_json_describes_the_appliance_run_by_docker() -> None:
    """The OCI package is the README's macOS line: ``docker run -i --rm``, the engine's
    socket, the named volume, the server image at this version, over stdio."""
    _, package = server_json()["packages"]
    assert package["registryType"] == "oci" and package["runtimeHint"] == "docker"
    assert package["transport"] == {"type": "stdio"}
    image, _, tag = package["identifier"].rpartition(":")
    assert tag == mcp_code_sandbox.__version__
    assert image.endswith("/mcp-code-sandbox-server")
    mounts = [(a["type"], a["name"], a["value"]) for a in package["runtimeArguments"]]
    assert mounts == [
        ("named", "-v", "/var/run/docker.sock:/var/run/docker.sock"),
        ("named", "-v", "mcp-code-sandbox:/var/lib/mcp-code-sandbox"),
    ]
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    line = " ".join(["docker run -i --rm", *(f"-v {m[2]}" for m in mounts)])
    assert f"{line} mcp-code-sandbox-server:latest" in readme
    # Settings of the bubblewrap backend and of paths inside the image are not offered.
    names = {v["name"] for v in package["environmentVariables"]}
    assert not names & {"SANDBOX_BACKEND", "SANDBOX_STATE_DIR", "SANDBOX_RUNTIME_PACKAGES"}


def test_server_json_keeps_the_registry_schemas_package_rules() -> None:
    """The registry's schema (2025-12-11) for packages, checked here offline: each has a
    registryType and a transport; npm/pypi/nuget an identifier and a specific version;
    oci an image reference with a tag; arguments are named or positional with a value.
    ``MCS_SERVER_SCHEMA``, the path of the published schema file, adds the full check."""
    import os

    entry = server_json()
    assert set(entry) <= {"$schema", "name", "title", "description", "version", "packages",
                          "remotes", "repository", "websiteUrl", "icons", "_meta"}  # fmt: skip
    for package in entry["packages"]:
        assert package["transport"]["type"] in ("stdio", "streamable-http", "sse"), package
        kind = package["registryType"]
        if kind in ("npm", "pypi", "nuget"):
            assert package["identifier"] and package["version"] not in ("", "latest")
        else:
            assert kind == "oci" and ":" in package["identifier"].rsplit("/", 1)[-1]
        for argument in package.get("runtimeArguments", []) + package.get("packageArguments", []):
            assert argument["type"] in ("named", "positional") and "value" in argument
        for variable in package.get("environmentVariables", []):
            assert variable["name"] and variable.get("format", "string") in (
                "string", "number", "boolean", "filepath"
            )  # fmt: skip
    schema_path = os.environ.get("MCS_SERVER_SCHEMA")
    if schema_path:
        import jsonschema

        schema = json.loads(Path(schema_path).read_text(encoding="utf-8"))
        assert schema.get("$id") == entry["$schema"]
        jsonschema.validate(entry, schema)


def test_server_json_settings_are_real_settings_with_their_defaults() -> None:
    variables = server_json()["packages"][0]["environmentVariables"]
    variables += server_json()["packages"][1]["environmentVariables"]
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
