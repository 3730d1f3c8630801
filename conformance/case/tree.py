"""Tree queries over a CaseSpec's module tree (pure; no other import)."""

from __future__ import annotations

from typing import Iterator


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def walk(tree, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(path, module) in pre-order, registration order; the spec's own tree
    (shared modules and ties are not part of it)."""
    yield prefix, tree
    for child in tree.children:
        yield from walk(child, join(prefix, child.name))



def class_ancestry(spec, cls: str) -> list[str]:
    """cls and every class it derives from, drawn or torch's (nn.Module last)."""
    bases = {c.name: c.base for c in spec.classes}
    out = [cls]
    while cls in bases:
        cls = bases[cls]
        out.append(cls)
    if out[-1] != "Module":
        out.append("Module")
    return out


