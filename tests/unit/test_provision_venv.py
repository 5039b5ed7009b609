"""``provision.venv`` (the bwrap runtime): manifest logic and the choice of base interpreter
(no network, no pip)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_code_sandbox.backends.bwrap import runtime as bwrap_runtime
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.provision import venv as provision_venv
from mcp_code_sandbox.settings import ConfigError, Settings, load_settings

BASE = bwrap_runtime.BaseInterpreter(Path(sys.executable), Path(sys.base_prefix), "3.11.2")


def settings(tmp_path: Path) -> Settings:
    return load_settings({"state_dir": str(tmp_path)}, environ={})


def manifest(**kw: object) -> dict[str, object]:
    data: dict[str, object] = {
        "format": bwrap_runtime.MANIFEST_FORMAT,
        "packages": list(bwrap_runtime.PACKAGES),
        "base_executable": str(BASE.executable),
        "base_prefix": "/usr",
        "base_version": BASE.version,
        "venv_python_version": "3.11.2",
        "installed": {"numpy": "2.0"},
    }
    data.update(kw)
    return data


def install(tmp_path: Path, data: dict[str, object]) -> Settings:
    s = settings(tmp_path)
    (s.runtime_dir / "venv" / "bin").mkdir(parents=True)
    (s.runtime_dir / "venv" / "bin" / "python").symlink_to(sys.executable)
    (s.runtime_dir / "manifest.json").write_text(json.dumps(data))
    return s


def test_mismatch_reasons() -> None:
    assert bwrap_runtime.manifest_mismatch(None, None) == "not built yet"
    assert bwrap_runtime.manifest_mismatch(manifest(), BASE) is None
    assert "package list" in str(
        bwrap_runtime.manifest_mismatch(manifest(packages=["numpy"]), BASE)
    )
    assert "another version" in str(bwrap_runtime.manifest_mismatch(manifest(format=0), BASE))
    other = bwrap_runtime.BaseInterpreter(Path(sys.executable), Path("/usr"), "3.12.0")
    assert "base interpreter is now" in str(bwrap_runtime.manifest_mismatch(manifest(), other))
    gone = manifest(base_executable="/nonexistent/python3")
    assert "gone" in str(bwrap_runtime.manifest_mismatch(gone, None))


def test_status_missing(tmp_path: Path) -> None:
    status = bwrap_runtime.runtime_status(settings(tmp_path))
    assert not status.ok and not status.exists
    assert "mcp-code-sandbox setup" in status.detail


def test_status_ok_and_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Fast because it starts no process (the server calls it on its event loop's
    # behalf at every start): checked without a clock, which a busy machine would fail.
    s = install(tmp_path, manifest())

    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError("runtime_status started a process")

    monkeypatch.setattr(subprocess.Popen, "__init__", no_process)
    status = bwrap_runtime.runtime_status(s)
    assert status.ok and status.packages == {"numpy": "2.0"} and status.base_prefix is None
    assert status.venv == s.runtime_dir / "venv"


def test_status_reports_a_base_prefix_outside_usr(tmp_path: Path) -> None:
    status = bwrap_runtime.runtime_status(install(tmp_path, manifest(base_prefix="/opt/py311")))
    assert status.base_prefix == Path("/opt/py311")


def test_build_returns_at_once_when_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = install(tmp_path, manifest())
    monkeypatch.setattr(provision_venv, "choose_base_interpreter", lambda: BASE)

    def no_build(*args: object) -> None:
        raise AssertionError("must not rebuild")

    monkeypatch.setattr(provision_venv, "_make_venv", no_build)
    lines: list[str] = []
    assert provision_venv.build_runtime(s, progress=lines.append).ok
    assert "up to date" in lines[0]


def test_choose_prefers_first_usable(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.touch()
    b.touch()
    seen: list[Path] = []

    def probe(p: Path) -> bwrap_runtime.BaseInterpreter | None:
        seen.append(p)
        return None if p == a else bwrap_runtime.BaseInterpreter(p, tmp_path, "3.11.9")

    assert (
        provision_venv.choose_base_interpreter([tmp_path / "missing", a, b], probe).executable == b
    )
    assert seen == [a, b]
    with pytest.raises(BackendUnavailable, match="apt-get install python3"):
        provision_venv.choose_base_interpreter([a], probe)


def test_real_probe_of_this_interpreter() -> None:
    base = provision_venv._probe(Path(sys.executable))
    assert base is not None and base.version.startswith("3.")


def test_the_package_list_is_a_setting_whose_default_is_the_designs(tmp_path: Path) -> None:
    assert (
        bwrap_runtime.runtime_packages(settings(tmp_path)) == bwrap_runtime.PACKAGES
    )  # unset: the standard list
    small = load_settings({"state_dir": str(tmp_path)}, {"SANDBOX_RUNTIME_PACKAGES": "ipython"})
    assert bwrap_runtime.runtime_packages(small) == ("ipython",)
    # A runtime of the standard list is stale for a server asking for another, and back.
    install(tmp_path, manifest())
    assert bwrap_runtime.runtime_status(settings(tmp_path)).ok
    assert "package list" in bwrap_runtime.runtime_status(small).detail
    (small.runtime_dir / "manifest.json").write_text(json.dumps(manifest(packages=["ipython"])))
    assert (
        bwrap_runtime.runtime_status(small).ok
        and not bwrap_runtime.runtime_status(settings(tmp_path)).ok
    )


def test_the_package_list_takes_names_only() -> None:
    with pytest.raises(ConfigError, match=r"SANDBOX_RUNTIME_PACKAGES.*names only"):
        load_settings(environ={"SANDBOX_RUNTIME_PACKAGES": "pandas==2.2"})
