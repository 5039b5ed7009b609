"""JavaScript (node), TypeScript (bun) and bash in real sandboxes, on every backend.

Each call of these languages is one process the agent starts in the session's sandbox;
files in /mnt/data are what they share with each other and with Python. The sandbox's
Node.js, bun and npm packages come from the runtime environment (``mcp-code-sandbox
setup`` for bwrap, ``mcp-code-sandbox image build`` for docker).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from typing import Any

import pytest

from mcp_code_sandbox.backends import create_backend
from mcp_code_sandbox.run import execute
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.settings import Settings

from ..conftest import each_backend

PROGRAMS = ("javascript", "typescript", "bash")
#: A 1x1 PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


async def run(service: Any, code: str, language: str, sid: str = "s", **kw: Any) -> Any:
    return await service.run_code("local", RunRequest(code, language, **kw), sid)


async def _service(settings: Settings) -> SandboxService:
    svc = SandboxService(settings, create_backend(settings))
    await svc.start()
    return svc


#: Code that prints the interpreter's own idea of its version.
VERSION_CODE = {
    "javascript": "console.log(process.versions.node)",
    "typescript": "const v: string = Bun.version; console.log(v)",
    "bash": 'printf "%s\\n" "${BASH_VERSION%%(*}"',
}


@each_backend
async def test_each_language_runs_and_reports_its_version(service: Any) -> None:
    assert service.languages()[:1] == ["python"]
    printed = {}
    for language, code in VERSION_CODE.items():
        r = await run(service, code, language)
        assert (r.status, r.exit_code, r.stderr) == ("ok", 0, ""), r
        assert r.execution_count is None and r.result is None
        printed[language] = r.stdout.strip()
    assert set(PROGRAMS) <= set(service.languages())
    listed = {entry["language"]: entry for entry in await service.runtimes()}
    for language in PROGRAMS:
        assert listed[language]["version"] == printed[language]
        assert listed[language]["stateful"] is False
    assert int(printed["javascript"].split(".")[0]) >= 20


@each_backend
async def test_one_session_shares_files_across_languages_but_not_variables(
    service: Any,
) -> None:
    await run(service, "open('from_py.txt', 'w').write('py')\nx = 1", "python")
    js = await run(
        service,
        "import fs from 'node:fs';\n"
        "const seen = fs.readFileSync('from_py.txt', 'utf8');\n"
        "fs.writeFileSync('from_js.json', JSON.stringify({seen, cwd: process.cwd()}));\n"
        "var kept = 'js';",
        "javascript",
    )
    assert js.status == "ok", js.stderr
    assert [f.path for f in js.files] == ["from_js.json"]
    ts = await run(
        service,
        "import { readFileSync, writeFileSync } from 'node:fs';\n"
        "type Seen = { seen: string; cwd: string };\n"
        "const got: Seen = JSON.parse(readFileSync('from_js.json', 'utf8'));\n"
        "writeFileSync('from_ts.txt', `${got.seen}+js+ts ${typeof kept}`);",
        "typescript",
    )
    assert ts.status == "ok", ts.stderr
    sh = await run(service, 'echo "$(cat from_ts.txt)+bash" > from_sh.txt; pwd', "bash")
    assert sh.status == "ok" and sh.stdout == "/mnt/data\n", sh
    py = await run(service, "open('from_sh.txt').read().strip(), x", "python")
    assert py.result == "('py+js+ts undefined+bash', 1)"
    data = await service.read_file("local", "s", "from_js.json", offset=0, max_bytes=None)
    assert json.loads(data.data) == {"seen": "py", "cwd": "/mnt/data"}
    listing = await service.list_files("local", "s", ".", recursive=True)
    names = {entry.path for entry in listing.entries}
    assert names == {"from_py.txt", "from_js.json", "from_ts.txt", "from_sh.txt"}


FLOOD = {
    "javascript": "process.stdout.write('HEAD' + 'x'.repeat(50000) + 'TAIL');",
    "typescript": "process.stdout.write('HEAD' + 'x'.repeat(50000) + 'TAIL');",
    "bash": "printf HEAD; head -c 50000 /dev/zero | tr '\\0' x; printf TAIL",
}
#: Prints, waits, prints: the first line must reach the host while it waits.
SLOW = {
    "javascript": "console.log('first');\nawait new Promise(r => setTimeout(r, 1500));\n"
    "console.error('last');",
    "typescript": "console.log('first');\nawait Bun.sleep(1500);\nconsole.error('last');",
    "bash": "echo first; sleep 1.5; echo last >&2",
}


@each_backend
@pytest.mark.parametrize("language", PROGRAMS)
async def test_output_streams_and_is_cut_like_pythons(
    make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch, language: str
) -> None:
    monkeypatch.setattr(execute, "PROGRESS_EVERY_S", 0.2)
    svc = await _service(make_settings(max_output_bytes=4096))
    try:
        r = await run(svc, FLOOD[language], language)
        assert r.status == "ok" and r.stdout_truncated and not r.stderr_truncated
        assert r.stdout.startswith("HEAD") and r.stdout.endswith("TAIL")
        assert len(r.stdout) < 6000
        full = await svc.read_file("local", "s", r.full_output_path, offset=0, max_bytes=None)
        assert b"HEAD" + b"x" * 50000 + b"TAIL" in full.data

        progress: list[str] = []

        async def on_progress(elapsed: float, total: float, message: str) -> None:
            progress.append(message)

        slow = await svc.run_code("local", RunRequest(SLOW[language], language), "s", on_progress)
        assert (slow.stdout, slow.stderr) == ("first\n", "last\n")
        assert any("first" in message and "last" not in message for message in progress)
    finally:
        await svc.aclose()


#: Start a child that would sleep for ever, record its pid, wait for ever.
SPAWN_AND_HANG = {
    "javascript": "import { spawn } from 'node:child_process';\nimport fs from 'node:fs';\n"
    "const child = spawn('sleep', ['1000']);\n"
    "fs.writeFileSync('child.pid', String(child.pid));\n"
    "await new Promise(() => setInterval(() => {}, 1000));",
    "typescript": "const child = Bun.spawn(['sleep', '1000']);\n"
    "await Bun.write('child.pid', String(child.pid));\n"
    "await new Promise(() => setInterval(() => {}, 1000));",
    "bash": "sleep 1000 & echo $! > child.pid; wait",
}
#: Exit 0 once the pid in child.pid is gone (a zombie counts: it is dead), 1 after 5 s.
CHILD_GONE = """
pid=$(cat child.pid)
for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || exit 0
    [ "$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)" = Z ] && exit 0
    sleep 0.1
done
exit 1
"""


@each_backend
@pytest.mark.parametrize("language", PROGRAMS)
async def test_timeout_kills_the_program_and_its_children(service: Any, language: str) -> None:
    r = await run(service, SPAWN_AND_HANG[language], language, timeout_s=2)
    assert r.status == "timeout", r
    assert r.exit_code is not None and r.exit_code > 128
    check = await run(service, CHILD_GONE, "bash")
    assert check.status == "ok", f"the child of the timed-out {language} run is alive"
    after = await run(service, VERSION_CODE[language], language)
    assert after.status == "ok"


@each_backend
async def test_an_image_file_written_by_javascript_comes_back(service: Any) -> None:
    code = (
        "import { writeFileSync } from 'node:fs';\n"
        f"writeFileSync('dot.png', Buffer.from('{base64.b64encode(PNG).decode()}', 'base64'));"
    )
    r = await run(service, code, "javascript")
    assert r.status == "ok", r.stderr
    assert [(i.path, i.mime_type, i.data) for i in r.image_files] == [("dot.png", "image/png", PNG)]


@each_backend
async def test_node_es_modules_top_level_await_require_and_packages(service: Any) -> None:
    code = (
        "import Papa from 'papaparse';\n"
        "import csv from 'csv-parser';\n"
        "const pg = require('pg');\n"
        "const { default: postgres } = await import('postgres');\n"
        "const rows = await new Promise(r => setTimeout(() => r(Papa.parse('a,b\\n1,2', "
        "{ header: true }).data), 10));\n"
        "console.log(JSON.stringify(rows), typeof csv, typeof pg.Client, typeof postgres);\n"
        "console.log(typeof import.meta.url, require('node:path').basename(__dirname));"
    )
    r = await run(service, code, "javascript")
    assert r.status == "ok", r.stderr
    assert r.stdout == '[{"a":"1","b":"2"}] function function function\nstring data\n'
    assert [f.path for f in r.files] == []  # the code file is not in the workspace


@each_backend
async def test_bun_runs_typescript_with_packages_and_top_level_await(service: Any) -> None:
    code = (
        "import Papa from 'papaparse';\n"
        "interface Row { a: string; b: string }\n"
        "const text: string = await Promise.resolve('a,b\\n1,2');\n"
        "const rows = Papa.parse<Row>(text, { header: true }).data;\n"
        "const pg = require('pg');\n"
        "console.log(rows[0].b, typeof pg.Pool);"
    )
    r = await run(service, code, "typescript")
    assert r.status == "ok", r.stderr
    assert r.stdout == "2 function\n"
    assert [f.path for f in r.files] == []


@each_backend
@pytest.mark.parametrize(("language", "suffix"), [("javascript", "mjs"), ("typescript", "ts")])
async def test_errors_point_at_the_users_line(service: Any, language: str, suffix: str) -> None:
    code = "const a = 1;\n\nthrow new Error('boom on line 3');\n"
    r = await run(service, code, language)
    assert r.status == "error" and r.exit_code == 1
    assert "boom on line 3" in r.stderr
    assert f"main.{suffix}:3:" in r.stderr, r.stderr


@each_backend
@pytest.mark.parametrize("language", ["javascript", "typescript"])
async def test_a_programs_last_expression_is_its_result(service: Any, language: str) -> None:
    # As Node's REPL and E2B's JavaScript kernel give it (DESIGN §6).
    hello = await run(service, "await Promise.resolve('Hello World!')", language)
    assert (hello.status, hello.result, hello.stdout) == ("ok", "Hello World!", "")
    code = (
        "import Papa from 'papaparse'\nconst rows = Papa.parse('a,b\\n1,2').data\nrows.length * 21"
    )
    assert (await run(service, code, language)).result == "42"
    shown = await run(service, "const o = { a: [1, 2], b: 'x' }\no", language)
    assert shown.result is not None and "a: [ 1, 2 ]" in shown.result
    # No value: a statement, a call that returns nothing, a program that failed.
    for code in ("const x = 1", "console.log('hi')", "throw new Error('no')\n1"):
        assert (await run(service, code, language)).result is None, code
    # Code the rewrite cannot take still runs as written, with its line numbers.
    odd = "const a = 1;\nlet s = `${a}\n`\nthrow new Error('boom on line 4')"
    failed = await run(service, odd + "\n", language)
    assert failed.exit_code == 1 and ":4:" in failed.stderr, failed.stderr


@each_backend
async def test_a_value_file_the_program_replaced_is_not_waited_on(service: Any) -> None:
    # The program can reach its scratch directory: a FIFO where its value goes must not
    # make the agent wait for a writer.
    code = (
        "import { execFileSync } from 'node:child_process'\n"
        "import { dirname, join } from 'node:path'\n"
        "execFileSync('mkfifo', [join(dirname(process.argv[1]), 'value.txt')])\n"
        "console.log('planted')"
    )
    r = await asyncio.wait_for(run(service, code, "javascript", timeout_s=20), 60)
    assert (r.status, r.stdout, r.result) == ("ok", "planted\n", None), r.stderr
    after = await run(service, "6 * 7", "javascript")
    assert after.result == "42"
