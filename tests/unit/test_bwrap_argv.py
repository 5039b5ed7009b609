"""build_bwrap_argv / build_launcher_argv: the sandbox's shape, checked without bwrap."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcp_code_sandbox.backends.base import Egress, Limits, SandboxSpec
from mcp_code_sandbox.backends.bwrap.argv import (
    HostLayout,
    Mounts,
    build_bwrap_argv,
    build_launcher_argv,
    drop_uid_argv,
    env_args,
    minimal_argv,
)

LIMITS = Limits(memory_bytes=512 << 20, cpu=1.0, pids=128, tmp_bytes=64 << 20, file_bytes=1 << 30)
LAYOUT = HostLayout(
    links=(("/bin", "usr/bin"), ("/lib", "usr/lib")),
    dirs=("/lib64",),
    etc=("/etc/ssl", "/etc/ld.so.cache"),
)
MOUNTS = Mounts(
    "/srv/ws/k1", "/srv/runtime/venv", "/src/agent", None, seccomp_fd=11, passwd_fd=12, group_fd=13
)


def spec(**kw: object) -> SandboxSpec:
    values: dict[str, object] = {
        "key": "k1",
        "owner": "local",
        "session_id": "s1",
        "workspace": Path("/srv/ws/k1"),
        "limits": LIMITS,
        "env": {"FOO": "bar"},
    }
    values.update(kw)
    return SandboxSpec(**values)  # type: ignore[arg-type]


def argv(**kw: object) -> list[str]:
    return build_bwrap_argv(
        "/usr/bin/bwrap", spec(**kw), MOUNTS, LAYOUT, rlimit_memory=False, env_fd=14
    )


def pairs(args: list[str], flag: str) -> list[tuple[str, str]]:
    return [(args[i + 1], args[i + 2]) for i, a in enumerate(args) if a == flag]


def test_isolation_flags() -> None:
    args = argv()
    for flag in (
        "--unshare-user",
        "--unshare-pid",
        "--as-pid-1",  # the agent, not bwrap's dumpable init, is pid 1
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ):
        assert flag in args
    assert args[args.index("--cap-drop") + 1] == "ALL"
    assert args[args.index("--seccomp") + 1] == "11"
    assert args[args.index("--uid") + 1] == "1000"
    assert args[args.index("--gid") + 1] == "1000"


def test_every_sandbox_has_its_own_empty_net_namespace() -> None:
    """With network or without, the namespace is empty: network is the egress proxy's
    directory bound read-only, never an interface (no slirp, no resolv.conf)."""
    import dataclasses

    networked = spec(egress=Egress(Path("/state/egress/k1-ab")))
    mounts = dataclasses.replace(MOUNTS, egress="/state/egress/k1-ab")
    args = build_bwrap_argv(
        "/usr/bin/bwrap", networked, mounts, LAYOUT, rlimit_memory=False, env_fd=14
    )
    assert "--unshare-net" in args and "--unshare-net" in argv()
    assert ("/state/egress/k1-ab", "/run/mcs-egress") in pairs(args, "--ro-bind")
    assert "/run/mcs-egress" not in argv()
    assert "/etc/resolv.conf" not in args and "--block-fd" not in args
    with pytest.raises(ValueError, match="egress"):
        argv(egress=Egress(Path("/state/egress/k1-ab")))  # a spec with network, no mount
    with pytest.raises(ValueError, match="egress"):
        build_bwrap_argv("/usr/bin/bwrap", spec(), mounts, LAYOUT, rlimit_memory=False, env_fd=14)


def test_binds() -> None:
    args = argv()
    assert ("/srv/ws/k1", "/mnt/data") in pairs(args, "--bind")
    assert pairs(args, "--bind") == [("/srv/ws/k1", "/mnt/data")]  # the only rw bind
    ro = pairs(args, "--ro-bind")
    assert ("/usr", "/usr") in ro and ("/lib64", "/lib64") in ro
    assert ("/srv/runtime/venv", "/opt/sandbox/venv") in ro
    assert ("/src/agent", "/opt/sandbox/lib/mcs_agent") in ro
    assert ("/etc/ssl", "/etc/ssl") in ro
    assert ("usr/bin", "/bin") in pairs(args, "--symlink")
    assert ("12", "/etc/passwd") in pairs(args, "--ro-bind-data")
    assert args[args.index("--remount-ro") + 1] == "/"
    sources = [src for flag in ("--bind", "--ro-bind") for src, _ in pairs(args, flag)]
    for hidden in ("/root", "/home", "/run", "/var", "/", "/etc"):
        assert hidden not in sources


def test_base_prefix_bound_at_its_own_path() -> None:
    mounts = Mounts("/w", "/v", "/a", ("/tmp/base", "/opt/py"), 11, 12, 13)
    args = build_bwrap_argv("bwrap", spec(), mounts, LAYOUT, rlimit_memory=False, env_fd=14)
    assert ("/tmp/base", "/opt/py") in pairs(args, "--ro-bind")


def test_tmp_is_sized() -> None:
    args = argv()
    i = args.index("--size")
    assert args[i + 1] == str(64 << 20) and args[i + 2 : i + 4] == ["--tmpfs", "/tmp"]


def test_env_comes_from_a_file_never_the_command_line() -> None:
    args = argv()
    assert "bar" not in args and "--setenv" not in args  # `ps` shows command lines
    i = args.index("--args")
    assert args[i + 1] == "14" and args.index("--clearenv") < i < args.index("--")
    words = env_args(spec()).split(b"\0")
    assert words[-1] == b""  # NUL-terminated
    env = [w.decode() for w in words[:-1]]
    assert ("FOO", "bar") in pairs(env, "--setenv")
    assert ("HOME", "/tmp") in pairs(env, "--setenv")


def test_agent() -> None:
    args = argv()
    tail = args[args.index("--") + 1 :]
    assert tail[0] == "/opt/sandbox/venv/bin/python" and "mcs_agent" in tail
    rl = build_bwrap_argv("bwrap", spec(), MOUNTS, LAYOUT, rlimit_memory=True, env_fd=14)
    assert '"memory_bytes":536870912' in rl[-1]
    assert '"memory_bytes":null' in args[-1]


def test_launcher_as_root_stages_and_drops_uid() -> None:
    uid = 0x7000_0005  # the session's own host uid
    args = build_launcher_argv(11, ["/cg/a/cgroup.procs"], [("/srv/ws", "ws")], uid)
    assert args[:4] == ["/usr/bin/unshare", "--mount", "--propagation", "private"]
    assert args[args.index("mcs-launch") + 1 :][:6] == [
        "11",
        "1",
        "/cg/a/cgroup.procs",
        "1",
        "/srv/ws",
        "ws",
    ]
    assert args[-5:] == [
        "/usr/bin/setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--",
    ]


@pytest.mark.parametrize("procs", [[], ["/cg/a", "/cg/b"]])
def test_launcher_unprivileged(procs: list[str]) -> None:
    args = build_launcher_argv(11, procs, None, None)
    assert args[0] == "/bin/bash" and "setpriv" not in " ".join(args)
    assert args[-1] == "0"  # no staging


def test_host_layout_probe(tmp_path: Path) -> None:
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "bin").symlink_to("usr/bin")
    (tmp_path / "lib64").mkdir()
    (tmp_path / "etc" / "ssl").mkdir(parents=True)
    layout = HostLayout.probe(tmp_path)
    assert layout.links == (("/bin", "usr/bin"),)
    assert layout.dirs == ("/lib64",)
    assert layout.etc == ("/etc/ssl",)


def test_minimal_argv_is_the_probe_doctor_and_bench_run() -> None:
    argv = minimal_argv("bwrap", ["--unshare-user"], ["/usr/bin/true"])
    assert argv == [
        "bwrap",
        "--unshare-user",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/bin", "/bin",
        "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64",
        "--proc", "/proc",
        "--dev", "/dev",
        "/usr/bin/true",
    ]  # fmt: skip
    assert drop_uid_argv(70000) == [
        "/usr/bin/setpriv", "--reuid=70000", "--regid=70000", "--clear-groups", "--",
    ]  # fmt: skip
    launcher = build_launcher_argv(11, [], None, 70000)
    assert launcher[-len(drop_uid_argv(70000)) :] == drop_uid_argv(70000)


@pytest.mark.parametrize("name", ["a b", "x/y", "ws\n/tmp/etc none bind", ""])
def test_a_stage_name_that_is_not_a_plain_word_is_refused(name: str) -> None:
    # The launcher writes one line per stage into the table `mount -a` reads.
    with pytest.raises(ValueError, match="not a stage name"):
        build_launcher_argv(11, [], [("/srv/ws", name)], None)
