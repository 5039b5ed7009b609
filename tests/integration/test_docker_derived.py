"""``SANDBOX_RUNTIME_PACKAGES`` on Docker, for real: ``image build``'s derived image (the
sandbox image and a small pure-Python package from PyPI on top) is what the docker
backend runs, the package imports in a session, and a server whose derived image is
missing is not ready and says the one command that builds it (never a sandbox without
the packages). The same setting on bwrap: tests/e2e/test_first_run.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import docker
import docker.errors
import pytest

from mcp_code_sandbox.backends.docker.derived import packages_tag
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.provision.image import build_packages_image
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.settings import Settings, ca_bundle_from_env, docker_environ

from ..conftest import MakeService

pytestmark = [pytest.mark.docker, pytest.mark.parametrize("backend", ["docker"], indirect=True)]

#: Tiny, pure Python, and not in the sandbox image: its build takes seconds.
PACKAGE = "tabulate"


@pytest.fixture
def derived(make_settings: Callable[..., Settings]) -> Iterator[str]:
    """The derived image of this test's sandbox image with :data:`PACKAGE`, built as
    ``image build`` builds it, and removed afterwards."""
    settings = make_settings(runtime_packages=PACKAGE)
    lines: list[str] = []
    ca_bundle = ca_bundle_from_env()  # as `image build` takes it (a proxy's CA)
    built = build_packages_image(settings, ca_bundle=ca_bundle, progress=lines.append)
    assert built is not None and built.tag == packages_tag(settings.image, [PACKAGE]), lines
    try:
        yield built.tag
    finally:
        client = docker.from_env(environment=docker_environ())
        try:
            client.images.remove(built.tag)
        except docker.errors.APIError:
            pass  # a container of another test still uses it: the next build reuses it
        finally:
            client.close()


async def test_the_derived_image_has_the_package(derived: str, make_service: MakeService) -> None:
    async with make_service(runtime_packages=PACKAGE) as svc:
        assert svc.backend.image == derived
        assert await svc.not_ready() is None
        report = await svc.run_code("local", RunRequest("import tabulate; tabulate.__name__"))
        assert (report.status, report.result) == ("ok", "'tabulate'"), report.error
        [python] = [r for r in await svc.runtimes() if r["language"] == "python"]
        assert PACKAGE in python["packages"] and "pandas" in python["packages"]


async def test_a_missing_derived_image_is_said_with_the_command(make_service: MakeService) -> None:
    async with make_service(runtime_packages="no-such-package-built-zq7x") as svc:
        why = await svc.not_ready()
        assert why is not None and "mcp-code-sandbox image build" in why
        assert svc.backend.image in why
        with pytest.raises(BackendUnavailable, match="mcp-code-sandbox image build"):
            await svc.run_code("local", RunRequest("1"))
