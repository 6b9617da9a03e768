"""Reading YAML config files into the components' config dataclasses."""

import types
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_type_hints

import yaml


def read_yaml(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a mapping at the top level")
    return data


def fill(cls: type, values: dict[str, Any] | None, where: str) -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys with a clear message."""
    values = dict(values or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SystemExit(f"{where}: unknown keys {unknown}; expected some of {sorted(known)}")
    hints = get_type_hints(cls)
    for name in known & set(values):
        sub = _dataclass_in(hints[name])
        if sub is not None and isinstance(values[name], dict):
            values[name] = fill(sub, values[name], f"{where}.{name}")
            continue
        item = _dataclass_values_of(hints[name])
        if item is not None and isinstance(values[name], dict):
            values[name] = {
                key: fill(item, body, f"{where}.{name}.{key}") if isinstance(body, dict) else body
                for key, body in values[name].items()
            }
    return cls(**values)


def _dataclass_values_of(hint: Any) -> type | None:
    """The dataclass X of a hint `dict[str, X]`."""
    args = get_args(hint)
    if getattr(hint, "__origin__", None) is dict and len(args) == 2:
        return _dataclass_in(args[1])
    return None


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass in a hint like `X` or `X | None`."""
    if isinstance(hint, type) and is_dataclass(hint):
        return hint
    if isinstance(hint, types.UnionType):
        return next((a for a in get_args(hint) if isinstance(a, type) and is_dataclass(a)), None)
    return None
