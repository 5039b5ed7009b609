"""The docker backend's start from a checkpoint, against an engine that refuses it.

Docker refuses a restore while containerd still holds its own copy of the checkpoint
(moby/moby#42900) until containerd's next garbage collection, which a test cannot hold
back on a real engine: the engine's answers are hand-made here, on docker-py's own
request helpers, and everything above them is the backend's."""

from __future__ import annotations

from typing import Any

import docker.errors
import pytest
import requests

from mcp_code_sandbox.backends.docker import backend as docker_backend
from mcp_code_sandbox.backends.docker.backend import DockerBackend
from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.settings import load_settings

COPY_LEFT = (
    "failed to upload checkpoint to containerd: commit failed: content "
    "sha256:7d07dc1885e00493118abd01a2304d3214bf82ca20a78d0d3c3b4b9ecd5ac247: already exists"
)


def api_error(status: int, explanation: str) -> docker.errors.APIError:
    response = requests.Response()
    response.status_code = status
    return docker.errors.APIError(f"{status} error", response=response, explanation=explanation)


class Api:
    """docker-py's low-level client as the backend's checkpoint calls use it: each start
    answers with the next of ``answers`` (``None``: started)."""

    def __init__(self, *answers: docker.errors.APIError | None) -> None:
        self.answers = list(answers)
        self.starts: list[dict[str, Any]] = []

    def _url(self, template: str, *args: str) -> str:
        return template.format(*args)

    def _post(self, url: str, params: dict[str, Any]) -> docker.errors.APIError | None:
        self.starts.append({"url": url, **params})
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def _raise_for_status(self, answer: docker.errors.APIError | None) -> None:
        if answer is not None:
            raise answer


def backend() -> DockerBackend:
    return DockerBackend(load_settings({"docker_runtime": "runsc"}, environ={}), environment={})


async def test_a_restore_waits_for_containerd_to_drop_its_copy() -> None:
    api = Api(api_error(500, COPY_LEFT), api_error(500, COPY_LEFT), None)
    await backend()._start_from_checkpoint(api, "c1")
    assert api.starts == [{"url": "/containers/c1/start", "checkpoint": "mcs-pause"}] * 3


async def test_another_failure_is_not_retried() -> None:
    api = Api(api_error(500, "runsc restore failed: sandbox image is corrupt"), None)
    with pytest.raises(SandboxFailed, match="image is corrupt"):
        await backend()._start_from_checkpoint(api, "c1")
    assert len(api.starts) == 1


async def test_a_copy_that_stays_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(docker_backend, "_CHECKPOINT_COPY_WAIT_S", 0.5)
    api = Api(api_error(500, COPY_LEFT))
    with pytest.raises(SandboxFailed, match="already exists"):
        await backend()._start_from_checkpoint(api, "c1")
