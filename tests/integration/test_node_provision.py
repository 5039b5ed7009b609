"""Node.js, bun and the npm packages at /opt/sandbox/node, in real sandboxes on every backend.

Provisioning only: the tools are driven from a Python cell (``subprocess``) so this holds
whatever the agent does with the ``javascript``/``typescript`` languages. bwrap's come from
``mcp-code-sandbox setup`` (host npm), docker's from ``mcp-code-sandbox image build``.
"""

from __future__ import annotations

import json
from typing import Any

from mcp_code_sandbox.provision.node import NPM_PACKAGES
from mcp_code_sandbox.run.request import RunRequest

from ..conftest import each_backend

#: Prints one JSON object: what each command printed and its exit code.
PROBE = r"""
import json, os, subprocess
ESM = "import('papaparse').then(m => console.log('esm', typeof m.default.parse))"
commands = {
    "node": ["/opt/sandbox/node/bin/node", "-e", "require('pg'); require('postgres');"
             " require('csv-parser'); " + ESM],
    "node_on_path": ["node", "-p", "process.versions.node"],
    "bun": ["bun", "-e", "const pg: any = require('pg'); " + ESM],
    "bun_version": ["bun", "--version"],
    "npm_version": ["npm", "--version"],
}
out = {}
for name, argv in commands.items():
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    out[name] = [done.returncode, done.stdout.strip(), done.stderr.strip()[-300:]]
versions = json.load(open("/opt/sandbox/node/versions.json"))
try:
    open("/opt/sandbox/node/bin/node", "ab")
    writable = True
except OSError:
    writable = False
print(json.dumps({"runs": out, "versions": versions, "writable": writable,
                  "node_path": os.environ.get("NODE_PATH")}))
"""


@each_backend
async def test_node_and_bun_with_the_npm_packages(service: Any) -> None:
    r = await service.run_code("local", RunRequest(PROBE), "node-probe")
    assert (r.status, r.stderr) == ("ok", ""), r
    found = json.loads(r.stdout)
    runs = found["runs"]
    assert runs["node"] == [0, "esm function", ""]
    assert runs["bun"] == [0, "esm function", ""]
    versions = found["versions"]
    assert versions["node"].startswith("24.")
    assert runs["node_on_path"] == [0, versions["node"], ""]
    assert runs["bun_version"] == [0, versions["bun"], ""]
    assert runs["npm_version"] == [0, versions["npm"], ""]  # npm itself, for installs
    assert sorted(versions["packages"]) == sorted(NPM_PACKAGES)
    # The session's own packages (agent/packages.py) first, then the preinstalled ones.
    assert (
        found["node_path"] == "/mnt/data/.packages/node/node_modules:/opt/sandbox/node/node_modules"
    )
    assert found["writable"] is False
