"""Frozen dataclasses to and from plain JSON-able data, by their type hints:
what crosses a process boundary (observations) goes through here."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import sys
import types
import typing
from typing import Any, Callable, Union

_SCALARS = (str, int, float, bool, type(None))


def to_data(obj: Any) -> Any:
    """A dataclass as a dict (nested dataclasses too; tuples stay tuples,
    which JSON writes as lists): dataclasses.asdict's result, without its
    deep copy of every scalar (a third of an observation's round trip)."""
    if isinstance(obj, _SCALARS):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {name: to_data(getattr(obj, name)) for name in _field_names(type(obj))}
    if isinstance(obj, tuple):
        items = [to_data(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)  # a namedtuple keeps its type
    if isinstance(obj, list):
        return [to_data(v) for v in obj]
    if isinstance(obj, dict):
        return {to_data(k): to_data(v) for k, v in obj.items()}
    return copy.deepcopy(obj)


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def from_data(tp: Any, value: Any) -> Any:
    """``value`` (as JSON gives it back: lists, dicts) as an instance of the
    type hint ``tp``: dataclasses from dicts, tuples from lists."""
    if value is None:
        return None
    return _converter(tp)(value)


@functools.lru_cache(maxsize=None)
def _converter(tp: Any) -> Callable[[Any], Any]:
    """from_data for one type hint, its analysis done once per hint (each
    observation that crosses a process boundary converts dozens of values)."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        def dataclass_(value: Any) -> Any:
            if not isinstance(value, dict):
                return value  # already built
            hints = _hints(tp)
            return tp(**{k: from_data(hints.get(k, Any), v) for k, v in value.items()})
        return dataclass_
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        dataclasses_ = [a for a in options if isinstance(a, type) and dataclasses.is_dataclass(a)]
        tuples = [a for a in options if typing.get_origin(a) is tuple]
        keep_dicts = any(typing.get_origin(a) is dict or a is dict for a in options)

        def union(value: Any) -> Any:
            if isinstance(value, dict) and dataclasses_:  # the option whose shape the value has
                return from_data(dataclasses_[0], value)
            if isinstance(value, (list, tuple)) and tuples:
                return from_data(tuples[0], value)
            return value if keep_dicts else _tuples(value)
        return union
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = args[0]
            return lambda value: tuple(from_data(item, v) for v in value)
        if args:
            return lambda value: tuple(from_data(a, v) for a, v in zip(args, value))
        return _tuples
    if tp is dict or origin is dict:
        return lambda value: value
    return _tuples


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
