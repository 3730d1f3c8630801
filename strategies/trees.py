"""Strategies for module trees: drawn classes and their hierarchy, containers,
torch leaf modules, parameters and buffers."""

from __future__ import annotations

import threading
from typing import Any

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from conformance.case.spec import BufferSpec, ClassSpec, ModuleSpec, ParamSpec
from conformance.strategies._common import check_int, ints, pick

# Readable class names, taken in order; a container class gets a suffix.
CLASS_NAMES = (
    "Model", "Block", "Layer", "Attention", "MLP", "Adapter", "Head", "Encoder",
    "Decoder", "Expert", "Router", "Stem", "Tower", "Gate", "Mixer", "Cell",
)
_SUFFIX = {"Module": "", "ModuleList": "List", "Sequential": "Seq", "ModuleDict": "Dict"}
ROOT_KINDS = ("Module", "ModuleDict", "Sequential", "ModuleList")
MAX_CHILDREN = 4

# Shapes are built from two per-tree dimensions a and b (drawn 1..8), so that
# shapes often coincide (ties need equal shapes) and shrink together.
_LINEAR = (("a", "a", False), ("a", "a", True), ("b", "a", True), ("a", "b", True), ("b", "b", False), ("b", "a", False), ("a", "b", False), ("b", "b", True))
_LORA = (("a", "b", False), ("b", "a", False), ("a", "a", False))
_EMBEDDING = (("a", "a"), ("b", "a"), ("a", "b"), ("b", "b"))
_LAYERNORM = ("a", "b")
# A child is one choice: its kind and, for a torch leaf, its shape template.
# Simplest first (a shrunk child is a bias-free square Linear). "module" is a
# drawn class deriving (perhaps via other drawn classes) from nn.Module; "lora"
# a Linear named as an adapter. Inner kinds repeat so that about two children in
# five have children of their own.
_INNER = ("module", "ModuleList", "module", "Sequential", "module", "ModuleDict")
_LEAVES = (
    tuple(("Linear", t) for t in _LINEAR)
    + tuple(("LayerNorm", t) for t in _LAYERNORM)
    + tuple(("Embedding", t) for t in _EMBEDDING)
    + tuple(("lora", t) for t in _LORA)
)
_LEAF_CHILDREN = _LEAVES[:1] + (("module", None),) + _LEAVES[1:] + (("module", None),)
CHILD_OPTIONS = _LEAVES[:1] + tuple((k, None) for k in _INNER) + _LEAVES[1:] + tuple((k, None) for k in _INNER)
# A drawn module's own parameters (name, shape) and buffers, simplest first.
_PARAMS = (
    (),
    (("weight", ("a", "b")),),
    (("weight", ("a", "b")), ("bias", ("a",))),
    (("scale", ("b",)),),
    (("weight", ("b", "a")), ("bias", ("b",))),
    (("weight", ("a", "a")), ("bias", ("a",)), ("scale", ("b",))),
)
_OWN = tuple((p, False) for p in _PARAMS) + tuple((p, True) for p in _PARAMS[:3])
_TORCH_PREFIX = {"ModuleList": "layers", "Sequential": "seq", "ModuleDict": "blocks"}
_CHILD_PREFIX = {"Linear": "proj", "lora": "lora", "Embedding": "embed", "LayerNorm": "norm"}


class _Builder:
    """Mutable state of one tree draw: remaining budget and the classes so far."""

    def __init__(self, max_modules: int, max_depth: int, a: int, b: int) -> None:
        self.remaining = max_modules
        self.max_depth = max_depth
        self.dims = {"a": a, "b": b}
        self.classes: list[ClassSpec] = []
        self.by_kind: dict[str, list[str]] = {k: [] for k in _SUFFIX}
        self.pending: tuple = ()  # the next child's (kinds, name, index, depth)

    def shape(self, symbols: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(self.dims[s] for s in symbols)

    def new_class(self, kind: str, base: str) -> str:
        i = len(self.classes)
        n = len(CLASS_NAMES)
        name = CLASS_NAMES[i % n] + (str(i // n) if i >= n else "") + _SUFFIX[kind]
        self.classes.append(ClassSpec(name, base))
        self.by_kind[kind].append(name)
        return name

    def class_options(self, kind: str, *, torch_ok: bool) -> list[tuple[str, str | None]]:
        """(class, None) to reuse a class (or take torch's own container), ("",
        base) to define one deriving from torch's base or from a drawn class of
        the same kind; simplest first."""
        existing = self.by_kind[kind]
        options: list[tuple[str, str | None]] = []
        if torch_ok and kind != "Module":
            options.append((kind, None))  # torch's own container
        options += [(c, None) for c in existing]
        options.append(("", kind))
        options += [("", c) for c in existing]
        return options

    def make_class(self, kind: str, option: tuple[str, str | None]) -> str:
        cls, base = option
        return cls if base is None else self.new_class(kind, base)


def _leaf(b: _Builder, kind: str, template: Any, name: str) -> ModuleSpec:
    if kind in ("Linear", "lora"):
        out, inp, bias = template
        params = (ParamSpec("weight", b.shape((out, inp))),)
        if bias:
            params += (ParamSpec("bias", b.shape((out,))),)
        return ModuleSpec(name, "Linear", params)
    if kind == "Embedding":
        return ModuleSpec(name, "Embedding", (ParamSpec("weight", b.shape(template)),))
    d = b.shape((template,))
    return ModuleSpec(name, "LayerNorm", (ParamSpec("weight", d), ParamSpec("bias", d)))


def _node(draw: Any, b: _Builder, option: tuple[str, Any], name: str | None, index: int, depth: int) -> ModuleSpec:
    """One module of kind ``option[0]`` and its subtree. ``name`` None: derive
    it from the class (prefix + index), for a parent whose children are not
    positional."""
    b.remaining -= 1
    kind = option[0]
    if kind in _CHILD_PREFIX:
        return _leaf(b, kind, option[1], f"{_CHILD_PREFIX[kind]}{index}" if name is None else name)
    ckind = "Module" if kind == "module" else kind
    options = b.class_options(ckind, torch_ok=depth > 0)
    params: tuple[ParamSpec, ...] = ()
    buffers: tuple[BufferSpec, ...] = ()
    if ckind in ("Module", "ModuleDict"):
        # The class and the module's own parameters in one choice (a draw per
        # module is the main cost of drawing a tree); both shrink to the first.
        choice = draw(ints(len(options) * len(_OWN) - 1))
        cls = b.make_class(ckind, options[choice // len(_OWN)])
        if cls not in _SUFFIX:  # a drawn class: torch's ModuleDict holds no parameters
            own, buffer = _OWN[choice % len(_OWN)]
            params = tuple(ParamSpec(n, b.shape(s)) for n, s in own)
            if buffer:
                buffers = (BufferSpec("running", b.shape(("a",))),)
    else:
        cls = b.make_class(ckind, pick(draw, options))
    if name is None:
        name = f"{_TORCH_PREFIX.get(cls) or cls.lower()}{index}"
    children: list[ModuleSpec] = []
    if depth < b.max_depth and b.remaining > 0:
        positional = ckind in ("ModuleList", "Sequential")
        kinds = CHILD_OPTIONS if depth + 1 < b.max_depth else _LEAF_CHILDREN
        cap = min(MAX_CHILDREN, b.remaining)
        # The root has a child whenever it may: a lone root is rarely a useful case.
        count = (1 + (draw(ints(cap - 1)) if cap > 1 else 0)) if depth == 0 else draw(ints(cap))
        for i in range(count):
            if b.remaining <= 0:
                break
            b.pending = (kinds, str(i) if positional else None, i, depth + 1)
            children.append(draw(_CHILD))
        if positional and children and b.remaining > 0:
            # Repeated layers (nn.ModuleList([Block() for _ in range(n)])): copies
            # of the first child, so several modules share a class and a shape.
            size = _size(children[0])
            repeats = draw(ints(min(3, b.remaining // size)))
            b.remaining -= repeats * size
            children[1:1] = [children[0]] * repeats
        if positional:
            children = [_renamed(c, str(i)) for i, c in enumerate(children)]
    return ModuleSpec(name, cls, params, buffers, tuple(children))


# The builder being drawn into, per thread. Each child is drawn through the one
# strategy object _CHILD, so that it is a span of its own (the shrinker deletes
# a child, or replaces it by one of its descendants, span by span) without the
# cost of creating and validating a strategy object per child.
_current = threading.local()


@st.composite
def _child_strategy(draw: Any) -> ModuleSpec:
    b = _current.builder
    kinds, name, index, depth = b.pending
    return _node(draw, b, pick(draw, kinds), name, index, depth)


_CHILD = _child_strategy()


def _size(m: ModuleSpec) -> int:
    return 1 + sum(_size(c) for c in m.children)


def _renamed(m: ModuleSpec, name: str) -> ModuleSpec:
    return m if m.name == name else ModuleSpec(name, m.cls, m.params, m.buffers, m.children)


@st.composite
def _trees(draw: Any, max_modules: int, max_depth: int) -> tuple[ModuleSpec, tuple[ClassSpec, ...]]:
    dims = draw(ints(63))  # both dimensions in one choice
    b = _Builder(max_modules, max_depth, 1 + dims // 8, 1 + dims % 8)
    root_kind = pick(draw, ROOT_KINDS)
    outer = getattr(_current, "builder", None)
    _current.builder = b
    try:
        tree = _node(draw, b, ("module" if root_kind == "Module" else root_kind, None), "", 0, 0)
    finally:
        _current.builder = outer
    return tree, tuple(b.classes)


def module_trees(*, max_modules: int = 24, max_depth: int = 4) -> SearchStrategy[tuple[ModuleSpec, tuple[ClassSpec, ...]]]:
    """(tree, classes): a module tree of at most ``max_modules`` modules whose
    paths have at most ``max_depth`` components, and the classes it defines.

    The root is a drawn class (deriving from nn.Module or a torch container).
    Below it: torch's Linear / Embedding / LayerNorm (Linears named ``lora*``
    are adapters), drawn classes that may derive from other drawn classes,
    torch's ModuleList / Sequential / ModuleDict and drawn subclasses of them;
    list-like containers often repeat their first child. Drawn modules may
    hold parameters and a buffer as well as children. Dimensions are 1..8.
    Shrinks towards a root with few Linear children.
    """
    check_int(max_modules, "max_modules", min_value=1)
    check_int(max_depth, "max_depth", min_value=0)
    return _trees(max_modules, max_depth)
