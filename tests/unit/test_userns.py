"""backends/bwrap/userns.py: the fix said for each kind of host that refuses bwrap's
user namespaces (the real refusal is tested end to end in tests/e2e/test_userns.py)."""

from __future__ import annotations

from pathlib import Path

from mcp_code_sandbox.backends.bwrap.userns import HostFacts, userns_fix, userns_message


def test_ubuntu_apparmor_gets_setup_and_the_sysctl() -> None:
    fix = userns_fix(HostFacts("1", "15000", None))
    assert "`sudo mcp-code-sandbox setup`" in fix
    assert "AppArmor profile that lets bwrap create user namespaces" in fix
    assert "/usr/bin" not in fix  # a client reads it: no host path
    assert "`sudo sysctl kernel.apparmor_restrict_unprivileged_userns=0`" in fix


def test_a_kernel_without_user_namespaces_gets_its_sysctl() -> None:
    fix = userns_fix(HostFacts(None, "0", None))
    assert "`sudo sysctl user.max_user_namespaces=15000`" in fix


def test_old_debian_gets_its_sysctl() -> None:
    fix = userns_fix(HostFacts(None, "15000", "0"))
    assert "`sudo sysctl kernel.unprivileged_userns_clone=1`" in fix


def test_otherwise_a_container_is_suspected_and_docker_offered() -> None:
    fix = userns_fix(HostFacts(None, "15000", None))
    assert "container" in fix and "SANDBOX_BACKEND=docker" in fix


def test_facts_are_read_from_sysctl_files(tmp_path: Path) -> None:
    (tmp_path / "kernel").mkdir()
    (tmp_path / "user").mkdir()
    (tmp_path / "kernel" / "apparmor_restrict_unprivileged_userns").write_text("1\n")
    (tmp_path / "user" / "max_user_namespaces").write_text("63000\n")
    assert HostFacts.read(tmp_path) == HostFacts("1", "63000", None)


def test_message_names_the_problem_then_the_fix() -> None:
    message = userns_message("setting up uid map: Permission denied", "X. Fix: y")
    assert message.startswith("this host does not let bubblewrap create user namespaces")
    assert "(bwrap: setting up uid map: Permission denied)" in message
    assert message.endswith("Because X. Fix: y; then restart the server")


def test_readme_troubleshooting_says_the_servers_words() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = " ".join(readme.split("## Troubleshooting", 1)[1].split("## ", 1)[0].split())
    said = userns_message("x", "y")
    assert said.split(" (bwrap:")[0] in section
    for facts in (HostFacts("1", "1", None), HostFacts(None, "0", None), HostFacts(None, "1", "0")):
        for command in userns_fix(facts).split("`")[1::2]:
            assert f"`{command}`" in section, command
