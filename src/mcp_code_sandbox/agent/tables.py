"""A pandas DataFrame as a bounded markdown table: what an LLM reads best.

Standard library only: pandas is the sandbox's, not ours, so the frame is read through
its own methods (``shape``, ``iloc``, ``columns``, ``index``, ``itertuples``) and
recognised by its type's name, never imported (``tabulate``, which ``to_markdown``
needs, is not in the image). Bounded in rows (head and tail), columns and cell width,
whatever the frame holds; any failure of the frame's own methods means no table.
"""

from __future__ import annotations

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
    if rows > MAX_ROWS:
        half = MAX_ROWS // 2
        parts = [frame.iloc[:half, :shown_cols], frame.iloc[rows - half :, :shown_cols]]
    else:
        parts = [frame.iloc[:, :shown_cols]]
    index_name = frame.index.name
    header = [_cell("" if index_name is None else index_name)]
    header += [_cell(c) for c in parts[0].columns]
    lines = [_row(header), _row(["---"] * len(header))]
    for number, part in enumerate(parts):
        if number:
            lines.append(_row(["…"] * len(header)))
        for values in part.itertuples(index=True, name=None):
            lines.append(_row([_cell(v) for v in values]))
    if rows > MAX_ROWS or cols > shown_cols:
        lines.append("")
        lines.append(
            f"{rows} rows × {cols} columns (shown: {min(rows, MAX_ROWS)} rows, "
            f"{shown_cols} columns)"
        )
    return "\n".join(lines)


def _cell(value: object) -> str:
    text = str(value)
    if len(text) > MAX_CELL_CHARS:
        text = text[: MAX_CELL_CHARS - 1] + "…"
    # A pipe would end the cell, a newline the row.
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
