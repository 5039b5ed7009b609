"""A pandas DataFrame as a bounded markdown table: what an LLM reads best.

Standard library only: pandas is the sandbox's, not ours, so the frame is read through
its own methods (``shape``, ``iloc``, ``columns``, ``index``, ``itertuples``) and
recognised by its type's name, never imported (``tabulate``, which ``to_markdown``
needs, is not in the image). Bounded in rows (head and tail), columns and cell width,
whatever the frame holds; any failure of the frame's own methods means no table. Values
read as pandas prints them (its formatter, ``pandas.io.formats.format``, which the frame's
own repr uses and which is imported with it).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["MAX_CELL_CHARS", "MAX_COLUMNS", "MAX_ROWS", "dataframe_markdown"]

#: Rows shown: the first and last half of this when the frame is longer.
MAX_ROWS = 20
MAX_COLUMNS = 20
MAX_CELL_CHARS = 40


def dataframe_markdown(obj: object) -> str | None:
    """``obj`` as a markdown table when it is a pandas DataFrame, else ``None``."""
    kind = type(obj)
    if kind.__name__ != "DataFrame" or not kind.__module__.startswith("pandas"):
        return None
    try:
        return _table(obj)
    except Exception:  # a frame whose own methods fail: the text repr says enough
        return None


def _table(frame: Any) -> str:
    rows, cols = (int(n) for n in frame.shape)
    shown_cols = min(cols, MAX_COLUMNS)
    half = MAX_ROWS // 2
    positions = list(range(rows)) if rows <= MAX_ROWS else [*range(half), *range(rows - half, rows)]
    shown = frame.iloc[positions, :shown_cols]
    index_name = frame.index.name
    header = [_cell("" if index_name is None else index_name)]
    header += [_cell(c) for c in shown.columns]
    columns = [_formatted(shown.iloc[:, j]) for j in range(shown_cols)]
    index = [str(v) for v in shown.index]
    lines = [_row(header), _row(["---"] * len(header))]
    for i, label in enumerate(index):
        if rows > MAX_ROWS and i == half:
            lines.append(_row(["…"] * len(header)))
        lines.append(_row([_cell(label), *(_cell(column[i]) for column in columns)]))
    if rows > MAX_ROWS or cols > shown_cols:
        lines.append("")
        lines.append(
            f"{rows} rows × {cols} columns (shown: {min(rows, MAX_ROWS)} rows, "
            f"{shown_cols} columns)"
        )
    return "\n".join(lines)


def _formatted(column: Any) -> list[str]:
    """The column's values as pandas prints them (``177.4885``, not the float's repr
    ``177.48850000000002``; one number of decimals per column), through pandas' own
    formatter, already imported with the frame; ``str`` of each value where it fails."""
    formats = sys.modules.get("pandas.io.formats.format")
    try:
        texts = formats.format_array(column._values, None)  # type: ignore[union-attr]
        out = [str(text).strip() for text in texts]
        if len(out) == len(column):
            return out
    except Exception:  # noqa: S110 - another pandas: plain str() below
        pass
    return [str(v) for v in column]


def _cell(value: object) -> str:
    text = str(value)
    if len(text) > MAX_CELL_CHARS:
        text = text[: MAX_CELL_CHARS - 1] + "…"
    # A pipe would end the cell, a newline the row.
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
