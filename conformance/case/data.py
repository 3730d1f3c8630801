"""Frozen dataclasses to and from plain JSON-able data, by their type hints:
what crosses a process boundary (observations) goes through here."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import types
import typing
from typing import Any, Union


def to_data(obj: Any) -> Any:
    """A dataclass as a dict (nested dataclasses too; tuples stay tuples,
    which JSON writes as lists)."""
    return dataclasses.asdict(obj)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def from_data(tp: Any, value: Any) -> Any:
    """``value`` (as JSON gives it back: lists, dicts) as an instance of the
    type hint ``tp``: dataclasses from dicts, tuples from lists."""
    if value is None:
        return None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            return value  # already built
        hints = _hints(tp)
        return tp(**{k: from_data(hints.get(k, Any), v) for k, v in value.items()})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        for a in options:  # the option whose shape the value has
            if isinstance(value, dict) and isinstance(a, type) and dataclasses.is_dataclass(a):
                return from_data(a, value)
            if isinstance(value, (list, tuple)) and typing.get_origin(a) is tuple:
                return from_data(a, value)
        return _tuples(value) if not any(typing.get_origin(a) is dict or a is dict for a in options) else value
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_data(args[0], v) for v in value)
        if args:
            return tuple(from_data(a, v) for a, v in zip(args, value))
        return _tuples(value)
    if tp is dict or origin is dict:
        return value
    return _tuples(value)


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


class Record:
    """Mixin for a frozen dataclass that crosses process boundaries:
    ``to_dict`` / ``from_dict`` / ``to_json`` by its type hints."""

    def to_dict(self) -> dict:
        return to_data(self)

    @classmethod
    def from_dict(cls, d: dict):
        return from_data(cls, d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)
