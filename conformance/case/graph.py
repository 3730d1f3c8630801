"""ModelGraph: a module graph as pure data (classes, parameters, buffers,
shared modules and ties), built from a CaseSpec or from any live nn.Module,
with the traversals nn.Module defines, computed without torch.distributed.

Classes are identified by class ids: in a CaseSpec its own class names (the
spec is one namespace: "Linear" is torch's nn.Linear, drawn names are
unique); in a live module the qualified name ``module.QualName``, because
two classes may share a ``__name__`` (PEFT's ``lora.Linear`` and torch's
``nn.Linear``). A policy may name a class by its id or, where only one class
of the model has it, by its bare name (``resolve_class``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from conformance.case.tree import class_ancestry, join, walk


@dataclass
class Node:
    cls: str
    params: list[tuple[str, str]] = field(default_factory=list)  # (attr name, param id)
    buffers: list[str] = field(default_factory=list)  # persistent buffers (state_dict keys)
    children: list[tuple[str, str]] = field(default_factory=list)  # (attr name, node id)
    mro: tuple[str, ...] = ()  # class names (__name__), the class first, nn.Module last: for people
    ids: tuple[str, ...] = ()  # the same classes' ids (unambiguous): for lookups


@dataclass(frozen=True)
class ParamInfo:
    shape: tuple[int, ...]
    requires_grad: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ModelGraph:
    """Nodes and parameters have ids: for a CaseSpec the spec path of a
    module and the spec FQN where a parameter was created (a tie makes one
    parameter appear elsewhere); for a live module the canonical path / FQN
    (the first name nn.Module gives that object), found by identity."""

    def __init__(self, source: Any):
        self.spec = None  # the CaseSpec, for a graph built from one
        self.nodes: dict[str, Node] = {}
        self.param_info: dict[str, ParamInfo] = {}
        self._torch_ids: dict[str, str] = {}  # torch.nn class name -> its id in this graph
        # Node ids of modules whose forward the model's own forward never
        # runs (nn.MultiheadAttention reads out_proj.weight without calling
        # out_proj): a fact about a live model found by running it
        # (conformance.case.target.base_graph); FSDP gathers a unit's parameters
        # only when its forward runs. Empty for a CaseSpec.
        self.not_called: frozenset[str] = frozenset()
        if hasattr(source, "_modules") and hasattr(source, "_parameters"):
            self._from_module(source)
        elif hasattr(source, "tree") and hasattr(source, "classes"):  # a CaseSpec (the graph sits below it)
            self.spec = source
            self._from_spec(source)
        else:
            raise TypeError(f"ModelGraph needs a CaseSpec or an nn.Module, got {type(source).__name__}")
        self._index()

    @classmethod
    def from_module(cls, model) -> "ModelGraph":
        return cls(model)

    # -- construction ---------------------------------------------------------
    def _from_spec(self, spec) -> None:
        for path, m in walk(spec.tree):
            mro = tuple(class_ancestry(spec, m.cls))
            self.nodes[path] = Node(
                m.cls, [(p.name, join(path, p.name)) for p in m.params], [b.name for b in m.buffers],
                mro=mro, ids=mro,
            )
            for p in m.params:
                self.param_info[join(path, p.name)] = ParamInfo(tuple(p.shape), p.requires_grad)
            if path:
                self.nodes[path.rpartition(".")[0]].children.append((m.name, path))
        for s in spec.shared:
            self.nodes[s.parent].children.append((s.name, s.source))
        for t in spec.ties:
            node = self.nodes[t.module]
            for i, (name, _) in enumerate(node.params):
                if name == t.name:
                    node.params[i] = (name, t.source)
                    break
            else:
                node.params.append((t.name, t.source))

    def _from_module(self, model) -> None:
        """Walk _modules/_parameters/_buffers as nn.Module's own traversals
        do; ids are the first path (pre-order, registration order) that
        reaches each module or parameter object."""
        mod_id: dict[int, str] = {}
        par_id: dict[int, str] = {}
        order: list[tuple[str, Any]] = []

        def visit(m, prefix: str, stack: tuple[int, ...]) -> None:
            if id(m) in mod_id:
                return
            mod_id[id(m)] = prefix
            order.append((prefix, m))
            for name, p in m._parameters.items():
                if p is not None and id(p) not in par_id:
                    par_id[id(p)] = join(prefix, name)
            for name, c in m._modules.items():
                if c is not None and id(c) not in stack:
                    visit(c, join(prefix, name), stack + (id(c),))

        visit(model, "", (id(model),))
        for path, m in order:
            non_persistent = getattr(m, "_non_persistent_buffers_set", set())
            mro = [k for k in type(m).__mro__ if _is_module_class(k)]
            node = Node(type(m).__name__, mro=tuple(k.__name__ for k in mro), ids=tuple(class_id(k) for k in mro))
            for name, p in m._parameters.items():
                if p is not None:
                    node.params.append((name, par_id[id(p)]))
                    self.param_info.setdefault(par_id[id(p)], ParamInfo(tuple(int(d) for d in p.shape), bool(p.requires_grad)))
            node.buffers = [n for n, b in m._buffers.items() if b is not None and n not in non_persistent]
            node.children = [(n, mod_id[id(c)]) for n, c in m._modules.items() if c is not None]
            self.nodes[path] = node

    def _index(self) -> None:
        self._names_by_id = {cid: short for node in self.nodes.values() for cid, short in zip(node.ids, node.mro)}
        self._module_names = self._named_modules()
        self.module_path: dict[str, str] = {}  # node id -> canonical path
        self._module_aliases: dict[str, list[str]] = {}
        for path, nid in self._module_names:
            self.module_path.setdefault(nid, path)
            self._module_aliases.setdefault(nid, []).append(path)
        self.param_fqn: dict[str, str] = {}  # param id -> canonical FQN
        self._aliases: dict[str, list[str]] = {}
        for fqn, pid in self.named_parameters(remove_duplicate=False):
            self.param_fqn.setdefault(pid, fqn)
            self._aliases.setdefault(pid, []).append(fqn)
        self._users: dict[str, list[str]] = {}
        for nid, node in self.nodes.items():
            for _, pid in node.params:
                if nid not in self._users.setdefault(pid, []):
                    self._users[pid].append(nid)

    # -- nn.Module's traversals ---------------------------------------------
    def _named_modules(self) -> list[tuple[str, str]]:
        """named_modules(remove_duplicate=False) as (path, node id), pre-order."""
        out: list[tuple[str, str]] = []

        def visit(nid: str, prefix: str, stack: tuple[str, ...]) -> None:
            out.append((prefix, nid))
            for name, child in self.nodes[nid].children:
                if child not in stack:  # validate() excludes cycles; be safe
                    visit(child, join(prefix, name), stack + (child,))

        visit("", "", ("",))
        return out

    def named_modules(self) -> list[tuple[str, str]]:
        """named_modules(): each module once, under its first path."""
        seen: set[str] = set()
        out = []
        for path, nid in self._module_names:
            if nid not in seen:
                seen.add(nid)
                out.append((path, nid))
        return out

    def named_parameters(self, remove_duplicate: bool = True) -> list[tuple[str, str]]:
        mods = self.named_modules() if remove_duplicate else self._module_names
        seen: set[str] = set()
        out = []
        for path, nid in mods:
            for name, pid in self.nodes[nid].params:
                if remove_duplicate and pid in seen:
                    continue
                seen.add(pid)
                out.append((join(path, name), pid))
        return out

    def state_dict_keys(self) -> list[str]:
        """nn.Module.state_dict() keys: every alias of every parameter and
        persistent buffer (state_dict does not deduplicate shared modules or ties)."""
        out = []
        for path, nid in self._module_names:
            node = self.nodes[nid]
            out += [join(path, n) for n, _ in node.params] + [join(path, b) for b in node.buffers]
        return out

    def aliases(self, pid: str) -> list[str]:
        """Every FQN that reaches parameter ``pid`` (named_parameters(remove_duplicate=False))."""
        return list(self._aliases.get(pid, ()))

    def module_aliases(self, nid: str) -> list[str]:
        """Every path that reaches module ``nid`` (a shared module has several)."""
        return list(self._module_aliases.get(nid, ()))

    def users(self, pid: str) -> list[str]:
        """Node ids whose own parameters include ``pid``."""
        return list(self._users.get(pid, ()))

    def subtree(self, nid: str) -> list[str]:
        """Node ids reachable from ``nid`` (itself first), pre-order, each once."""
        seen: list[str] = []
        stack = [nid]
        while stack:
            cur = stack.pop()
            if cur in seen:
                continue
            seen.append(cur)
            stack.extend(c for _, c in reversed(self.nodes[cur].children))
        return seen

    def subtree_params(self, nid: str) -> list[str]:
        """Distinct parameter ids reachable from ``nid``, named_parameters order."""
        out: list[str] = []
        seen: set[str] = set()
        for m in self.subtree(nid):
            for _, pid in self.nodes[m].params:
                if pid not in seen:
                    seen.add(pid)
                    out.append(pid)
        return out

    def reads_through(self, skip: tuple[str, ...], path: str | None, *, before: bool = False) -> set[str]:
        """Canonical FQNs of the parameters the case's generic forward
        (conformance.case.build), passing over the modules at ``skip`` (spec
        paths), has read when the module at ``path`` returns (its own subtree
        included), or with ``before`` when it starts (what its input depends
        on); ``path`` None: the whole forward. A module's own parameters,
        then its children in order, a shared module once. A CaseSpec's
        graph only."""
        skipped = set(skip)
        out: set[str] = set()
        seen: set[str] = set()

        def visit(nid: str) -> bool:  # True once ``path`` has returned (``before``: is entered)
            if before and nid == path:
                return True
            if nid in seen:
                return False
            seen.add(nid)
            out.update(self.param_fqn[pid] for _, pid in self.nodes[nid].params)
            for name, child in self.nodes[nid].children:
                # a skip names a registration in the spec's own tree; a
                # shared module's second name is never skipped
                tree_child = child == (f"{nid}.{name}" if nid else name)
                if not (tree_child and child in skipped) and visit(child):
                    return True
            return nid == path

        visit("")
        return out

    def post_order(self) -> list[str]:
        """Node ids in the post-order spec source 000 promises: a DFS over
        named_children() in registration order, each module once (at its first
        registration), children before parents."""
        visited = {""}
        out: list[str] = []

        def visit(nid: str) -> None:
            for _, child in self.nodes[nid].children:
                if child not in visited:
                    visited.add(child)
                    visit(child)
            out.append(nid)

        visit("")
        return out

    def isinstance_of(self, nid: str, classes: tuple[str, ...]) -> bool:
        """The module derives from one of ``classes`` (ids, or names
        resolve_class accepts; a name no class of the model has matches
        nothing, an ambiguous one raises ClassLookupError)."""
        return bool(set(self.nodes[nid].ids) & {self._resolve(c) for c in classes})

    def class_ids(self) -> list[str]:
        """Every class id in the model's modules' MROs, first seen first."""
        return list(dict.fromkeys(c for node in self.nodes.values() for c in node.ids))

    def class_name(self, cid: str) -> str:
        """The class's __name__ (what people read)."""
        return self._class_names()[cid]

    def resolve_class(self, name: str) -> str:
        """The id of the model's class ``name`` names: its id, or a bare
        __name__ only one of the model's classes has.
        ClassLookupError (its message goes after the name; an ambiguous
        name's names the candidates) otherwise."""
        cid = self._resolve(name)
        if cid is None:
            raise ClassLookupError("is not a class of any module of the model")
        return cid

    def _resolve(self, name: str) -> str | None:
        names = self._class_names()
        if name in names:
            return name
        hits = [cid for cid, short in names.items() if short == name]
        if len(hits) > 1:
            raise ClassLookupError(f"is ambiguous: {', '.join(hits)} share the name; name one by its qualified name (module.QualName)")
        return hits[0] if hits else None

    def is_torch(self, nid: str, names: tuple[str, ...], exact: bool = False) -> bool:
        """The module's class is (exact) or derives from one of torch.nn's
        classes ``names`` (e.g. "ModuleList"): by identity, never by a name
        a user class may share."""
        ids = {self.torch_class_id(n) for n in names}
        node = self.nodes[nid]
        return (node.ids[0] in ids) if exact else bool(ids & set(node.ids))

    def torch_class_id(self, name: str) -> str:
        """The id torch.nn.<name> has in this graph."""
        if self.spec is not None:
            return name
        if name not in self._torch_ids:
            import torch.nn as nn

            self._torch_ids[name] = class_id(getattr(nn, name))
        return self._torch_ids[name]

    def _class_names(self) -> dict[str, str]:
        return self._names_by_id

    def numel(self, pid: str) -> int:
        return self.param_info[pid].numel

    def requires_grad(self, pid: str) -> bool:
        return self.param_info[pid].requires_grad

    def resolve_param(self, fqn: str) -> str:
        """The parameter id at attribute path ``fqn`` (after ties)."""
        path, _, name = fqn.rpartition(".")
        nid = self.resolve_module(path)
        for n, pid in self.nodes[nid].params:
            if n == name:
                return pid
        raise KeyError(fqn)

    def resolve_module(self, path: str) -> str:
        nid = ""
        for part in path.split(".") if path else ():
            nid = dict(self.nodes[nid].children)[part]
        return nid

    def shared_modules(self) -> bool:
        """Some module is reachable by two paths."""
        return len(self.named_modules()) != len(self._module_names)

    # -- comparison -------------------------------------------------------------
    def canonical(self) -> dict:
        """The graph with every id replaced by its canonical name: two graphs
        of the same model (from a spec and from the module it builds) are equal."""
        mp, pf = self.module_path, self.param_fqn
        modules = {}
        for path, nid in self.named_modules():
            n = self.nodes[nid]
            modules[path] = {
                "cls": n.cls,
                "mro": list(n.mro),
                "params": [(name, pf[pid]) for name, pid in n.params],
                "buffers": list(n.buffers),
                "children": [(name, mp[c]) for name, c in n.children],
                "aliases": self.module_aliases(nid),
            }
        params = {
            pf[pid]: {"shape": list(info.shape), "numel": info.numel, "requires_grad": info.requires_grad,
                      "aliases": self.aliases(pid)}
            for pid, info in self.param_info.items() if pid in pf
        }
        return {"modules": modules, "params": params, "state_dict": self.state_dict_keys()}


class ClassLookupError(KeyError):
    """A class name that names no class of the model, or several."""

    def __str__(self) -> str:
        return str(self.args[0])


def class_id(k: type) -> str:
    """A class's unambiguous id: ``module.QualName``."""
    return f"{k.__module__}.{k.__qualname__}"


def _is_module_class(k: type) -> bool:
    import torch.nn as nn  # torch.nn only: the graph stays free of torch.distributed

    return isinstance(k, type) and issubclass(k, nn.Module)
