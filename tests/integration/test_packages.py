"""Packages at run time (``pip install``/``%pip``, ``npm install``, ``bun add``) on each
backend, from a package index the tests build and serve in a test namespace
(:mod:`tests.pkgindex`, :mod:`tests.labnet`): no public registry, no traffic off the
machine.

What a user sees: the install works when the network is allowed, the package imports
by bare name in the same session (in the same interpreter, and after the sandbox
restarts), the install leaves no artifacts and no workspace clutter in listings, counts
towards the workspace quota, and is gone with the session.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest

from mcp_code_sandbox.errors import QuotaExceeded, SessionNotFound
from mcp_code_sandbox.run.execute import RunReport
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService

from .. import labnet, pkgindex
from ..conftest import MakeService, each_backend, each_runtime

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 to build the test network",
)

PORT = 8081


#: The index's name: in no DNS here, the proxies resolve it from ``network_resolve``.
INDEX_NAME = "pkgs.test"


@dataclass
class Index:
    url: str
    host: str
    #: package name -> the token its module holds
    tokens: dict[str, str]
    #: The index's address in the test namespace (what ``INDEX_NAME`` resolves to).
    address: str

    @property
    def pip(self) -> str:
        return f"--index-url {self.url}/simple/ --trusted-host {self.host}"


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Index]:
    root = tmp_path_factory.mktemp("index")
    with labnet.namespace("mcs-pk") as ns:
        url = f"http://{INDEX_NAME}:{PORT}"
        tokens = {name: f"tok-{secrets.token_hex(6)}" for name in ("py", "js", "bun")}
        pkgindex.add_wheel(
            root,
            "mcs-demo-pkg",
            {
                "mcs_demo_pkg/__init__.py": (
                    f"VALUE = {tokens['py']!r}\ndef main():\n    print(VALUE)\n"
                ).encode()
            },
            scripts={"mcs-demo": "mcs_demo_pkg:main"},
        )
        # Three 40 kB files: 120 kB installed, past a 100 kB quota (the wheel itself is small:
        # RLIMIT_FSIZE caps every file the sandbox writes, its download too, at the quota).
        noise = {f"mcs_big_pkg/blob{i}.bin": bytes(40_000) for i in range(3)}
        pkgindex.add_wheel(root, "mcs-big-pkg", {"mcs_big_pkg/__init__.py": b"", **noise})
        for name in ("js", "bun"):
            pkgindex.add_npm_package(
                root,
                url,
                f"mcs-demo-{name}",
                {"index.js": f"module.exports = {{ value: {tokens[name]!r} }};\n"},
            )
        argv = [sys.executable, "-c", pkgindex.SERVER, str(root), ns.ns_ip, str(PORT)]
        labnet.serve_inside(ns, argv, ns.ns_ip, PORT)
        yield Index(url, INDEX_NAME, tokens, ns.ns_ip)


def _allowing(index: Index) -> dict[str, object]:
    """Settings whose allowlist names the index (and, as it is a private address, lets
    that name land on it): pip and npm reach it through the egress proxy, by name."""
    return {
        "allow_network": True,
        "network_allow": f"{INDEX_NAME},{index.address}/32",
        "network_resolve": f"{INDEX_NAME}={index.address}",  # in no DNS here
    }


@pytest.fixture
async def svc(make_service: MakeService, index: Index) -> AsyncIterator[SandboxService]:
    async with make_service(exec_timeout_s=120, **_allowing(index)) as service:
        yield service


async def run(
    svc: SandboxService, session: str, code: str, language: str = "python", *, network: bool
) -> RunReport:
    return await svc.run_code("local", RunRequest(code, language, network=network), session)


def ok(report: RunReport) -> RunReport:
    assert report.status == "ok", (report.stdout, report.stderr, report.error)
    return report


@each_runtime
async def test_pip_install_persists_in_the_session_and_leaves_no_artifacts(
    svc: SandboxService, index: Index
) -> None:
    session = "pk-pip"
    first = ok(await run(svc, session, f"%pip install {index.pip} mcs-demo-pkg", network=True))
    assert "Successfully installed mcs-demo-pkg" in first.stdout
    assert first.files == []
    # The same interpreter imports it at once: no restart.
    same = ok(await run(svc, session, "import mcs_demo_pkg\nmcs_demo_pkg.VALUE", network=True))
    assert same.result == repr(index.tokens["py"]) and not same.state_lost
    # Its console script is on PATH.
    script = ok(await run(svc, session, "mcs-demo", "bash", network=True))
    assert script.stdout.strip() == index.tokens["py"]
    # A new sandbox (no network now) still has it: it lives with the session's files.
    again = await run(svc, session, "import mcs_demo_pkg\nprint(mcs_demo_pkg.VALUE)", network=False)
    assert again.state_lost and ok(again).stdout.strip() == index.tokens["py"]
    listed = await svc.list_files("local", session, ".", recursive=True)
    assert not any(entry.path.startswith(".packages") for entry in listed.entries)
    inside = await svc.list_files("local", session, ".packages", recursive=True)
    assert any("mcs_demo_pkg" in entry.path for entry in inside.entries)


@each_backend
async def test_installed_packages_vanish_with_the_session(
    svc: SandboxService, index: Index
) -> None:
    session = "pk-gone"
    ok(await run(svc, session, f"pip install -q {index.pip} mcs-demo-pkg", "bash", network=True))
    ok(await run(svc, session, "import mcs_demo_pkg", network=True))
    workspaces = svc.settings.workspaces_dir
    assert any((slot / ".packages").is_dir() for slot in workspaces.iterdir())
    await svc.close_session("local", session)
    assert not any(workspaces.iterdir())
    with pytest.raises(SessionNotFound):
        await svc.list_files("local", session, ".", recursive=True)
    fresh = await run(svc, session, "import mcs_demo_pkg", network=True)
    assert fresh.status == "error" and fresh.error and fresh.error["name"] == "ModuleNotFoundError"


@each_runtime
async def test_npm_install_and_bun_add_import_by_bare_name(
    svc: SandboxService, index: Index
) -> None:
    session = "pk-npm"
    js, bun = index.tokens["js"], index.tokens["bun"]
    npm = ok(
        await run(
            svc, session, f"npm install --registry {index.url}/ mcs-demo-js", "bash", network=True
        )
    )
    added = ok(
        await run(
            svc, session, f"bun add --registry {index.url}/ mcs-demo-bun", "bash", network=True
        )
    )
    assert npm.files == [] and added.files == []
    both = (
        "import a from 'mcs-demo-js';\nimport b from 'mcs-demo-bun';\n"
        "console.log(a.value, b.value, require('mcs-demo-js').value);\n"
    )
    for language in ("javascript", "typescript"):
        report = ok(await run(svc, session, both, language, network=True))
        assert report.stdout.split() == [js, bun, js], language
    # From a module in the workspace too (plain node: no require there), and after a
    # restart (no network now).
    module = both.replace(", require('mcs-demo-js').value", "")
    ok(await run(svc, session, f"open('x.mjs', 'w').write({module!r})", network=False))
    from_file = ok(await run(svc, session, "node x.mjs && bun x.mjs", "bash", network=False))
    assert from_file.stdout.split() == [js, bun] * 2
    listed = await svc.list_files("local", session, ".", recursive=True)
    assert [entry.path for entry in listed.entries] == ["x.mjs"]
    # A project of the user's own (its package.json): npm installs there, as usual.
    project = (
        f"mkdir proj && cd proj && echo '{{}}' > package.json && "
        f"npm install -s --registry {index.url}/ mcs-demo-js"
    )
    own = ok(await run(svc, session, project, "bash", network=True))
    assert "proj/node_modules/mcs-demo-js/index.js" in [change.path for change in own.files]


@each_backend
async def test_packages_count_towards_the_workspace_quota(
    make_service: MakeService, index: Index
) -> None:
    async with make_service(workspace_quota_bytes=100_000, **_allowing(index)) as svc:
        report = ok(
            await run(
                svc, "pk-quota", f"pip install -q {index.pip} mcs-big-pkg", "bash", network=True
            )
        )
        assert report.files == []
        assert report.notice and "more than its quota" in report.notice
        with pytest.raises(QuotaExceeded):
            await svc.upload_file("local", "a.txt", b"x", session_id="pk-quota", overwrite=False)
