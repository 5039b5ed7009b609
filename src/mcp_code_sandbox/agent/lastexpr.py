"""The value of a JavaScript or TypeScript program's last expression, as a REPL shows it.

Node's REPL, Jupyter's JavaScript kernels and E2B's give a cell's last expression as its
value (``await Promise.resolve('Hello World!')``); a program run from a file gives none.
:func:`split_last` finds the last top-level statement with a small scanner (strings,
template literals, comments, regular expressions, brackets; a newline ends a statement
unless either side continues it) and :func:`rewrite` makes it assign its value to a
global that the preload (``languages.PRELOAD``) writes to a file when the program exits.

The scanner only proposes: the preload checks the rewrite with the interpreter's own
parser before it replaces the program (node: the rewritten program, its ``import`` and
``export`` blanked, compiled as an async function's body; bun: its TypeScript
transpiler). A program the scanner misreads runs as written and has no value; it never
runs differently. Standard library only.
"""

from __future__ import annotations

import re

__all__ = ["VALUE_KEY", "check_source", "rewrite", "split_last"]

#: The global the rewritten program assigns its last value to.
VALUE_KEY = "__mcs_last_value__"
#: A statement that starts with one of these is no expression (or, ``else`` and the
#: like, belongs to the one before).
_STATEMENTS = re.compile(
    r"(?:const|let|var|function|async\s+function|class|import(?!\s*[.(])|export|if|else|"
    r"for|while|do|switch|try|catch|finally|return|throw|break|continue|debugger|"
    r"interface|type\s+\w|enum|declare|namespace|abstract)\b"
    r"|[{};]|$"
)
#: A line that starts with one of these continues the statement before it.
_CONTINUES_NEXT = (*"([`+-*/%.,?:=<>&|^", "in ", "instanceof ", "as ")
#: A line that ends with one of these continues on the next.
_CONTINUES_PREV = (*"([{,.+-*/%=<>&|^?:!~", "=>")
#: After these a ``/`` starts a regular expression, not a division.
_REGEX_AFTER = set("(,=:[!&|?{};+-*%<>~^") | {""}
_KEYWORDS_BEFORE_REGEX = ("return", "typeof", "case", "do", "else", "in", "of", "void", "yield")


def split_last(code: str) -> tuple[str, str] | None:
    """``(before, last)``: the code up to the last top-level statement, and that
    statement when it is an expression (its ``;`` left out); ``None`` otherwise."""
    ends = _statement_ends(code)
    if ends is None:
        return None
    start = max((e for e in ends if code[e:].strip()), default=0)
    last = code[start:].strip()
    while last.endswith(";"):
        last = last[:-1].rstrip()
    if not last or _STATEMENTS.match(last):
        return None
    return code[:start], last


def rewrite(before: str, last: str) -> str:
    """The program with its last expression's value kept in :data:`VALUE_KEY`; no line
    of ``before`` moves, and ``last`` starts on the line it started on."""
    return f"{before}globalThis.{VALUE_KEY} = ({last}\n);\n"


def check_source(code: str) -> str:
    """``code`` as a node check compiles it as an async function's body: its top-level
    ``import`` and ``export`` keywords blanked (same length, so nothing moves)."""
    ends = _statement_ends(code) or []
    out = list(code)
    for start in [0, *ends]:
        text = code[start:]
        lead = len(text) - len(text.lstrip())
        match = re.match(r"import(?!\s*[.(])\b[^;]*?(?:from\s*)?(['\"]).*?\1|export\b", text[lead:])
        if match is None:
            continue
        at = start + lead
        if match.group(0) == "export":
            out[at : at + 6] = " " * 6
        else:
            out[at : at + match.end()] = " " * match.end()
    return "".join(out)


def _statement_ends(code: str) -> list[int] | None:
    """Where each top-level statement ends (the index after its ``;`` or newline);
    ``None`` when the scan ends inside a string, comment or bracket."""
    ends: list[int] = []
    depth: list[str] = []  # open brackets, and "${" of template literals
    i, n = 0, len(code)
    prev = ""  # the last significant character, for regular expressions
    while i < n:
        c = code[i]
        if c in "'\"":
            i = _skip_string(code, i)
            prev = c
            continue
        if c == "`":
            i = _skip_template(code, i, depth)
            prev = "`"
            continue
        if code.startswith("//", i):
            end = code.find("\n", i)
            i = n if end < 0 else end
            continue
        if code.startswith("/*", i):
            end = code.find("*/", i + 2)
            if end < 0:
                return None
            i = end + 2
            continue
        if c == "/" and (prev in _REGEX_AFTER or _word_before(code, i) in _KEYWORDS_BEFORE_REGEX):
            i = _skip_regex(code, i)
            prev = "/"
            continue
        if c in "([{":
            depth.append(c)
        elif c in ")]}":
            if not depth:
                return None
            opened = depth.pop()
            if opened == "${":  # the end of a template literal's ${...}: back inside it
                i = _skip_template(code, i, depth, resume=True)
                prev = "`"
                continue
        if not depth and (c == ";" or (c == "\n" and _ends_statement(code, i))):
            ends.append(i + 1)
        if not c.isspace():
            prev = c
        i += 1
    if depth:
        return None
    return ends


def _ends_statement(code: str, newline: int) -> bool:
    """Does the top-level newline at ``newline`` end a statement? Not when the line before
    ends with, or the line after starts with, what continues an expression."""
    before = code[:newline].rstrip()
    after = code[newline + 1 :].lstrip()
    if not before or not after:
        return False
    if before.endswith(("++", "--")) or after.startswith(("++", "--")):
        return True
    if before.endswith(_CONTINUES_PREV):
        return False
    return not after.startswith(_CONTINUES_NEXT)


def _word_before(code: str, i: int) -> str:
    match = re.search(r"([A-Za-z_$][\w$]*)\s*$", code[max(0, i - 24) : i])
    return match.group(1) if match else ""


def _skip_string(code: str, i: int) -> int:
    quote = code[i]
    i += 1
    while i < len(code):
        if code[i] == "\\":
            i += 2
            continue
        if code[i] == quote or code[i] == "\n":
            return i + 1
        i += 1
    return len(code)


def _skip_template(code: str, i: int, depth: list[str], resume: bool = False) -> int:
    """Past a template literal from its backquote (or from the ``}`` that ends one of
    its ``${...}``); at a ``${`` it returns inside it, with ``${`` on ``depth``."""
    i += 1
    while i < len(code):
        if code[i] == "\\":
            i += 2
            continue
        if code[i] == "`":
            return i + 1
        if code.startswith("${", i):
            depth.append("${")
            return i + 2
        i += 1
    depth.append("`")  # unterminated: the scan ends inside it
    return len(code)


def _skip_regex(code: str, i: int) -> int:
    i += 1
    in_class = False
    while i < len(code) and code[i] != "\n":
        if code[i] == "\\":
            i += 2
            continue
        if code[i] == "[":
            in_class = True
        elif code[i] == "]":
            in_class = False
        elif code[i] == "/" and not in_class:
            i += 1
            while i < len(code) and code[i].isalpha():
                i += 1
            return i
        i += 1
    return i
