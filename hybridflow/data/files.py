"""Reading tabular data files (parquet, jsonl) into records that remember their file and row.

Every dataset reads through `read_records`, so every data error can name where it happened:
`DataError("data/train.parquet, row 12, column 'prompt': ...")`. Rows are numbered from 0 in each file;
a jsonl record also names its line (blank lines are skipped).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUFFIXES = (".parquet", ".jsonl")


class DataError(ValueError):
    """A malformed data file or row; the message names the file, the row, the column and what was expected."""


@dataclass
class Record:
    """One row of a data file: its fields and where it came from."""

    data: dict[str, Any]
    file: str
    row: int
    line: int | None = None

    @property
    def where(self) -> str:
        """`"train.jsonl, row 3 (line 4)"` / `"train.parquet, row 3"`."""
        line = f" (line {self.line})" if self.line is not None else ""
        return f"{self.file}, row {self.row}{line}"

    def error(self, column: str, expected: str, value: Any = None, show_value: bool = True) -> DataError:
        """A `DataError` naming this row, `column` and what was `expected` (and the value found)."""
        got = ""
        if show_value:
            text = repr(value)
            got = f", got {type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
        return DataError(f"{self.where}, column '{column}': expected {expected}{got}")

    def has(self, column: str) -> bool:
        """Whether the row holds `column`: a top-level column, or a dotted path into nested mappings
        (``extra_info.question``: verl's SFT ``prompt_dict_keys``)."""
        return self._walk(column) is not _MISSING

    def require(self, column: str, key: str = "") -> Any:
        """The value of `column` (or of a dotted path, as `has`), or a `DataError` naming the columns this row has
        and the config `key` that names the column (``data.prompt_key``), if any."""
        value = self._walk(column)
        if value is _MISSING:
            have = ", ".join(self.data) or "none"
            mapped = f"set {key} to the column holding it; " if key else ""
            raise DataError(f"{self.where}: missing column '{column}' ({mapped}columns: {have})")
        return value

    def _walk(self, column: str) -> Any:
        if column in self.data or "." not in column:
            return self.data.get(column, _MISSING)
        node: Any = self.data
        for part in column.split("."):
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return node


_MISSING = object()


def as_path_list(files: str | Path | Sequence[str | Path]) -> list[str]:
    """One path or a sequence of paths -> a non-empty list of path strings."""
    paths = [str(files)] if isinstance(files, (str, Path)) else [str(f) for f in files]
    if not paths:
        raise DataError("no data files given (expected one path or a list of .parquet / .jsonl paths)")
    return paths


def _read_parquet(path: str) -> list[Record]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: cannot read as parquet: {e}") from None
    return [Record(row, path, i) for i, row in enumerate(rows)]


def _read_jsonl(path: str) -> list[Record]:
    records: list[Record] = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read as UTF-8 text: {e}") from None
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        row = len(records)
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}, row {row} (line {line_no}): not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise DataError(f"{path}, row {row} (line {line_no}): expected a JSON object per line, "
                            f"got {type(value).__name__}")
        record = Record(value, path, row, line_no)
        for column, item in value.items():
            _check_unicode(record, column, item)
        records.append(record)
    return records


def _check_unicode(record: Record, column: str, value: Any) -> None:
    """Refuses a string holding a lone surrogate (a JSON escape such as ``\\ud83d`` without its pair),
    which no tokenizer can encode, naming the row, the column and the character's position."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f"{record.where}, column '{column}': the text holds a lone surrogate "
                            f"{value[e.start]!r} at character {e.start} (half of a UTF-16 pair escaped as "
                            f"\\u{ord(value[e.start]):04x} without its other half); fix the file's text, e.g. "
                            f"re-export it with ensure_ascii=False from valid strings") from None
    elif isinstance(value, dict):
        for item in value.values():
            _check_unicode(record, column, item)
    elif isinstance(value, list):
        for item in value:
            _check_unicode(record, column, item)


def read_records(files: str | Path | Sequence[str | Path]) -> list[Record]:
    """All rows of one file or several, in order; unreadable or unsupported files raise `DataError`."""
    records: list[Record] = []
    for path in as_path_list(files):
        if Path(path).is_dir():
            raise DataError(f"{path}: is a directory, not a data file; give a .parquet or .jsonl file")
        if not Path(path).is_file():
            raise DataError(f"{path}: file not found")
        suffix = Path(path).suffix.lower()
        if suffix == ".parquet":
            records += _read_parquet(path)
        elif suffix == ".jsonl":
            records += _read_jsonl(path)
        else:
            raise DataError(f"{path}: unsupported file type '{suffix}'; expected one of {', '.join(SUFFIXES)}")
    return records
