"""cli.py: what a person starting the server reads — ``serve --help``, the warning for a
mistyped variable, and the flags' spellings (the server itself: tests/e2e/test_cli.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mcp_code_sandbox.cli import _settings, build_parser
from mcp_code_sandbox.cli_help import GROUPS
from mcp_code_sandbox.settings import Settings, unknown_variables

README = Path(__file__).resolve().parents[2] / "README.md"


def serve_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    return capsys.readouterr().out


def test_every_setting_is_one_flag_in_one_group() -> None:
    names = [name for _, entries in GROUPS for name, _, _ in entries]
    assert sorted(names) == sorted(Settings.model_fields)
    assert len(names) == len(set(names))


def test_help_gives_each_flag_its_meaning_and_default_in_groups(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = " ".join(serve_help(capsys).split())
    positions = [text.index(f"{title} (also SANDBOX_<NAME> variables)") for title, _ in GROUPS]
    assert positions == sorted(positions)
    for name in Settings.model_fields:
        flag = "--" + name.replace("_", "-")
        assert re.search(rf"{flag}\b[^()]*?[a-z].*?\(default: [^)]+\)", text), flag
    assert "memory per sandbox (default: 512m)" in text
    assert "(default: 100k)" in text and "(default: false)" in text
    assert "--host " not in text and "--port " not in text  # one flag per setting


def test_the_readme_groups_the_same_settings_the_same_way() -> None:
    section = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    groups: list[tuple[str, list[str]]] = []
    for line in section.splitlines():
        if title := re.match(r"\| \*\*(.+?)\*\* \|", line):
            groups.append((title.group(1), []))
        elif (var := re.match(r"\| `SANDBOX_([A-Z_]+)`", line)) and groups:
            groups[-1][1].append(var.group(1).lower())
    assert groups == [(title, [name for name, _, _ in entries]) for title, entries in GROUPS]


def test_old_host_and_port_spellings_still_work() -> None:
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "9000"])
    settings = _settings(args)
    assert (settings.http_host, settings.http_port) == ("0.0.0.0", 9000)
    new = _settings(build_parser().parse_args(["serve", "--http-port", "9001"]))
    assert new.http_port == 9001


def test_a_mistyped_variable_is_warned_with_the_closest_name() -> None:
    lines = unknown_variables(
        {"SANDBOX_MEMORY_LIMT": "1g", "SANDBOX_MEMORY_LIMIT": "1g", "HOME": "/root"}
    )
    assert lines == [
        "unknown setting SANDBOX_MEMORY_LIMT is ignored; did you mean SANDBOX_MEMORY_LIMIT?"
    ]
    assert unknown_variables({"SANDBOX_ZZZ": "1"}) == ["unknown setting SANDBOX_ZZZ is ignored"]
    assert unknown_variables({"SANDBOX_REQUIRE_DOCKER": "1"}) == []  # the test suite's own
    assert unknown_variables({"SANDBOX_K8S_E2E": "1"}) == []


def test_setup_writes_the_apparmor_profile_unless_told_not_to() -> None:
    assert build_parser().parse_args(["setup"]).apparmor is True
    assert build_parser().parse_args(["setup", "--no-apparmor"]).apparmor is False
