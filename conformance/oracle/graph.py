"""ModelGraph: the module graph a CaseSpec builds (shared modules and ties in),
with the traversals nn.Module defines, computed without torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from conformance.spec import CaseSpec, ParamSpec, class_ancestry, join, walk


@dataclass
class Node:
    cls: str
    params: list[tuple[str, str]] = field(default_factory=list)  # (attr name, param id)
    buffers: list[str] = field(default_factory=list)
    children: list[tuple[str, str]] = field(default_factory=list)  # (attr name, node id)


class ModelGraph:
    """Nodes are identified by their spec path, parameters by the spec FQN
    where they were created (a tie makes one parameter appear elsewhere)."""

    def __init__(self, spec: CaseSpec):
        self.spec = spec
        self.nodes: dict[str, Node] = {}
        self.param_specs: dict[str, ParamSpec] = {}
        for path, m in walk(spec.tree):
            self.nodes[path] = Node(m.cls, [(p.name, join(path, p.name)) for p in m.params], [b.name for b in m.buffers])
            for p in m.params:
                self.param_specs[join(path, p.name)] = p
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
        self._module_names = self._named_modules()
        self.module_path = {}  # node id -> canonical path
        for path, nid in self._module_names:
            self.module_path.setdefault(nid, path)
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
        buffer (state_dict does not deduplicate shared modules or ties)."""
        out = []
        for path, nid in self._module_names:
            node = self.nodes[nid]
            out += [join(path, n) for n, _ in node.params] + [join(path, b) for b in node.buffers]
        return out

    def aliases(self, pid: str) -> list[str]:
        return list(self._aliases.get(pid, ()))

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
        for m in self.subtree(nid):
            for _, pid in self.nodes[m].params:
                if pid not in out:
                    out.append(pid)
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
        return bool(set(class_ancestry(self.spec, self.nodes[nid].cls)) & set(classes))

    def numel(self, pid: str) -> int:
        return self.param_specs[pid].numel

    def requires_grad(self, pid: str) -> bool:
        return self.param_specs[pid].requires_grad

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
