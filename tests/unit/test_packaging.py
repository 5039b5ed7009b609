"""What a release publishes: the package metadata (pyproject.toml), the MCP Registry's
``server.json``, and the command line MCP clients are given (``uvx mcp-code-sandbox``).
The wheel itself, built and installed: tests/e2e/test_wheel.py."""

from __future__ import annotations

import importlib.metadata
import json
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
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


SCHEMAS = "https://static.modelcontextprotocol.io/schemas/"


def registry_schemas() -> dict[str, Path]:
    """The MCP Registry's released ``server.json`` schemas by date, offline: the dev extra's
    skillsaw ships each one byte for byte from the registry's static site. Only the files
    are read (none of its code runs), so a schema bump is a pin bump in pyproject.toml."""
    try:
        files = importlib.metadata.files("skillsaw") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("skillsaw (the dev extra) ships the registry's schema: pip install -e .[dev]")
    return {
        file.parent.name.removeprefix("v").replace("_", "-"): Path(str(file.locate()))
        for file in files
        if file.name == "server.schema.json" and file.parent.parent.name == "mcp_registry"
    }


def property_names(schema: Any) -> Iterator[str]:
    if isinstance(schema, dict):
        if isinstance(schema.get("properties"), dict):
            yield from schema["properties"]
        for value in schema.values():
            yield from property_names(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from property_names(value)


def field_names(value: Any, path: str = "$") -> Iterator[tuple[str, str]]:
    """Each key of ``value`` with where it is, but those a publisher names: the keys of
    ``_meta`` (reverse-DNS namespaces) and of an argument's ``variables``."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield path, key
            if key == "variables":
                for name, variable in item.items():
                    yield from field_names(variable, f"{path}.variables.{name}")
            elif key != "_meta":
                yield from field_names(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from field_names(item, f"{path}[{index}]")


def registry_problems(entry: dict[str, Any]) -> list[str]:
    """What the registry would refuse in ``entry``: anything its schema (the version
    ``$schema`` names) rejects; a field the schema does not name (it allows unknown fields,
    so a misspelt or snake_case one would pass it unnoticed); and the rule for OCI packages
    that only the registry's docs state: the version is the image's tag, never a field."""
    date = entry["$schema"].removeprefix(SCHEMAS).removesuffix("/server.schema.json")
    schemas = registry_schemas()
    if date not in schemas:
        return [f"$schema: {entry['$schema']!r} is no released schema ({sorted(schemas)})"]
    schema = json.loads(schemas[date].read_text(encoding="utf-8"))
    assert schema["$id"] == entry["$schema"]
    validator = jsonschema.validators.validator_for(schema)
    checker = validator(schema, format_checker=validator.FORMAT_CHECKER)
    problems = [f"{error.json_path}: {error.message}" for error in checker.iter_errors(entry)]
    known = set(property_names(schema))
    problems += [f"{at}: {key!r} is no field" for at, key in field_names(entry) if key not in known]
    for index, package in enumerate(entry.get("packages", [])):
        if package.get("registryType") == "oci":
            _, _, tag = package.get("identifier", "").rpartition("/")[2].partition(":")
            if "version" in package or tag in ("", "latest"):
                problems.append(f"$.packages[{index}]: an OCI version is the image's tag only")
    return problems


def test_server_json_validates_against_the_newest_registry_schema() -> None:
    entry = server_json()
    assert entry["$schema"] == f"{SCHEMAS}{max(registry_schemas())}/server.schema.json"
    assert registry_problems(entry) == []
    assert [package["registryType"] for package in entry["packages"]] == ["pypi", "oci"]


def pypi(entry: dict[str, Any]) -> dict[str, Any]:
    package: dict[str, Any] = entry["packages"][0]
    return package


def oci(entry: dict[str, Any]) -> dict[str, Any]:
    package: dict[str, Any] = entry["packages"][1]
    return package


@pytest.mark.parametrize(
    ("break_it", "said"),
    [
        pytest.param(lambda e: e.update(description="x" * 101), "$.description: ", id="long"),
        pytest.param(lambda e: e.update(name="mcp-code-sandbox"), "$.name: ", id="name"),
        pytest.param(lambda e: pypi(e).update(version="latest"), "[0].version: ", id="latest"),
        pytest.param(lambda e: pypi(e).pop("transport"), "'transport' is a required", id="stdio"),
        pytest.param(
            lambda e: pypi(e)["environmentVariables"][0].update(format="integer"),
            "$.packages[0].environmentVariables[0].format: ",
            id="format",
        ),
        pytest.param(
            lambda e: pypi(e).update(runtime_hint=pypi(e).pop("runtimeHint")),
            "'runtime_hint' is no field",
            id="snake_case",
        ),
        pytest.param(
            lambda e: oci(e)["runtimeArguments"][0].update(type="flag"),
            "$.packages[1].runtimeArguments[0]: ",
            id="argument",
        ),
        pytest.param(lambda e: oci(e).update(version="0.1.0"), "OCI version", id="oci_version"),
        pytest.param(
            lambda e: oci(e).update(identifier="ghcr.io/mcp-code-sandbox/mcp-code-sandbox-server"),
            "OCI version",
            id="untagged",
        ),
        pytest.param(
            lambda e: e.update({"$schema": f"{SCHEMAS}2025-01-01/server.schema.json"}),
            "is no released schema",
            id="unreleased",
        ),
    ],
)
def test_a_server_json_the_registry_would_refuse_fails_the_check(
    break_it: Callable[[dict[str, Any]], object], said: str
) -> None:
    """Broken copies of the real file, each failing for its own reason."""
    entry = server_json()
    break_it(entry)
    problems = registry_problems(entry)
    assert any(said in problem for problem in problems), problems


def test_both_packages_name_their_server_json_entry_as_the_registry_checks() -> None:
    # PyPI: an "mcp-name:" line in the README (the package's long description); OCI: the
    # image's io.modelcontextprotocol.server.name label.
    name = server_json()["name"]
    assert f"mcp-name: {name}" in (REPO / "README.md").read_text(encoding="utf-8")
    dockerfile = (REPO / "images" / "server.Dockerfile").read_text(encoding="utf-8")
    assert f'LABEL io.modelcontextprotocol.server.name="{name}"' in dockerfile


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
    docker = load_settings(
        {"state_dir": str(tmp_path), "backend": "docker"},
        {"SANDBOX_RUNTIME_PACKAGES": "ipython,tabulate"},
    )
    assert ", tabulate." in descriptions(docker)["run_code"]
    assert "Preinstalled: pandas, numpy" in descriptions(docker)["run_code"]
