"""Languages other than Python: each call runs one program as a child of the supervisor.

A new language is one entry in ``PROGRAMS``: how to turn code into an argv, and how to
ask the interpreter for its version. ``ready`` lists only those whose interpreter exists
on the base PATH: the one the backend gave the agent (the sandbox's venv, node and bun,
the system), before the session's own ``.packages`` bin directories go in front of it.
Those are the tenant's to write: a ``bash`` planted there must never be the one the
agent runs or asks for a version (user programs still find the session's packages first
on their own PATH).

JavaScript (node) and TypeScript (bun) get their code as a file, never inline: both run
it as an ES module, so ``import`` and top-level ``await`` work, and a stack trace's line
numbers are the user's own (the file holds exactly the code). The file lives in the
agent's private scratch directory under /tmp, not in the workspace, so it is never
reported as an artifact. That directory holds:

- ``node_modules``: a symlink to the first ``NODE_PATH`` directory that exists: the
  session's own packages once it installed some (:mod:`.packages`), else the
  preinstalled ones. ES module bare-name imports resolve by walking up from the importing
  file, not through ``NODE_PATH``; the symlink, and the ``/node_modules`` link to the
  preinstalled packages the walk ends at, make ``import Papa from 'papaparse'`` work in
  node whatever the cwd. (bun also honours ``NODE_PATH`` for imports.)
- ``preload.mjs``, which node loads with ``--import``: it defines ``require`` (resolved
  from the cwd, like ``node -e``, falling back to ``NODE_PATH``) and ``__dirname`` (the
  cwd) as globals, so CommonJS habits work in the same program as ``import``. A user's
  own ``const require = createRequire(import.meta.url)`` simply shadows it. bun has
  ``require`` in ES modules natively.

Relative imports (``./x.mjs``) resolve against the scratch directory, not the workspace:
files in /mnt/data are reached by their path (``fs``, or ``import('/mnt/data/x.mjs')``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .budget import cut_text
from .lastexpr import VALUE_KEY, check_source, rewrite, split_last

__all__ = ["PROGRAMS", "VALUED", "Program", "available", "command", "prepare_scratch", "value"]

#: Node's ``--import`` preload. ``??=``: a global someone already set is left alone.
PRELOAD = """\
import { createRequire } from 'node:module';
import { join } from 'node:path';
globalThis.require ??= createRequire(join(process.cwd(), '[eval]'));
globalThis.__dirname ??= process.cwd();
"""

#: The preload of node (``--import``) and bun (``--preload``) that gives a program its
#: last expression's value (:mod:`.lastexpr`). ``plan.json``, written with the code:
#: the program as written (``main``), rewritten (``code``) and as a node check compiles
#: it (``check``). The rewrite replaces the program only when the interpreter's own
#: parser accepts it; at exit the value is written to ``value.txt``, a string as it is,
#: anything else as node's REPL shows it; ``undefined`` (``console.log(...)``): none.
VALUE_PRELOAD = f"""\
import {{ readFileSync, rmSync, writeFileSync }} from 'node:fs';
import {{ inspect }} from 'node:util';
const here = new URL('.', import.meta.url);
let plan = null;
try {{
  plan = JSON.parse(readFileSync(new URL('plan.json', here), 'utf8'));
  rmSync(new URL('plan.json', here));
  if (globalThis.Bun) new Bun.Transpiler({{ loader: 'ts' }}).transformSync(plan.code);
  else new (async () => {{}}).constructor(plan.check);
  writeFileSync(plan.main, plan.code);
}} catch {{
  plan = null;
}}
if (plan) process.on('exit', () => {{
  const value = globalThis.{VALUE_KEY};
  if (value === undefined) return;
  const text = typeof value === 'string' ? value : inspect(value, {{
    depth: 4, maxArrayLength: 100, maxStringLength: 10000, breakLength: 100 }});
  try {{ writeFileSync(new URL('value.txt', here), text); }} catch {{}}
}});
"""


@dataclass(frozen=True)
class Program:
    executable: str
    #: (resolved executable, code or code file, scratch dir) -> argv
    argv: Callable[[str, str, str], list[str]]
    version_argv: tuple[str, ...]
    #: Its key in ``versions.json`` beside the interpreter's ``bin/`` (the sandbox's node
    #: dir, :mod:`mcp_code_sandbox.provision.node`), read instead of starting it to ask.
    version_key: str | None = None
    #: The code is written to ``<scratch>/main<suffix>`` and the argv gets that path;
    #: ``None``: the argv gets the code itself.
    suffix: str | None = None


PROGRAMS: dict[str, Program] = {
    "bash": Program(
        "bash",
        lambda exe, code, scratch: [exe, "-c", code],
        ("-c", 'printf %s "${BASH_VERSION%%(*}"'),
    ),
    "javascript": Program(
        "node",
        lambda exe, path, scratch: [
            exe,
            "--import",
            f"file://{scratch}/preload.mjs",
            "--import",
            f"file://{scratch}/value.mjs",
            path,
        ],
        ("--version",),
        version_key="node",
        suffix=".mjs",
    ),
    # --no-install: never try to fetch a missing package (there is no network anyway).
    "typescript": Program(
        "bun",
        lambda exe, path, scratch: [
            exe,
            "--no-install",
            "run",
            "--preload",
            f"{scratch}/value.mjs",
            path,
        ],
        ("--version",),
        version_key="bun",
        suffix=".ts",
    ),
}


#: The languages whose programs have a value: their last expression (:mod:`.lastexpr`).
VALUED = frozenset({"javascript", "typescript"})


def available(base: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """``{language: (executable path, version)}`` for the interpreters found on the
    ``PATH`` of ``base``, the agent's environment as the backend set it; the version
    probes run with ``base`` too.

    This runs at every sandbox start: versions come from ``versions.json`` where there is
    one, and the interpreters that must be asked are asked in parallel."""
    found: dict[str, tuple[str, str]] = {}
    probes: dict[str, tuple[str, subprocess.Popen[str] | None]] = {}
    for name, program in PROGRAMS.items():
        exe = _real(shutil.which(program.executable, path=base.get("PATH", os.defpath)))
        if exe is None:
            continue
        recorded = _recorded_version(exe, program.version_key)
        if recorded is not None:
            found[name] = (exe, recorded)
        else:
            probes[name] = (exe, _start_probe(exe, program.version_argv, base))
    found.update({name: (exe, _version(probe)) for name, (exe, probe) in probes.items()})
    return {name: found[name] for name in PROGRAMS if name in found}


def _real(exe: str | None) -> str | None:
    """The program behind a ``shims/`` wrapper of the node runtime (``bun`` is one, for
    its installs): running code needs no wrapper, and skipping it saves a shell."""
    if exe is None or os.path.basename(os.path.dirname(exe)) != "shims":
        return exe
    real = os.path.join(os.path.dirname(os.path.dirname(exe)), "bin", os.path.basename(exe))
    return real if os.access(real, os.X_OK) else exe


def _recorded_version(exe: str, key: str | None) -> str | None:
    if key is None:
        return None
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(exe))), "versions.json")
    try:
        with open(path, encoding="utf-8") as f:
            version = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return version if isinstance(version, str) and version else None


def _start_probe(
    exe: str, argv: tuple[str, ...], env: Mapping[str, str]
) -> subprocess.Popen[str] | None:
    try:
        return subprocess.Popen(
            [exe, *argv],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    except OSError:
        return None


def _version(probe: subprocess.Popen[str] | None) -> str:
    if probe is None:
        return "unknown"
    try:
        out, _ = probe.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        probe.kill()
        probe.communicate()
        return "unknown"
    return out.strip().lstrip("v") or "unknown"


def prepare_scratch(scratch: str) -> None:
    """(Re)create what the scratch directory needs; user code may have removed it."""
    os.makedirs(scratch, mode=0o700, exist_ok=True)
    with open(os.path.join(scratch, "preload.mjs"), "w", encoding="utf-8") as f:
        f.write(PRELOAD)
    with open(os.path.join(scratch, "value.mjs"), "w", encoding="utf-8") as f:
        f.write(VALUE_PRELOAD)
    modules = _node_modules()
    if modules is None:
        return
    link = os.path.join(scratch, "node_modules")
    try:
        current: str | None = os.readlink(link)
    except OSError:
        current = None
    if current != modules:
        if os.path.isdir(link) and not os.path.islink(link):
            shutil.rmtree(link)
        elif os.path.lexists(link):
            os.unlink(link)
        os.symlink(modules, link)


def _node_modules() -> str | None:
    """The first ``NODE_PATH`` directory that exists: the session's packages, once
    installed, else the preinstalled ones."""
    for entry in os.environ.get("NODE_PATH", "").split(os.pathsep):
        if entry and os.path.isdir(entry):
            return entry
    return None


def command(language: str, exe: str, code: str, scratch: str) -> list[str]:
    """The argv that runs ``code`` in ``language``, writing its code file if it has one."""
    program = PROGRAMS[language]
    if program.suffix is None:
        return program.argv(exe, code, scratch)
    prepare_scratch(scratch)
    path = os.path.join(scratch, f"main{program.suffix}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(code)
    if language in VALUED:
        _plan_value(scratch, path, code)
    return program.argv(exe, path, scratch)


def _plan_value(scratch: str, main: str, code: str) -> None:
    """Write ``plan.json`` for :data:`VALUE_PRELOAD` when the code ends in an expression;
    remove what a run before left (its plan, its value)."""
    for name in ("plan.json", "value.txt"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(scratch, name))
    split = split_last(code)
    if split is None:
        return
    rewritten = rewrite(*split)
    plan = {"main": main, "code": rewritten, "check": check_source(rewritten)}
    with open(os.path.join(scratch, "plan.json"), "w", encoding="utf-8") as f:
        json.dump(plan, f)


def value(scratch: str, limit: int) -> str | None:
    """The value the last program left (:data:`VALUE_PRELOAD`), at most ``limit``
    characters with the cut marked; ``None`` when it left none. The file is the
    program's to write: read as bounded, untrusted text."""
    path = os.path.join(scratch, "value.txt")
    try:
        # Never a FIFO the program made there (an open would wait for its writer), nor a
        # link to somewhere else: a regular file, opened without following links.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit * 4 + 4)
            more = bool(f.read(1))
    except OSError:
        return None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
    text = data.decode("utf-8", "replace")
    if more or len(text) > limit:
        return cut_text(text + ("…" if more else ""), limit)[0]
    return text
