"""Finding a JavaScript or TypeScript program's last expression (``agent/lastexpr.py``):
pure functions; the interpreters' own check and the value itself are tested in real
sandboxes (``tests/integration/test_languages.py``)."""

from __future__ import annotations

import pytest

from mcp_code_sandbox.agent.lastexpr import VALUE_KEY, check_source, rewrite, split_last


@pytest.mark.parametrize(
    ("code", "last"),
    [
        ("await Promise.resolve('Hello World!')", "await Promise.resolve('Hello World!')"),
        ("const x = 5\nx * 2", "x * 2"),
        ("let a = 1;\na + 1;", "a + 1"),
        ("function f() {\n  return 1\n}\nf()", "f()"),
        ("const o = {\n  a: 1,\n}\no.a", "o.a"),
        # A line that starts or ends with an operator continues the one before.
        ("const x = 1\n  + 2", None),
        ("x = 1\n-1", "x = 1\n-1"),
        ("items\n  .map(i => i * 2)", "items\n  .map(i => i * 2)"),
        # Strings, templates, comments and regular expressions hide their brackets.
        ("const s = `a ${ {b: '}'}.b } c`\ns", "s"),
        ("const r = /[;'\"]/g // ;\n'a;b'.replace(r, '')", "'a;b'.replace(r, '')"),
        ("/* ; */ 1 + 1", "/* ; */ 1 + 1"),
        # Statements have no value.
        ("const x = 1", None),
        ("if (x) { y }", None),
        ("import fs from 'node:fs'", None),
        ("export const a = 1", None),
        ("type A = string", None),
        # What the scanner cannot follow: no value, and the program runs as written.
        ("const s = 'unterminated", None),
        ("f(", None),
    ],
)
def test_the_last_statement_when_it_is_an_expression(code: str, last: str | None) -> None:
    found = split_last(code)
    assert (found[1] if found else None) == last


def test_the_rewrite_moves_no_line() -> None:
    before, last = split_last("const a = 1\n\nthrow a\n;a * 2") or ("", "")
    rewritten = rewrite(before, last)
    assert rewritten.splitlines()[:3] == ["const a = 1", "", "throw a"]
    assert rewritten.splitlines()[3] == f";globalThis.{VALUE_KEY} = (a * 2"


def test_the_node_check_blanks_module_syntax_only() -> None:
    code = "import fs from 'node:fs'\nexport const x = 1\nawait import('y')\nx"
    checked = check_source(code)
    assert len(checked) == len(code)
    assert checked.splitlines()[1:] == ["       const x = 1", "await import('y')", "x"]
    assert not checked.splitlines()[0].strip()
