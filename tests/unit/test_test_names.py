"""Every unit test file is named after the module it tests, so a reader finds a module's
tests, and a module that moves or goes takes its test file's name with it.

``tests/unit/test_<name>.py`` is right when ``<name>``, less a ``_fake`` suffix, starts with
a module or package of ``src/mcp_code_sandbox`` (``spec``, ``docker_spec`` or
``backends_docker_spec`` for ``backends/docker/spec.py``), whole words, optionally followed
by the aspect it checks (``test_doctor_pausing``). The files checked are those present."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "mcp_code_sandbox"

# Tests of the project as a whole, not of one module.
ABOUT_THE_WHOLE = {
    "changelog",  # CHANGELOG.md's shape
    "commit_msg_hook",  # scripts/hooks/commit-msg
    "deploy_kubernetes",  # deploy/kubernetes/ renders and validates
    "grafana_dashboard",  # deploy/grafana-dashboard.json against the metrics
    "kube_api",  # tests/kube_api.py, the fake Kubernetes API other tests stand on
    "kubelet",  # tests/kubelet.py, the fake kubelet other tests stand on
    "layering",  # which layer may import which
    "packaging",  # the wheel and pyproject
    "readme",  # README.md against the code
    "self_contained",  # the agent's standard-library-only rule
    "source_prose",  # no measured figures in src/'s comments
    "test_names",  # this file
}


def module_names() -> set[str]:
    names: set[str] = set()
    for path in PACKAGE.rglob("*"):
        if "__pycache__" in path.parts:
            continue
        if path.is_dir() and (path / "__init__.py").exists():
            parts = path.relative_to(PACKAGE).parts
        elif path.suffix == ".py" and not path.name.startswith("__"):
            parts = path.relative_to(PACKAGE).with_suffix("").parts
        else:
            continue
        names.update("_".join(parts[i:]) for i in range(len(parts)))
    return names


def names_a_module(name: str, modules: set[str]) -> bool:
    name = name.removesuffix("_fake")
    words = name.split("_")
    return any("_".join(words[:i]) in modules for i in range(1, len(words) + 1))


def test_names_a_module_accepts_a_module_an_aspect_and_the_fake() -> None:
    modules = {"spec", "docker_spec", "backends_docker_spec", "manager"}
    assert names_a_module("docker_spec", modules)
    assert names_a_module("spec_kwargs", modules)
    assert names_a_module("manager_fake", modules)
    assert not names_a_module("imagebuild", modules)
    assert not names_a_module("specs", modules)


def test_every_unit_test_file_names_a_module() -> None:
    modules = module_names()
    strays = [
        path.name
        for path in sorted((ROOT / "tests" / "unit").glob("test_*.py"))
        if path.stem.removeprefix("test_") not in ABOUT_THE_WHOLE
        and not names_a_module(path.stem.removeprefix("test_"), modules)
    ]
    assert strays == [], f"name these after the module they test: {strays}"


def test_the_exceptions_are_files_that_exist() -> None:
    present = {p.stem.removeprefix("test_") for p in (ROOT / "tests" / "unit").glob("test_*.py")}
    assert ABOUT_THE_WHOLE - present == set()
