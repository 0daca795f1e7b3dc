"""Turning a config value as it arrives (YAML, environment text, a dict) into its field's type.

``coerce(name, value, hint)`` accepts what a person would write for the field's type hint
(``bool``, ``int``, ``float``, ``str``, ``list[X]``, ``dict[...]``, each optionally ``| None``) and
raises a ``ConfigError`` naming the field for anything else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, get_args, get_origin

import yaml

from kvtier.core.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE_TEXT = ("", "none", "null")


def coerce(name: str, value: Any, hint: Any) -> Any:
    """Turn ``value`` (from YAML, env text, or a dict) into the field's type, or raise."""
    origin, args = get_origin(hint), get_args(hint)
    if args and type(None) in args:  # Optional[X]
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_TEXT):
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(name, value, inner[0])
    scalar = _SCALARS.get(hint)
    if scalar is not None:
        return scalar(name, value)
    if origin is list:
        return _to_list(name, value, args[0])
    if origin is dict:
        return _to_dict(name, value)
    raise ConfigError(name, value, f"has an unsupported type {hint}")


def _to_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(name, value, "must be a boolean (true/false)")


def _to_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(name, value, "must be an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ConfigError(name, value, "must be an integer")


def _to_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(name, value, "must be a number")
    number: float | None = None
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            pass
    if number is None:
        raise ConfigError(name, value, "must be a number")
    if not math.isfinite(number):
        raise ConfigError(name, value, "must be a finite number")
    return number


def _to_str(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ConfigError(name, value, "must be a string")


def _to_list(name: str, value: Any, item_hint: Any) -> list[Any]:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list | tuple):
        raise ConfigError(name, value, "must be a list (or a comma-separated string)")
    return [coerce(name, v, item_hint) for v in value]


def _to_dict(name: str, value: Any) -> dict[Any, Any]:
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(name, value, f"is not a YAML/JSON mapping: {e}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(name, value, "must be a mapping")
    return dict(value)


_SCALARS: dict[Any, Callable[[str, Any], Any]] = {
    bool: _to_bool,
    int: _to_int,
    float: _to_float,
    str: _to_str,
}
