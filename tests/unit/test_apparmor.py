"""provision/apparmor.py: what ``setup`` does on a host whose AppArmor forbids
unprivileged user namespaces (Ubuntu >= 23.10)."""

from __future__ import annotations

from pathlib import Path

from mcp_code_sandbox.backends.bwrap.userns import HostFacts
from mcp_code_sandbox.provision.apparmor import PROFILE_NAME, allow_bwrap_userns

RESTRICTED = HostFacts("1", "15000", None)


def fake_parser(tmp_path: Path) -> str:
    script = tmp_path / "apparmor_parser"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/loaded\n')
    script.chmod(0o755)
    return str(script)


def test_root_writes_and_loads_a_profile_for_bwrap(tmp_path: Path) -> None:
    said: list[str] = []
    path = allow_bwrap_userns(
        said.append, facts=RESTRICTED, bwrap="/usr/bin/bwrap", directory=tmp_path,
        parser=fake_parser(tmp_path), root=True,
    )  # fmt: skip
    assert path == tmp_path / PROFILE_NAME
    text = path.read_text()
    assert f"profile {PROFILE_NAME} /usr/bin/bwrap flags=(unconfined) {{" in text
    assert "  userns,\n" in text
    assert (tmp_path / "loaded").read_text().split() == ["-r", str(path)]
    assert "may create user namespaces" in said[-1]


def test_not_root_says_the_command_and_writes_nothing(tmp_path: Path) -> None:
    said: list[str] = []
    path = allow_bwrap_userns(
        said.append, facts=RESTRICTED, bwrap="/usr/bin/bwrap", directory=tmp_path, root=False
    )
    assert path is None and not (tmp_path / PROFILE_NAME).exists()
    assert "`sudo mcp-code-sandbox setup`" in said[0]


def test_an_unrestricted_host_is_left_alone(tmp_path: Path) -> None:
    said: list[str] = []
    facts = HostFacts("0", "15000", None)
    assert allow_bwrap_userns(said.append, facts=facts, bwrap="/usr/bin/bwrap",
                              directory=tmp_path, root=True) is None  # fmt: skip
    assert said == [] and not list(tmp_path.iterdir())
