"""The agent's markdown table of a DataFrame (``agent/tables.py``), on a stand-in that has
the few methods of pandas' DataFrame the agent uses (pandas is the sandbox's, not the
host's; the e2e tests use the real one)."""

from __future__ import annotations

from typing import Any

from mcp_code_sandbox.agent.tables import MAX_CELL_CHARS, dataframe_markdown


class _Index(list[Any]):
    name: str | None = None


class _ILoc:
    def __init__(self, frame: DataFrame) -> None:
        self.frame = frame

    def __getitem__(self, key: tuple[slice | list[int], slice | int]) -> Any:
        rows, cols = key
        if isinstance(rows, list):
            picked, index = [self.frame.rows[i] for i in rows], [self.frame.index[i] for i in rows]
        else:
            picked, index = self.frame.rows[rows], self.frame.index[rows]
        if isinstance(cols, int):  # a column: a Series, here its values
            return [r[cols] for r in picked]
        kept = list(range(len(self.frame.columns)))[cols]
        return DataFrame({self.frame.columns[c]: [r[c] for r in picked] for c in kept}, index)


class DataFrame:
    __module__ = "pandas.core.frame"

    def __init__(self, data: dict[str, list[Any]], index: list[Any] | None = None) -> None:
        self.columns = list(data)
        self.rows = [list(r) for r in zip(*data.values(), strict=True)] if data else []
        self.index = _Index(index if index is not None else range(len(self.rows)))
        self.iloc = _ILoc(self)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), len(self.columns)

    def itertuples(self, index: bool, name: None) -> Any:
        return ((i, *r) for i, r in zip(self.index, self.rows, strict=True))


def test_a_small_frame_is_a_whole_table_with_pipes_and_newlines_escaped() -> None:
    frame = DataFrame({"a|b": [1, 2], "text": ["x\ny", "z" * 100]})
    table = dataframe_markdown(frame)
    assert table is not None
    lines = table.splitlines()
    assert lines[:3] == ["|  | a\\|b | text |", "| --- | --- | --- |", "| 0 | 1 | x y |"]
    assert lines[3] == f"| 1 | 2 | {'z' * (MAX_CELL_CHARS - 1)}… |" and len(lines) == 4


def test_a_large_frame_shows_head_and_tail_and_says_its_size() -> None:
    frame = DataFrame({f"c{i}": list(range(100)) for i in range(30)})
    table = dataframe_markdown(frame)
    assert table is not None
    lines = table.splitlines()
    assert lines[0].count("|") == 22  # the index and 20 columns
    assert lines[2].startswith("| 0 | 0 |") and "| … |" in lines[12]
    assert lines[13].startswith("| 90 | 90 |") and lines[22].startswith("| 99 |")
    assert lines[-1] == "100 rows × 30 columns (shown: 20 rows, 20 columns)"


def test_only_pandas_frames_and_frames_that_work() -> None:
    class Broken(DataFrame):
        __module__ = "pandas.core.frame"

        @property
        def shape(self) -> tuple[int, int]:
            raise RuntimeError("no")

    Broken.__name__ = "DataFrame"
    assert dataframe_markdown(Broken({"a": [1]})) is None
    assert dataframe_markdown({"a": [1]}) is None
    impostor = type("DataFrame", (), {"__module__": "mine"})()
    assert dataframe_markdown(impostor) is None
