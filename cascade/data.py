"""Routing-label datasets: (prompt, weak_ok, strong_ok[, group]) rows from CSV or JSONL.

Accepted layouts for `load_dataset(path)`:
- one `.csv` or `.jsonl` file;
- a directory of them, searched recursively (the RouteLLM layout: one CSV per subject).

Columns (JSONL keys): `prompt` (or, in JSONL, a chat `messages` list), the weak model's
correctness (`weak_ok`, or RouteLLM's `mistralai/Mixtral-8x7B-Instruct-v0.1`), the
strong model's (`strong_ok`, or `gpt-4-1106-preview`), optionally `group` (or `subject`,
`tenant`) and `max_tokens`. Without a group column the group is the file's path
relative to `path`, without suffix (the subject, in the RouteLLM layout).
"""

import csv
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cascade.features import RequestView, request_view

log = logging.getLogger(__name__)

WEAK_COLUMNS = ("weak_ok", "mistralai/Mixtral-8x7B-Instruct-v0.1")
STRONG_COLUMNS = ("strong_ok", "gpt-4-1106-preview")
GROUP_COLUMNS = ("group", "subject", "tenant")
_TRUE = {"true", "1", "yes", "y", "t", "1.0"}
_FALSE = {"false", "0", "no", "n", "f", "0.0", ""}


class DatasetError(Exception):
    """A dataset that cannot be read: `path` and, when known, the 1-based `row`."""

    def __init__(self, message: str, path: Path, row: int | None = None) -> None:
        where = f"{path}" + (f", row {row}" if row is not None else "")
        super().__init__(f"{where}: {message}")
        self.path = path
        self.row = row


@dataclass(frozen=True, slots=True)
class Example:
    """One labelled request. `needs_large`: the weak model failed where the strong one did
    not, the label the classifier learns."""

    view: RequestView
    weak_ok: bool
    strong_ok: bool
    group: str

    @property
    def needs_large(self) -> bool:
        return (not self.weak_ok) and self.strong_ok


@dataclass(frozen=True, slots=True)
class Dataset:
    examples: list[Example]
    source: str
    sha256: str  # over the relative names and bytes of every file read

    @property
    def groups(self) -> list[str]:
        return [e.group for e in self.examples]


def _as_bool(value: object, column: str, path: Path, row: int) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise DatasetError(f"column {column!r}: {value!r} is not a boolean", path, row)


def _pick(row: dict, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in row), None)


def _example(raw: dict, default_group: str, path: Path, row: int) -> Example:
    weak_col, strong_col = _pick(raw, WEAK_COLUMNS), _pick(raw, STRONG_COLUMNS)
    if weak_col is None or strong_col is None:
        raise DatasetError(
            f"needs columns {WEAK_COLUMNS[0]!r} and {STRONG_COLUMNS[0]!r} "
            f"(or RouteLLM's {WEAK_COLUMNS[1]!r}, {STRONG_COLUMNS[1]!r})",
            path,
            row,
        )
    messages = raw.get("messages")
    prompt = raw.get("prompt")
    if not isinstance(prompt, str) and not isinstance(messages, list):
        raise DatasetError("needs a string 'prompt' or a list 'messages'", path, row)
    max_tokens = raw.get("max_tokens")
    try:
        max_tokens = int(float(max_tokens)) if max_tokens not in (None, "") else None
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"max_tokens {max_tokens!r} is not a number", path, row) from exc
    group_col = _pick(raw, GROUP_COLUMNS)
    group = str(raw[group_col]) if group_col and raw[group_col] not in (None, "") else None
    return Example(
        view=request_view(prompt if isinstance(prompt, str) else "", messages, max_tokens),
        weak_ok=_as_bool(raw[weak_col], weak_col, path, row),
        strong_ok=_as_bool(raw[strong_col], strong_col, path, row),
        group=group or default_group,
    )


def _rows(path: Path) -> Iterator[dict]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as fh:
            for num, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DatasetError(f"bad JSON: {exc}", path, num) from exc
    else:
        with path.open(encoding="utf-8", newline="") as fh:
            yield from csv.DictReader(fh)


def load_dataset(path: str | Path) -> Dataset:
    """Read every row of `path` (file or directory; see the module docstring)."""
    root = Path(path)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.suffix in (".csv", ".jsonl"))
    elif root.is_file():
        files = [root]
    else:
        raise DatasetError("no such file or directory", root)
    if not files:
        raise DatasetError("no .csv or .jsonl files", root)
    digest = hashlib.sha256()
    examples: list[Example] = []
    for file in files:
        rel = file.relative_to(root) if root.is_dir() else Path(file.name)
        digest.update(str(rel).encode() + b"\0" + file.read_bytes() + b"\0")
        group = str(rel.with_suffix(""))
        examples.extend(_example(r, group, file, i) for i, r in enumerate(_rows(file), 1))
    if not examples:
        raise DatasetError("no rows", root)
    ds = Dataset(examples, str(root), digest.hexdigest())
    log.info(
        "read %d examples in %d groups from %d file(s) under %s (sha256 %s…)",
        len(examples),
        len(set(ds.groups)),
        len(files),
        root,
        ds.sha256[:12],
    )
    return ds
