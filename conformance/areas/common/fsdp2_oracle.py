"""The FSDP2 oracle: fully_shard's parameter groups, what
register_fsdp_forward_method promises during user methods, and what happens
to a parameter shared between groups (by torch release)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from conformance.case.graph import ModelGraph
from conformance.case.model_case import ModelCase
from conformance.case.spec import CaseSpec, ForwardMethod, MethodCall, ShardGroup, SpecError, WrapPlan, effective_calls, module_at
from conformance.case.target import graph_of
from conformance.case.tree import class_ancestry, join

# The torch release from which fully_shard rejects a parameter that two
# groups see (ValueError at the first forward that names it and prescribes
# fully_shard([a, b])); before it nothing checks, and the fully_shard
# docstring's "except those already assigned to a group from an earlier call"
# is the only promise: the parameter is managed once. 2.12 (measured: 2.12.1
# rejects both a sibling split and a root attribute tied to a child group,
# 2.8.0 neither; NVIDIA/Model-Optimizer#2059 saw the error in 2.12.0a0); it
# was 2.13 until the 2.12.1 matrix row showed FSDP2-GROUPS comparing groups
# that torch rejects at the first forward.
TIE_CHECK_SINCE = (2, 12)
TORCH_CONTAINERS = ("ModuleList", "ModuleDict", "Sequential")
# The torch containers a model iterates rather than calls (no forward of
# their own). torch's Sequential is called where FSDP wraps or shards it (the
# case calls it then, as a user's model does: conformance.case.build.call_child),
# else walked; a ModuleList or ModuleDict is always walked.
ITERATED_CONTAINERS = ("ModuleList", "ModuleDict")
# fully_shard([a, b]) (one group for several modules) is public from 2.6.
LIST_FORM_SINCE = (2, 6)


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.13.0+cpu" -> (2, 13))."""
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


@dataclass(frozen=True)
class GroupPrediction:
    modules: tuple[str, ...]  # canonical paths of the modules fully_shard is given
    managed: tuple[str, ...]  # canonical FQNs
    trainable: tuple[str, ...]
    frozen: tuple[str, ...]
    reshard: bool  # reshard_after_forward in effect (None: True, for the root False)
    root: bool

    @property
    def mixed(self) -> bool:
        return bool(self.trainable) and bool(self.frozen)


@dataclass(frozen=True)
class SplitTie:
    """A parameter that modules managed by two or more groups hold."""

    fqn: str  # canonical
    aliases: tuple[str, ...]
    groups: tuple[int, ...]  # indices into FSDP2Prediction.groups


@dataclass(frozen=True)
class ReadPrediction:
    step: int  # -1: on entry to the method, else the "param" step that reads it
    fqn: str  # canonical
    group: int | None  # the managing group (None: ignored, never sharded)
    full: bool  # unsharded at that moment


@dataclass(frozen=True)
class CallPrediction:
    index: int  # position in the flattened call sequence
    method: int  # index into spec.methods; -1: the root's forward
    module: str  # canonical path of the method's module
    fsdp_module: bool  # the module is one fully_shard was given
    patched: bool  # registration makes FSDP's pre/post-forward run around it
    unshards: int  # groups unsharded during the call (one all-gather each when W > 1)
    exact: bool  # unshards is exact (no multi-module group takes part)
    nested: bool  # calls FSDP submodules, self.forward or self(...) inside
    reads: tuple[ReadPrediction, ...]
    in_promise: bool  # everything it computes with is unsharded: output must equal the reference's
    sharded_after: tuple[bool | None, ...]  # per group (None: not promised)
    # the call's first FSDP group (the iteration's forward root) is a
    # multi-module group that the call ran only in part
    root_group_partial: bool = False


@dataclass(frozen=True)
class FSDP2Prediction:
    groups: tuple[GroupPrediction, ...]  # in the order fully_shard is applied (root last)
    split_ties: tuple[SplitTie, ...]
    tie_outcomes: tuple[str, ...]  # for split ties: "error" (rejected, naming it), "once" (managed once)
    tie_check: bool  # the installed torch has the split-tie check
    supported: str  # "" or why the case is outside what FSDP2 promises
    calls: tuple[CallPrediction, ...]
    params: tuple[str, ...]  # canonical FQNs (named_parameters)
    frozen: tuple[str, ...]
    tied: tuple[tuple[str, tuple[str, ...]], ...]  # canonical FQN -> its aliases (2+)
    fsdp_modules: tuple[str, ...]  # canonical paths of every module fully_shard was given
    # every path of those modules (a shared module's other names too): a
    # method's module, as the spec names it, is an FSDP module if its path is here
    fsdp_paths: tuple[str, ...] = ()
    # modules given to fully_shard after an earlier call's group already took
    # them in (not bottom-up: a list group that straddles an earlier group)
    resharded: tuple[str, ...] = ()
    shared_modules: bool = False  # some module has two names
    # gradients through the calls are promised: no called method reads a
    # parameter of another group directly (FSDP2 keeps a parameter alive for
    # backward only through its own module's forward; spec source 004)
    backward_promised: bool = True
    # per list group, how many passes the calls start (one backward follows
    # them all; 0 for a one-module group): a list group whose module runs
    # again after the group completed, in one call or a later one, has two
    # or more
    group_passes: tuple[int, ...] = ()

    def group_index(self, module: str) -> int | None:
        return next((i for i, g in enumerate(self.groups) if module in g.modules), None)


def shard_order(plan, g: ModelGraph) -> list[ShardGroup]:
    """The plan's groups plus the root's, bottom-up: each after every group
    below it (by the last of its modules in registration post-order)."""
    plan = getattr(plan, "plan", plan)  # a case: its plan
    groups = list(plan.groups)
    if not any("" in grp.modules for grp in groups):
        groups.append(ShardGroup(("",)))
    pos = {nid: i for i, nid in enumerate(g.post_order())}
    return sorted(groups, key=lambda grp: max(pos[m] for m in grp.modules))


def _unsupported(methods, calls, g: ModelGraph, order: list[ShardGroup]) -> str:
    for grp in order:
        for a in grp.modules:
            for b in grp.modules:
                if a != b and b in g.subtree(a):
                    return f"fully_shard([...]) with {b} inside {a or '<root>'}: the list form is for disjoint modules"
        for m in grp.modules:
            cls = g.nodes[m].cls
            if g.is_torch(m, ITERATED_CONTAINERS, exact=True):
                return f"fully_shard on torch's own {cls} at {m or '<root>'}: a model iterates it, never calls its forward"
            if m in g.not_called:
                return f"fully_shard on {m}, whose forward the model's forward never runs (its parameters are read without calling it)"
    first = calls[0]
    if True:
        if first.method != -1:
            m = methods[first.method]
            if m.module != "" or not m.register:
                return "the first call does not run the root's forward hooks (lazy init picks the root by the first forward)"
    return ""


@functools.lru_cache(maxsize=256)
def predict_fsdp2(spec, torch_version: str) -> FSDP2Prediction:
    """For a CaseSpec or a ModelCase: its graph, plan, methods and calls.
    A ModelCase's methods are the model's own code (opaque to the oracle)."""

    return fsdp2_prediction(
        graph_of(spec), spec.plan, spec.methods, effective_calls(spec), torch_version, opaque=isinstance(spec, ModelCase)
    )


def fsdp2_prediction(
    g: ModelGraph,
    plan: WrapPlan,
    methods: tuple[ForwardMethod, ...],
    calls: tuple[MethodCall, ...],
    torch_version: str,
    *,
    opaque: bool = False,
) -> FSDP2Prediction:
    """What FSDP2 promises for graph ``g`` sharded as ``plan`` says, with
    ``methods`` registered and ``calls`` made. ``opaque``: the methods' bodies
    are unknown (a real model's generate): only what holds whatever they run
    is predicted."""
    order = shard_order(plan, g)
    ignored = {g.resolve_param(f) for f in plan.ignored_params}
    assigned = set(ignored)
    stateful: set[str] = set()
    owner: dict[str, int] = {}
    reach: list[list[str]] = []
    groups: list[GroupPrediction] = []
    resharded: list[str] = []
    for gi, grp in enumerate(order):
        roots = set(grp.modules)
        resharded += [m for m in grp.modules if any(m in mods for mods in reach)]
        visited: set[str] = set()
        mods: list[str] = []

        def dfs(nid: str) -> None:
            if nid not in roots and nid in stateful:
                return  # a nested fully_shard module
            visited.add(nid)
            for _, child in g.nodes[nid].children:
                if child not in visited:
                    dfs(child)
            mods.append(nid)

        for r in grp.modules:
            if r not in visited:
                dfs(r)
        mine: list[str] = []
        for nid in mods:
            for _, pid in g.nodes[nid].params:
                if pid not in assigned and pid not in mine:
                    mine.append(pid)
        for pid in mine:
            owner[pid] = gi
        assigned.update(mine)
        stateful.update(roots)
        reach.append(mods)
        is_root = "" in grp.modules
        reshard = grp.reshard_after_forward if grp.reshard_after_forward is not None else not is_root
        groups.append(
            GroupPrediction(
                modules=tuple(g.module_path[m] for m in grp.modules),
                managed=tuple(g.param_fqn[p] for p in mine),
                trainable=tuple(g.param_fqn[p] for p in mine if g.requires_grad(p)),
                frozen=tuple(g.param_fqn[p] for p in mine if not g.requires_grad(p)),
                reshard=reshard,
                root=is_root,
            )
        )
    splits = []
    for fqn, pid in g.named_parameters():
        holders = {i for i, mods in enumerate(reach) for nid in mods if any(p == pid for _, p in g.nodes[nid].params)}
        if len(holders) > 1:
            splits.append(SplitTie(fqn, tuple(g.aliases(pid)), tuple(sorted(holders))))
    tie_check = torch_release(torch_version) >= TIE_CHECK_SINCE
    why = _unsupported(methods, calls, g, order)
    if not why and any(len(grp.modules) > 1 for grp in order) and torch_release(torch_version) < LIST_FORM_SINCE:
        why = f"fully_shard([a, b]) needs torch >= {LIST_FORM_SINCE[0]}.{LIST_FORM_SINCE[1]}"
    sim_calls: tuple[CallPrediction, ...] = ()
    passes: tuple[int, ...] = ()
    if not why and not (splits and tie_check):
        sim_calls, passes = _simulate(methods, calls, g, order, groups, owner, opaque)
    tied = []
    for fqn, pid in g.named_parameters():
        aliases = g.aliases(pid)
        if len(aliases) > 1:
            tied.append((fqn, tuple(aliases)))
    return FSDP2Prediction(
        groups=tuple(groups),
        split_ties=tuple(splits),
        tie_outcomes=("error",) if tie_check else ("error", "once"),
        tie_check=tie_check,
        supported=why,
        calls=sim_calls,
        params=tuple(f for f, _ in g.named_parameters()),
        frozen=tuple(f for f, pid in g.named_parameters() if not g.requires_grad(pid)),
        tied=tuple(tied),
        fsdp_modules=tuple(m for grp in groups for m in grp.modules),
        fsdp_paths=tuple(p for grp in order for nid in grp.modules for p in (g.module_aliases(nid) or [g.module_path[nid]])),
        resharded=tuple(g.module_path[m] for m in resharded),
        shared_modules=g.shared_modules(),
        backward_promised=not _reads_other_groups(methods, calls, g, order, owner),
        group_passes=passes,
    )


class _Sim:
    """FSDP2's forward promises, step by step: a group is unsharded by the
    pre-forward of a module fully_shard was given (one all-gather if it was
    sharded) and stays so until that module's outermost forward ends; then it
    reshards when reshard_after_forward says so. A multi-module group reshards
    when all of its modules have run, or when the iteration's first forward
    ends."""

    def __init__(self, g: ModelGraph, order: list[ShardGroup], groups: list[GroupPrediction], owner: dict[str, int]):
        self.g = g
        self.groups = groups
        self.owner = owner
        self.member = {m: i for i, grp in enumerate(order) for m in grp.modules}
        self.multi = {i for i, grp in enumerate(order) if len(grp.modules) > 1}
        self.empty = {i for i, grp in enumerate(groups) if not grp.managed}  # no parameters: nothing to gather
        self.sharded = [True] * len(groups)
        self.active = [0] * len(groups)
        self.pending: list[set[str]] = [set() for _ in groups]
        self.passes = [0] * len(groups)  # passes started, every call counted (FSDP2Prediction.group_passes)
        self.iter_root: int | None = None
        self.reset_call()

    def reset_call(self) -> None:
        self.unshards = 0
        self.exact = True
        self.ok = True  # nothing computed with a sharded parameter
        self.raises = False  # a forward met a sharded parameter (FSDP's DTensor): it raises
        self.nested = False
        self.root_group_partial = False

    def full(self, pid: str) -> bool:
        gi = self.owner.get(pid)
        return gi is None or not self.sharded[gi]

    def pre(self, gi: int, nid: str) -> None:
        if self.iter_root is None:
            self.iter_root = gi
        if gi in self.multi:
            self.exact = False
            if not self.pending[gi]:
                self.pending[gi] = set(self.groups_modules(gi))
                self.passes[gi] += 1
        if self.sharded[gi] and gi not in self.empty:
            self.unshards += 1
            self.sharded[gi] = False
        self.active[gi] += 1

    def groups_modules(self, gi: int) -> list[str]:
        return [m for m, i in self.member.items() if i == gi]

    def post(self, gi: int, nid: str) -> None:
        self.active[gi] -= 1
        if gi in self.multi:
            self.pending[gi].discard(nid)
            if not self.pending[gi] and self.active[gi] == 0 and self.groups[gi].reshard:
                self.sharded[gi] = True
        elif self.active[gi] == 0 and self.groups[gi].reshard:
            self.sharded[gi] = True
        if self.iter_root == gi and self.active[gi] == 0:
            if gi in self.multi and self.pending[gi]:
                self.root_group_partial = True
            for mi in self.multi:
                if self.pending[mi] and self.active[mi] == 0:
                    self.pending[mi] = set()
                    if self.groups[mi].reshard:
                        self.sharded[mi] = True
            self.iter_root = None

    def run_module(self, nid: str, hooks: bool) -> None:
        gi = self.member.get(nid) if hooks else None
        if gi is not None:
            self.pre(gi, nid)
        for _, pid in self.g.nodes[nid].params:
            if not self.full(pid):
                self.ok = False
                self.raises = True
        for _, child in self.g.nodes[nid].children:
            self.call_child(child)
        if gi is not None:
            self.post(gi, nid)

    def call_child(self, nid: str) -> None:
        if nid in self.member:
            self.nested = True
        if self.g.is_torch(nid, ITERATED_CONTAINERS if nid in self.member else TORCH_CONTAINERS, exact=True):
            for _, c in self.g.nodes[nid].children:  # build.call_child runs their children
                self.call_child(c)
        else:
            self.run_module(nid, hooks=True)


def _resolve_from(g: ModelGraph, nid: str, rel: str) -> tuple[str, str]:
    """(node id, last name) of attribute path ``rel`` from node ``nid``."""
    parts = rel.split(".")
    for part in parts[:-1]:
        nid = dict(g.nodes[nid].children)[part]
    return nid, parts[-1]


def subtree_named_parameters(g: ModelGraph, nid: str) -> list[tuple[str, str]]:
    """module.named_parameters() of node ``nid``: (relative FQN, param id)."""
    seen_mods: set[str] = set()
    seen: set[str] = set()
    out = []

    def visit(n: str, prefix: str) -> None:
        if n in seen_mods:
            return
        seen_mods.add(n)
        for name, pid in g.nodes[n].params:
            if pid not in seen:
                seen.add(pid)
                out.append((join(prefix, name), pid))
        for name, c in g.nodes[n].children:
            visit(c, join(prefix, name))

    visit(nid, "")
    return out


def _reads_other_groups(methods, calls, g: ModelGraph, order: list[ShardGroup], owner: dict[str, int]) -> bool:
    """A called method reads, by a "param" step, a parameter that a group
    other than its own module's manages."""
    member = {m: i for i, grp in enumerate(order) for m in grp.modules}
    for call in calls:
        if call.method == -1 or call.method >= len(methods):
            continue
        m = methods[call.method]
        for st in m.steps:
            if st.op == "param":
                pnid, name = _resolve_from(g, m.module, st.target)
                gi = owner.get(dict(g.nodes[pnid].params)[name])
                if gi is not None and gi != member.get(m.module):
                    return True
    return False


def _opaque_call(sim: "_Sim", call: MethodCall, m: ForwardMethod | None, index: int) -> CallPrediction:
    """A call whose body the oracle cannot see (a real model's forward or
    generate). Promised: a registered method of the root (and forward) runs
    with the root's group unsharded, one all-gather at least when it was
    sharded; afterwards the root's group is as its reshard_after_forward
    says, and every reshard_after_forward=True group is sharded (whether the
    call ran it or not). A reshard_after_forward=False group's state depends
    on which submodules the body ran: not predicted."""
    root = sim.member.get("")
    patched = call.method == -1 or bool(m and m.register and root is not None)
    before = root is not None and sim.sharded[root] and root not in sim.empty
    after: list[bool | None] = []
    for i, grp in enumerate(sim.groups):
        if i in sim.multi or i in sim.empty:
            after.append(None)
        elif i == root:
            after.append(grp.reshard if patched else None)
        else:
            after.append(True if grp.reshard else None)
    if patched and root is not None:
        # what is known now: the groups the prediction says are sharded are;
        # a root left unsharded is full
        for i, want in enumerate(after):
            if want is not None:
                sim.sharded[i] = want
    return CallPrediction(
        index=index, method=call.method, module="", fsdp_module=root is not None, patched=patched,
        unshards=1 if (patched and before) else 0, exact=False, nested=False, reads=(),
        in_promise=patched, sharded_after=tuple(after),
    )


def _simulate(methods, calls, g: ModelGraph, order, groups, owner, opaque: bool = False) -> tuple[tuple[CallPrediction, ...], tuple[int, ...]]:
    """Each call's prediction, and how many passes of each group the calls
    started (FSDP2Prediction.group_passes)."""
    sim = _Sim(g, order, groups, owner)
    out: list[CallPrediction] = []
    index = 0
    for call in calls:
        for _ in range(call.times):
            sim.reset_call()
            if opaque:
                out.append(_opaque_call(sim, call, None if call.method == -1 else methods[call.method], index))
                index += 1
                continue
            reads: list[ReadPrediction] = []
            if call.method == -1:
                nid, fsdp_module, patched = "", True, True
                sim.run_module("", hooks=True)
            else:
                m = methods[call.method]
                nid = m.module
                gi = sim.member.get(nid)
                fsdp_module = gi is not None
                patched = fsdp_module and m.register
                if patched:
                    sim.pre(gi, nid)
                for rel, pid in subtree_named_parameters(g, nid):
                    reads.append(ReadPrediction(-1, g.param_fqn[pid], owner.get(pid), sim.full(pid)))
                for i, st in enumerate(m.steps):
                    if st.op == "param":
                        pnid, name = _resolve_from(g, nid, st.target)
                        pid = dict(g.nodes[pnid].params)[name]
                        full = sim.full(pid)
                        sim.ok &= full
                        reads.append(ReadPrediction(i, g.param_fqn[pid], owner.get(pid), full))
                    elif st.op == "child":
                        cnid, name = _resolve_from(g, nid, st.target + ".x")
                        sim.call_child(cnid)
                    elif st.op == "forward":
                        sim.nested = True
                        sim.run_module(nid, hooks=False)
                    else:
                        sim.nested = True
                        sim.run_module(nid, hooks=True)
                if patched:
                    sim.post(gi, nid)
            out.append(
                CallPrediction(
                    index=index,
                    method=call.method,
                    module=g.module_path[nid],
                    fsdp_module=fsdp_module,
                    patched=patched,
                    unshards=sim.unshards,
                    exact=sim.exact,
                    nested=sim.nested,
                    reads=tuple(reads),
                    in_promise=sim.ok,
                    sharded_after=tuple(None if i in sim.empty else sim.sharded[i] for i in range(len(groups))),
                    root_group_partial=sim.root_group_partial,
                )
            )
            index += 1
            if sim.raises:
                return tuple(out), tuple(sim.passes)  # the adapter stops at a call that raises
    return tuple(out), tuple(sim.passes)


def fsdp2_case_tags(spec: CaseSpec, pred: FSDP2Prediction) -> set[str]:
    """Facts about an FSDP2 case that known_failures.toml entries match on."""
    tags = {"api:fsdp2"}
    if pred.split_ties:
        tags.add("tie:split")
    elif pred.tied:
        tags.add("tie:grouped")
    if spec.shared or pred.shared_modules:
        tags.add("shared-module")
    if pred.resharded:
        tags.add("group:resharded")  # fully_shard given a module an earlier group already holds
    if any(g.mixed for g in pred.groups):
        tags.add("frozen:mixed-group")
    if any(len(g.modules) > 1 for g in pred.groups):
        tags.add("group:multi")
    if list_group_completed_by_frozen_embedding(spec, pred.groups):
        # a list group completed by a module whose output needs no gradient
        # (the case looks a frozen Embedding up with constant indices)
        tags.add("group:multi-frozen-embedding")
    if any(len(g.modules) > 1 for g in pred.groups) and group_rerun_after_frozen_embedding(spec, pred.groups, _frozen_fqns(spec)):
        tags.add("group:rerun-after-frozen-embedding")  # see that function
    if any(len(g.modules) > 1 and not g.reshard and any(_frozen_embedding(spec, m) for m in g.modules)
           and (_runs_twice(spec, g.modules) or (i < len(pred.group_passes) and pred.group_passes[i] > 1))
           for i, g in enumerate(pred.groups)):
        # the same, reshard_after_forward=False: the group runs twice before
        # the backward (a module of it registered under two names, or the
        # case's calls running it twice: thorough seed 166287154, a
        # registered method that runs the root's forward, called twice)
        tags.add("group:multi-frozen-embedding-rerun")
    if any(c.root_group_partial for c in pred.calls):
        # a call whose first FSDP group is a list group it runs only in part
        # (fsdp2-list-group-partial-call-stays-unsharded)
        tags.add("group:multi-partial-root")
    fsdp = set(pred.fsdp_paths)  # every name of those modules
    if getattr(spec, "target", None) is not None:  # a ModelCase: its methods' bodies are the model's
        from conformance.case.target import methods_calling_forward

        if "" in fsdp and any(m.register and m.name in methods_calling_forward(spec.target) for m in spec.methods):
            tags.add("method-calls-self")
    if any(container_base(spec, path) for path in fsdp):
        tags.add("container-subclass")  # a ModuleList/ModuleDict subclass with a forward, given to fully_shard
    called = {c.method for c in spec.calls}
    if any(i in called and m.register and m.module in fsdp and any(s.op == "call" for s in m.steps) for i, m in enumerate(spec.methods)):
        tags.add("method-calls-self")  # a registered method that runs its module's forward hooks inside
        multi = [g.modules for g in pred.groups if len(g.modules) > 1]
        if any(i in called and m.register and any(s.op == "call" for s in m.steps)
               and any(m.module in mods and any(not _within(x, m.module) for x in mods) for mods in multi)
               for i, m in enumerate(spec.methods)):
            # the self-call's post-forward leaves the method module's list
            # group idle with another of its modules not run: the group's
            # forward stays incomplete until a later root post-forward
            # completes it (fsdp2-forward-method-calls-self)
            tags.add("group:multi-self-call-partial")
    return tags


def _within(path: str, root: str) -> bool:
    """Whether module path ``path`` is ``root`` or inside it."""
    return root == "" or path == root or path.startswith(root + ".")


def list_group_tags(spec: CaseSpec, pred: FSDP2Prediction) -> set[str]:
    """The list-group facts of fsdp2_case_tags that training findings match
    on in every area: a group completed by a frozen Embedding, or run again
    after it (fsdp2-frozen-list-group-freed-in-backward,
    fsdp2-list-group-reentered-loses-grad)."""
    return {t for t in fsdp2_case_tags(spec, pred)
            if t.startswith(("group:multi-frozen-embedding", "group:rerun-after-frozen-embedding"))}


def _frozen_fqns(spec: CaseSpec) -> set[str]:
    """Canonical FQNs of the parameters the case builds frozen."""

    g = graph_of(spec)
    return {g.param_fqn[pid] for pid in g.param_fqn if not g.requires_grad(pid)}


def _frozen_embedding(spec: CaseSpec, path: str, frozen: set[str] | None = None) -> bool:
    """The module at ``path`` is an Embedding whose parameters are all frozen
    (``frozen``: the canonical FQNs frozen then, None: the case's own mask):
    its output needs no gradient (the indices never do)."""

    g = graph_of(spec)
    try:
        nid = g.resolve_module(path)
    except KeyError:
        return False
    node = g.nodes[nid]
    if not (g.is_torch(nid, ("Embedding",), exact=True) and node.params):
        return False
    if frozen is None:
        return not any(g.requires_grad(pid) for _, pid in node.params)
    return all(g.param_fqn[pid] in frozen for _, pid in node.params)


def sharded_modules(spec, g) -> frozenset[str]:
    """Node ids of the modules the FSDP2 plan gives fully_shard (a CaseSpec's)."""
    if getattr(spec, "tree", None) is None or spec.plan.api != "fsdp2":
        return frozenset()
    return frozenset(g.resolve_module(m) for grp in spec.plan.groups for m in grp.modules)


def forward_calls(spec: CaseSpec, skip: tuple[str, ...] = (), *, completed: bool = False) -> list[str]:
    """Node ids of the modules whose forward (and so whose FSDP hooks) the
    case's generic forward runs, in order, with multiplicity: a module
    registered under two parents runs once per parent; torch's own containers
    are walked, not called, except a Sequential given to fully_shard
    (conformance.case.build.call_child). ``skip``: spec paths
    a microbatch passes over (as conformance.areas.schedule.oracle.used_params).
    ``completed``: in the order the forwards finish (a module after the
    children it runs: its post-forward hooks' order), not the order they start."""

    g = graph_of(spec)
    sharded = sharded_modules(spec, g)  # a Sequential among them is called
    skipped, out = set(skip), []

    def visit(nid: str, stack: tuple[str, ...]) -> None:
        if nid in stack:
            return  # a module that holds itself: never built
        called = not g.is_torch(nid, ITERATED_CONTAINERS if nid in sharded else TORCH_CONTAINERS, exact=True)
        if called and not completed:
            out.append(nid)
        for name, child in g.nodes[nid].children:
            tree_child = child == (f"{nid}.{name}" if nid else name)
            if not (tree_child and child in skipped):
                visit(child, stack + (nid,))
        if called and completed:
            out.append(nid)

    visit("", ())
    return out


def group_completed_by_frozen_embedding(spec: CaseSpec, paths, frozen: set[str] | None = None, skip: tuple[str, ...] = ()) -> bool:
    """The list group of ``paths`` (fully_shard([a, b])) is completed, in the
    case's forward, by a frozen Embedding: FSDP2 registers a group's
    pre-backward hook on the output of the module whose forward completes
    the group's pass alone (_register_group_forward_hooks), and a frozen
    Embedding's output needs no gradient, so the group is not unsharded for
    its other modules' backward (fsdp2-frozen-list-group-freed-in-backward).
    A group one of whose modules never runs forward is completed from the
    root's output instead (_force_complete_incomplete_states). ``frozen``:
    the canonical FQNs frozen in that forward (None: the case's own mask);
    ``skip``: the spec paths it passes over (forward_calls). A ModelCase
    runs its own forward, in an order the oracle does not know: any frozen
    Embedding of the group. A group whose modules run again (a module
    registered under two names) makes a pass per run: its first pass
    counts, and so does its last where no module of the group runs after it
    (seed 214 of the ci profile: the first pass completed by the Linear, the
    second and last by the Embedding under its second name, the Linear's
    second call then finding its weight freed); a pass so completed and then
    run again is fsdp2-list-group-reentered-loses-grad's
    (group_rerun_after_frozen_embedding)."""
    if getattr(spec, "tree", None) is None:
        return any(_frozen_embedding(spec, m, frozen) for m in paths)
    g = graph_of(spec)
    try:
        members = {g.resolve_module(m) for m in paths}
    except KeyError:
        return False
    remaining: set[str] = set()
    completions: list[str] = []
    for nid in forward_calls(spec, skip, completed=True):
        if nid not in members:
            continue
        if not remaining:  # FSDP refills the group's to-run set at a pass's first module
            remaining = set(members)
        remaining.discard(nid)
        if not remaining:
            completions.append(nid)
    if not completions:
        return False
    last = [completions[-1]] if not remaining else []  # the last pass, where nothing of the group runs after it
    return any(_frozen_embedding(spec, g.module_path[nid], frozen) for nid in [completions[0], *last])


def list_group_completed_by_frozen_embedding(spec: CaseSpec, groups, frozen: set[str] | None = None, skip: tuple[str, ...] = ()) -> bool:
    """Some list group of ``groups`` (the FSDP2 prediction's) that reshards
    after forward is completed by a frozen Embedding
    (group_completed_by_frozen_embedding; reshard_after_forward=False keeps
    it unsharded for backward: group:multi-frozen-embedding-rerun)."""
    return any(len(g.modules) > 1 and g.reshard and group_completed_by_frozen_embedding(spec, g.modules, frozen, skip) for g in groups)


def _group_reruns(spec: CaseSpec, groups, skip: tuple[str, ...] = ()):
    """For each list group (fully_shard([a, b])) one of whose modules runs
    forward again after every module of the group has run: the module whose
    forward completed the group before the re-run (its graph node).
    ``groups``: the FSDP2 prediction's groups (canonical module paths)."""
    if getattr(spec, "tree", None) is None:  # a ModelCase: its own forward, order unknown
        return

    g = graph_of(spec)
    calls = forward_calls(spec, skip)
    for grp in groups:
        if len(grp.modules) < 2:
            continue
        try:
            members = {g.resolve_module(m) for m in grp.modules}
        except KeyError:
            continue
        remaining: set[str] = set()
        completed_by: str | None = None
        for nid in calls:
            if nid not in members:
                continue
            if not remaining:  # FSDP refills the group's to-run set at the first module of a pass
                if completed_by is not None:
                    yield completed_by
                remaining = set(members)
            remaining.discard(nid)
            if not remaining:
                completed_by = nid


def group_rerun(spec: CaseSpec, groups, skip: tuple[str, ...] = ()) -> bool:
    """A list group one of whose modules runs forward again after the group
    completed (the re-run registers a post-backward hook of its own: known
    failures fsdp2-list-group-reentered-loses-grad, fsdp2-list-group-rerun-
    reduces-twice)."""
    return next(_group_reruns(spec, groups, skip), None) is not None


def group_rerun_after_frozen_embedding(spec: CaseSpec, groups, frozen: set[str], skip: tuple[str, ...] = ()) -> bool:
    """A list group (fully_shard([a, b])) one of whose modules runs forward
    again after every module of the group has run, where the module whose
    forward completed the group is an Embedding whose parameters are all in
    ``frozen`` (canonical FQNs): its output needs no gradient, so the group's
    pre-backward hook sits on nothing the earlier runs' backward passes
    through (known failure fsdp2-list-group-reentered-loses-grad). ``groups``:
    the FSDP2 prediction's groups (canonical module paths)."""
    if getattr(spec, "tree", None) is None:
        return False
    g = graph_of(spec)
    for nid in _group_reruns(spec, groups, skip):
        node = g.nodes[nid]
        if g.is_torch(nid, ("Embedding",)) and node.params and all(g.param_fqn[pid] in frozen for _, pid in node.params):
            return True
    return False


def rerun_group_lost_params(spec: CaseSpec, groups) -> set[str]:
    """Canonical FQNs of the trainable parameters of the list groups that
    group_rerun_after_frozen_embedding marks, under the case's own mask:
    fsdp2-list-group-reentered-loses-grad loses their gradient."""
    frozen = _frozen_fqns(spec)
    return {fqn for grp in groups if len(grp.modules) > 1 and group_rerun_after_frozen_embedding(spec, [grp], frozen)
            for fqn in grp.managed if fqn not in frozen}


def _runs_twice(spec: CaseSpec, paths) -> bool:
    """Some module at ``paths`` has two names: the case's forward calls it
    under each."""

    g = graph_of(spec)
    try:
        return any(len(g.module_aliases(g.resolve_module(p))) > 1 for p in paths)
    except KeyError:
        return False


def container_base(spec: CaseSpec, path: str) -> bool:

    if getattr(spec, "tree", None) is None:  # a ModelCase: the target's own classes
        return False
    try:
        cls = module_at(spec.tree, path).cls
    except SpecError:
        return False
    # a drawn class (it has the case's forward) deriving, directly or through
    # other drawn classes, from torch's ModuleList or ModuleDict (release
    # matrix 2.8.0: LayerDict(BlockDict(ModuleDict)) went untagged)
    return cls in {c.name for c in spec.classes} and bool({"ModuleList", "ModuleDict"} & set(class_ancestry(spec, cls)))


def container_given_to_fully_shard(spec: CaseSpec) -> bool:
    """Some module the case gives fully_shard is a ModuleList/ModuleDict subclass with a forward."""
    return any(container_base(spec, p) for p in predict_fsdp2(spec, torch.__version__).fsdp_modules)
