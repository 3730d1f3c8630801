"""Helpers shared by the strategy modules: argument checks, cached integer
strategies, and an index over a drawn tree."""

from __future__ import annotations

from typing import Any, Iterable

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.strategies import SearchStrategy

from conformance.case.spec import LEAF_TYPES, ClassSpec, ModuleSpec, ParamSpec
from conformance.case.tree import join

# Prefixes that mark a module as an adapter (LoRA-like): its parameters are the
# trainable ones under the "adapters" freeze mask.
ADAPTER_PREFIXES = ("lora", "adapter")


# ---- argument validation ---------------------------------------------------


def check_int(value: Any, name: str, *, min_value: int, max_value: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name}={value!r} must be an int")
    if value < min_value or (max_value is not None and value > max_value):
        upper = "" if max_value is None else f" and <= {max_value}"
        raise InvalidArgument(f"{name}={value!r} must be >= {min_value}{upper}")


def check_bool(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name}={value!r} must be True or False")


def check_strategy(value: Any, name: str) -> None:
    if not isinstance(value, SearchStrategy):
        raise InvalidArgument(
            f"{name}={value!r} must be a SearchStrategy (e.g. st.just({value!r}))"
        )


def check_kinds(value: Any, name: str, allowed: tuple) -> tuple:
    """A non-empty collection of distinct members of ``allowed``, as a tuple in
    ``allowed``'s order (so the simplest kind stays first whatever the caller's order)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgument(f"{name}={value!r} must be a collection drawn from {allowed!r}")
    items = list(value)
    bad = [v for v in items if v not in allowed]
    if bad:
        raise InvalidArgument(f"{name} has unknown kinds {bad!r}; choose from {allowed!r}")
    if not items:
        raise InvalidArgument(f"{name} must not be empty; choose from {allowed!r}")
    return tuple(k for k in allowed if k in items)


def check_tree(tree: Any, classes: Any) -> None:
    if not isinstance(tree, ModuleSpec):
        raise InvalidArgument(f"tree={tree!r} must be a ModuleSpec")
    if not isinstance(classes, tuple) or not all(isinstance(c, ClassSpec) for c in classes):
        raise InvalidArgument(f"classes={classes!r} must be a tuple of ClassSpec")


# ---- cheap strategies --------------------------------------------------------

# One strategy object per bound: creating st.integers() per draw costs more
# than the draw itself.
_INTS: dict[int, SearchStrategy[int]] = {}


def ints(max_value: int) -> SearchStrategy[int]:
    """st.integers(0, max_value), cached."""
    s = _INTS.get(max_value)
    if s is None:
        s = _INTS[max_value] = st.integers(0, max_value)
    return s


def pick(draw: Any, items: list | tuple) -> Any:
    """One of ``items``, shrinking to the first; no choice is recorded for one item."""
    if len(items) == 1:
        return items[0]
    return items[draw(ints(len(items) - 1))]


def pick_subset(draw: Any, items: list | tuple, *, min_size: int, max_size: int) -> list:
    """A subset of ``items`` in their order: a size, then that many picks
    (repeats dropped); shrinks towards fewer, earlier items."""
    max_size = min(max_size, len(items))
    if max_size <= 0:
        return []
    min_size = min(min_size, max_size)
    count = min_size + (draw(ints(max_size - min_size)) if max_size > min_size else 0)
    chosen = {draw(ints(len(items) - 1)) if len(items) > 1 else 0 for _ in range(count)}
    return [items[i] for i in sorted(chosen)]


def maybe(draw: Any, strength: int = 2) -> bool:
    """A biased coin that shrinks to False: True with probability about
    1 - 1/(strength+1) of draws away from the simplest."""
    return draw(ints(strength)) != 0


# ---- an index over one tree ----------------------------------------------------


class TreeIndex:
    """Paths, parents, depths, classes and parameters of one tree, computed once."""

    __slots__ = ("tree", "classes", "paths", "modules", "parent", "children", "depth", "kind", "drawn", "params", "param_owner")

    def __init__(self, tree: ModuleSpec, classes: tuple[ClassSpec, ...]) -> None:
        self.tree = tree
        self.classes = classes
        bases = {c.name: c.base for c in classes}
        self.paths: list[str] = []
        self.modules: dict[str, ModuleSpec] = {}
        self.parent: dict[str, str | None] = {}
        self.children: dict[str, list[str]] = {}
        self.depth: dict[str, int] = {}
        self.kind: dict[str, str] = {}  # container kind, or the leaf type
        self.drawn: set[str] = set()  # paths whose class is a drawn class
        self.params: dict[str, ParamSpec] = {}  # FQN -> spec, registration order
        self.param_owner: dict[str, str] = {}  # FQN -> module path
        stack: list[tuple[str, ModuleSpec, str | None, int]] = [("", tree, None, 0)]
        while stack:
            path, m, parent, depth = stack.pop()
            self.paths.append(path)
            self.modules[path] = m
            self.parent[path] = parent
            self.depth[path] = depth
            cls = m.cls
            if cls in bases:
                self.drawn.add(path)
                while cls in bases:
                    cls = bases[cls]
            self.kind[path] = cls
            for p in m.params:
                fqn = join(path, p.name)
                self.params[fqn] = p
                self.param_owner[fqn] = path
            kids = [join(path, c.name) for c in m.children]
            self.children[path] = kids
            stack.extend((k, c, path, depth + 1) for k, c in zip(reversed(kids), reversed(m.children)))

    def is_ancestor(self, a: str, b: str) -> bool:
        """a is a proper ancestor of b."""
        return a != b and (a == "" or b.startswith(a + "."))

    def can_hold_params(self, path: str) -> bool:
        """A drawn module whose forward reads its parameters (not a list-like container)."""
        return path in self.drawn and self.kind[path] in ("Module", "ModuleDict")

    def is_leaf(self, path: str) -> bool:
        return self.kind[path] in LEAF_TYPES

    def is_adapter(self, path: str) -> bool:
        return any(part.startswith(ADAPTER_PREFIXES) for part in path.split(".")) if path else False


# A torch release for drawing only: whether a tie split between groups is
# avoided does not depend on the installed torch.
ANY_TORCH = "2.13.0"
