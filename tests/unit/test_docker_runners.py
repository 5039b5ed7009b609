"""Runner images: their labels, the choice among images, and their containers' shape.

Pure: images are ``(name, id, created, labels)`` tuples and kwargs are only built."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.backends.base import Egress, Limits, SandboxSpec
from mcp_code_sandbox.backends.docker.labels import runner_from_labels
from mcp_code_sandbox.backends.docker.runners import (
    KEEPALIVE,
    choose_runners,
    runner_kwargs,
    tagged_id,
)
from mcp_code_sandbox.backends.runner_images import RunnerImage
from mcp_code_sandbox.backends.seccomp import docker_seccomp_opt
from mcp_code_sandbox.settings import load_settings

RUBY = {"sandbox.runner": "true", "sandbox.language": "ruby"}


def parse(**labels: str) -> tuple[RunnerImage | None, str | None]:
    return runner_from_labels(labels, "ruby:3", "sha256:r1")


def ruby(**labels: str) -> RunnerImage:
    runner, why = runner_from_labels({**RUBY, **labels}, "ruby:3", "sha256:r1")
    assert runner is not None, why
    assert why is None
    return runner


def refused(**labels: str) -> str:
    runner, why = runner_from_labels({**RUBY, **labels}, "ruby:3", "sha256:r1")
    assert runner is None
    assert why
    return why


# -- runner_from_labels -------------------------------------------------------------------


def test_defaults() -> None:
    runner = ruby()
    assert runner == RunnerImage(
        language="ruby",
        image="ruby:3",
        image_id="sha256:r1",
        command=("ruby", "{file}"),
        suffix="",
        version=None,
        packages={},
    )


def test_json_command_is_parsed() -> None:
    runner = ruby(**{"sandbox.command": '["ruby", "--disable-gems", "{file}"]'})
    assert runner.command == ("ruby", "--disable-gems", "{file}")


def test_file_may_be_part_of_an_argument() -> None:
    assert ruby(**{"sandbox.command": '["tool", "--in={file}"]'}).command == (
        "tool",
        "--in={file}",
    )


@pytest.mark.parametrize(
    "command",
    [
        '["ruby", "main.rb"]',  # no {file}
        "[]",
        '["ruby", "", "{file}"]',  # an empty part
        '["ruby", 1, "{file}"]',
        '"ruby {file}"',  # JSON, not an array
        '{"cmd": "{file}"}',
    ],
)
def test_command_that_is_not_an_array_of_strings_with_file_is_refused(command: str) -> None:
    assert "{file}" in refused(**{"sandbox.command": command})


def test_command_that_is_not_json_is_refused() -> None:
    why = refused(**{"sandbox.command": "ruby {file}"})
    assert "sandbox.command must be a JSON array" in why


@pytest.mark.parametrize("language", ["Ruby!", "", "Ruby", "1ruby", "ruby lang", "r" * 33])
def test_bad_language_name_is_refused(language: str) -> None:
    assert "sandbox.language" in refused(**{"sandbox.language": language})


def test_missing_language_is_refused() -> None:
    runner, why = parse(**{"sandbox.runner": "true"})
    assert runner is None
    assert why is not None and "sandbox.language" in why


@pytest.mark.parametrize("language", ["r", "c++", "node_js", "x-1"])
def test_good_language_names(language: str) -> None:
    runner = ruby(**{"sandbox.language": language})
    assert runner.language == language
    assert runner.command == (language, "{file}")


@pytest.mark.parametrize("flag", ["false", "", "yes", "1"])
def test_not_labelled_runner_is_refused(flag: str) -> None:
    assert "sandbox.runner=true" in refused(**{"sandbox.runner": flag})


def test_unlabelled_image_is_refused() -> None:
    runner, why = parse(**{"sandbox.language": "ruby"})
    assert runner is None
    assert why == "not labelled sandbox.runner=true"


def test_runner_flag_is_case_insensitive() -> None:
    assert ruby(**{"sandbox.runner": "TRUE"}).language == "ruby"


@pytest.mark.parametrize(("extension", "suffix"), [("rb", ".rb"), (".rb", ".rb"), ("", "")])
def test_extension(extension: str, suffix: str) -> None:
    assert ruby(**{"sandbox.extension": extension}).suffix == suffix


@pytest.mark.parametrize("extension", ["../rb", "r b", ".", "..rb", "rb/x", "x" * 17])
def test_bad_extension_is_refused(extension: str) -> None:
    assert "sandbox.extension" in refused(**{"sandbox.extension": extension})


def test_packages_are_parsed() -> None:
    runner = ruby(**{"sandbox.packages": '{"rake": "13.1", "json": 2, "x": null}'})
    assert runner.packages == {"rake": "13.1"}  # versions are strings; others are dropped


@pytest.mark.parametrize("packages", ["not json", "[1, 2]", '"rake"', "null"])
def test_packages_garbage_is_ignored(packages: str) -> None:
    assert ruby(**{"sandbox.packages": packages}).packages == {}


def test_version_is_kept() -> None:
    assert ruby(**{"sandbox.version": "3.3"}).version == "3.3"
    assert ruby(**{"sandbox.version": ""}).version is None


# -- choose_runners -----------------------------------------------------------------------


def image(
    name: str, image_id: str, created: float = 1_700_000_000, *, language: str
) -> tuple[str, str, float, Mapping[str, str]]:
    return name, image_id, created, {"sandbox.runner": "true", "sandbox.language": language}


def test_default_image_is_skipped_silently() -> None:
    runners, skipped = choose_runners(
        [image("sandbox:1", "sha256:default", language="julia")],
        default_image_id="sha256:default",
        taken=(),
    )
    assert runners == {}
    assert skipped == []


def test_language_taken_is_skipped_with_a_reason() -> None:
    runners, skipped = choose_runners(
        [
            image("py:1", "sha256:p", language="python"),
            image("ruby:3", "sha256:r", language="ruby"),
        ],
        default_image_id=None,
        taken=["python", "bash"],
    )
    assert list(runners) == ["ruby"]
    assert len(skipped) == 1
    assert skipped[0].startswith("py:1: ")
    assert "'python'" in skipped[0] and "built in" in skipped[0]


def test_bad_labels_are_skipped_with_the_reason() -> None:
    runners, skipped = choose_runners(
        [image("bad:1", "sha256:b", language="Ruby!")],
        default_image_id=None,
        taken=(),
    )
    assert runners == {}
    assert len(skipped) == 1
    assert skipped[0].startswith("bad:1: sandbox.language")


@pytest.mark.parametrize("newer_first", [False, True])
def test_the_newer_of_two_images_for_one_language_wins(newer_first: bool) -> None:
    old = image("ruby:old", "sha256:old", 1_700_000_000, language="ruby")
    new = image("ruby:new", "sha256:new", 1_710_000_000, language="ruby")
    images = [new, old] if newer_first else [old, new]
    runners, skipped = choose_runners(images, default_image_id=None, taken=())
    assert runners["ruby"].image == "ruby:new"
    assert runners["ruby"].image_id == "sha256:new"
    assert len(skipped) == 1
    assert skipped[0].startswith("ruby:old: ")
    assert "newer image" in skipped[0]


def test_three_images_for_one_language_keep_the_newest() -> None:
    images = [
        image("r:b", "sha256:b", 1_701_000_000, language="r"),
        image("r:c", "sha256:c", 1_702_000_000, language="r"),
        image("r:a", "sha256:a", 1_700_000_000, language="r"),
    ]
    runners, skipped = choose_runners(images, default_image_id=None, taken=())
    assert runners["r"].image == "r:c"
    assert sorted(line.split(":", 2)[1] for line in skipped) == ["a", "b"]


def test_results_are_sorted_by_language() -> None:
    images = [
        image(f"{lang}:1", f"sha256:{lang}", language=lang)
        for lang in ("ruby", "julia", "perl", "c++")
    ]
    runners, skipped = choose_runners(images, default_image_id="sha256:other", taken=())
    assert list(runners) == ["c++", "julia", "perl", "ruby"]
    assert all(runner.language == lang for lang, runner in runners.items())
    assert skipped == []


# -- runner_kwargs ------------------------------------------------------------------------

LIMITS = Limits(memory_bytes=512 << 20, cpu=1.5, pids=128, tmp_bytes=64 << 20, file_bytes=1 << 30)
RUN_DIR = Path("/var/lib/mcs/run/k1-perl")
WORKSPACE = Path("/var/lib/mcs/workspaces/k1-0000abcd")
PERL = RunnerImage(
    language="perl", image="perl:5", image_id="sha256:perl", command=("perl", "{file}")
)


def kwargs(**kw: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "key": "k1",
        "owner": "alice",
        "session_id": "my-session",
        "workspace": WORKSPACE,
        "limits": LIMITS,
        "env": {"FOO": "bar"},
        "uid": 0x7000_0009,
    }
    values.update(kw)
    settings = load_settings({}, environ={})
    return runner_kwargs(SandboxSpec(**values), settings, PERL, instance="h-1-ab", run_dir=RUN_DIR)


def test_runner_container_runs_the_runner_image_with_a_keepalive_shell() -> None:
    k = kwargs()
    assert k["image"] == "sha256:perl"
    assert [*k["entrypoint"], *k["command"]] == list(KEEPALIVE)
    assert k["entrypoint"] == ["/bin/sh"]
    assert k["working_dir"] == "/mnt/data"


def test_runner_labels() -> None:
    assert kwargs()["labels"] == {
        "mcp-code-sandbox.owner": "alice",
        "mcp-code-sandbox.session": "my-session",
        "mcp-code-sandbox.key": "k1",
        "mcp-code-sandbox.instance": "h-1-ab",
        "mcp-code-sandbox.rundir": "k1-perl",
        "mcp-code-sandbox.runner": "perl",
        "mcp-code-sandbox.uid": str(0x7000_0009),
    }


def test_runner_keeps_the_sandbox_hardening() -> None:
    k = kwargs()
    assert k["network_mode"] == "none"
    assert k["cap_drop"] == ["ALL"]
    assert k["read_only"] is True
    assert k["security_opt"] == ["no-new-privileges", docker_seccomp_opt()]
    assert k["init"] is True  # its main process is a shell that reaps nothing
    # The session's own uid, as its main container's: they share the workspace.
    assert k["user"] == f"{0x7000_0009}:{0x7000_0009}"
    assert k["mem_limit"] == k["memswap_limit"] == 512 << 20
    assert k["pids_limit"] == 128
    assert k["tmpfs"] == {"/tmp": f"size={64 << 20},mode=1777"}
    assert "privileged" not in k and "cap_add" not in k
    assert k["environment"]["FOO"] == "bar"


def test_runner_mounts_the_workspace_and_its_own_run_dir() -> None:
    mounts = {m["Target"]: m for m in kwargs()["mounts"]}
    assert set(mounts) == {"/mnt/data", "/run/mcs"}
    assert mounts["/mnt/data"]["Source"] == str(WORKSPACE)
    assert mounts["/mnt/data"]["ReadOnly"] is False
    assert mounts["/run/mcs"]["Source"] == str(RUN_DIR)
    assert mounts["/run/mcs"]["ReadOnly"] is True
    assert all(m["Type"] == "bind" for m in mounts.values())


def test_runner_has_no_interface_even_with_network() -> None:
    values: dict[str, Any] = {"key": "k1", "owner": "a", "session_id": "s"}
    values["uid"] = 0x7000_0001
    values["egress"] = Egress(Path("/var/lib/mcs/egress/k1-ab"))
    spec = SandboxSpec(workspace=WORKSPACE, limits=LIMITS, **values)
    settings = load_settings({}, environ={})
    k = runner_kwargs(spec, settings, PERL, instance="h-1-ab", run_dir=RUN_DIR)
    assert k["network_mode"] == "none"
    assert kwargs()["network_mode"] == "none"


def test_the_default_image_is_found_in_the_list_by_its_exact_tag() -> None:
    listed = [
        {"Id": "sha256:a", "RepoTags": ["mcp-code-sandbox:latest", "mine:1"]},
        {"Id": "sha256:b", "RepoTags": ["registry:5000/team/py:2"]},
        {"Id": "sha256:c", "RepoTags": ["<none>:<none>"]},
    ]
    assert tagged_id(listed, "mcp-code-sandbox:latest") == "sha256:a"
    assert tagged_id(listed, "mcp-code-sandbox") == "sha256:a"  # no tag: :latest
    assert tagged_id(listed, "mine:1") == "sha256:a"
    assert tagged_id(listed, "registry:5000/team/py:2") == "sha256:b"
    # Anything else is the engine's to resolve (the caller inspects it).
    assert tagged_id(listed, "registry:5000/team/py") is None  # that is :latest
    assert tagged_id(listed, "mine:2") is None
    assert tagged_id(listed, "sha256:a") is None
    assert tagged_id(listed, "mcp-code-sandbox@sha256:0123") is None
    assert tagged_id([], "mcp-code-sandbox:latest") is None
