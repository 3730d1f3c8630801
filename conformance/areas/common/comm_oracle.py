"""What FSDP communicates, as its documentation promises (the comm and
microbatch areas read it): per iteration, the collectives FSDP issues for
each FSDP2 parameter group or FSDP1 unit (all-gathers, reduce-scatters,
all-reduces, with numel, ranks and dtype) and, for FSDP2, the sequence of
unshard / reshard / post-backward events. Predicted from the spec and the
world size alone (no torch.distributed).

The promises it encodes, and where they are stated:

- fully_shard docstring, reshard_after_forward: True reshards after forward
  and re-all-gathers in backward; False keeps the unsharded parameters and
  avoids the backward all-gather; None is True for non-root modules and
  False for the root; an int (a non-trivial divisor of the shard mesh size)
  reshards to that world size, so that the backward all-gather spans it.
- MixedPrecisionPolicy / MixedPrecision docstrings: the parameter all-gather
  runs in param_dtype, the gradient reduction in reduce_dtype (param_dtype
  when unset).
- set_modules_to_forward_prefetch: the listed modules' all-gathers are issued
  right after this module's own; set_modules_to_backward_prefetch: the same
  in backward, replacing the default, which "prefetches the next FSDP module
  based on the reverse post-forward order".
- FSDP1's BackwardPrefetch docstring: BACKWARD_PRE prefetches the next set
  of parameters before the current set's gradient computation (in its
  pre-backward), BACKWARD_POST after it (in its post-backward), None not at
  all; forward_prefetch: the next forward all-gather before the current
  forward computation, from the second iteration on (static graph).
- upstream's own tests: test_fully_shard_comm.py (exact all-gather and
  reduce-scatter counts per reshard_after_forward, the exact event order
  under default and explicit prefetching), test_fully_shard_frozen.py (the
  reduce-scatter covers the trainable parameters only), FSDP2's unshard on a
  one-rank mesh issues no all-gather.

The forward is the suite's generic one (conformance.case.build): a module
adds its own parameters to the running activation, then calls its children
in order; the oracle follows it to know which module outputs and inputs
require gradients, hence which backward hooks run, and in which order (the
reverse of the forward's)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import KW_ONLY, dataclass

from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.areas.common.fsdp2_oracle import TORCH_CONTAINERS, predict_fsdp2
from conformance.case.spec import CaseSpec, CommPlan, ModuleSpec, flip_requires_grad
from conformance.case.tree import join, walk

ANY_TORCH = "2.13.0"  # the group structure (not version-dependent for the cases this area draws)


@dataclass(frozen=True)
class Collective:
    """One collective: ``numel`` on its unsharded side (an all-gather's
    output, a reduce-scatter's input, an all-reduce's tensor) over ``ranks``
    ranks, in ``dtype``. ``context``: FSDP1, the hook that issued it
    ("pre_forward U", "pre_backward U", "post_backward U"); "" for FSDP2."""

    phase: str  # forward | backward
    op: str  # all_gather | reduce_scatter | all_reduce | other:<name>
    group: str  # FSDP2: the group's modules, ", "-joined; FSDP1: the unit's path
    numel: int
    ranks: int
    dtype: str
    context: str = ""
    _: KW_ONLY
    # FSDP2: "custom G" where the collective goes through the custom comm
    # given to group G; an all-reduce hook's call is op "all_reduce_hook"
    # (numel: the reduce-scatter output's, ranks 1)
    via: str = ""
    # FSDP2: "" on the mesh's shard group, "separate N" on the N-th other
    # process group the iterations use (set_separate_reduce_scatter_group)
    pg: str = ""
    # the oracle's own: why this collective is promised, where that is a
    # mechanism a finding may name (not compared with what is seen)
    reason: str = ""


@dataclass(frozen=True)
class Event:
    """FSDP2: a parameter group's unshard (an all-gather started, or on one
    rank its stand-in), reshard (unsharded parameters freed) or
    post-backward, with the group's training state then."""

    kind: str  # unshard | reshard | post_backward
    group: str
    state: str  # FORWARD | PRE_BACKWARD | POST_BACKWARD


@dataclass(frozen=True)
class Iteration:
    collectives: tuple[Collective, ...]
    events: tuple[Event, ...] = ()
    backward: bool = True  # the loss requires grad, so backward runs


@dataclass(frozen=True)
class Expected:
    """What one world size must see; ``why`` is set (and nothing else
    counts) where the case is outside the promise at that world size.
    ``exact_numel``: False where the unsharded numel includes padding the
    API does not document (FSDP1 with use_orig_params=True aligns each
    parameter): then a collective's numel is at least the predicted one and
    a multiple of its ranks."""

    iterations: tuple[Iteration, ...] = ()
    why: str = ""
    exact_numel: bool = True
    # the mechanisms the run goes through that a finding may name (tags, not compared)
    notes: frozenset[str] = frozenset()
    # set where the collectives are predicted but not the order of the
    # events (COMM-ORDER, MB-COMMS): why not
    order_why: str = ""


@dataclass(frozen=True)
class Step:
    kind: str  # enter | exit
    path: str
    grad: bool  # enter: the module's input requires grad; exit: its output does
    tensor: int = -1  # exit: which tensor the output is (a module returning its last child's output shares it)
    input: int = -1  # enter: which tensor the module's forward is given (-1: one of its own, an index, a view)


def timeline(spec: CaseSpec, grad: frozenset[str], input_grad: bool = False,
             skip: frozenset[str] = frozenset()) -> tuple[tuple[Step, ...], bool]:
    """The forward's module entries and exits in order, each with whether
    the tensor there requires grad (``grad``: the FQNs of the parameters
    autograd differentiates; ``input_grad``: the model's input requires
    grad too; ``skip``: modules the forward passes over), and whether the
    loss does."""
    steps: list[Step] = []

    tied = {}
    for t in spec.ties:  # the generic forward adds a tied parameter as its own (conformance.case.build)
        tied.setdefault(t.module, []).append(t.name)

    def _trainable_own(m: ModuleSpec, path: str) -> bool:
        return any(join(path, n) in grad for n in [p.name for p in m.params] + tied.get(path, []))
    count = [0]

    def new() -> int:
        count[0] += 1
        return count[0]

    called = called_containers(spec)

    def call(m: ModuleSpec, path: str, x: bool, t: int) -> tuple[bool, int]:
        if path in skip:
            return x, t
        if m.cls in TORCH_CONTAINERS and path not in called:  # torch's own containers are iterated, never called
            for c in m.children:
                x, t = call(c, join(path, c.name), x, t)
            return x, t
        if m.cls == "Embedding":  # its input is an index, never differentiable
            steps.append(Step("enter", path, False))
            out = _trainable_own(m, path)
            steps.append(Step("exit", path, out, new()))
            return out or x, new()  # the residual: f(i) + x
        if m.cls in ("Linear", "LayerNorm"):  # given a view of the activation (conformance.case.build.call_child)
            steps.append(Step("enter", path, x))
            out = x or _trainable_own(m, path)
            steps.append(Step("exit", path, out, new()))
            return out, new()  # the residual: f(x) + x
        steps.append(Step("enter", path, x, input=t))  # given the activation itself
        y = x or _trainable_own(m, path)
        if m.params or m.buffers:
            t = new()
        for c in m.children:
            y, t = call(c, join(path, c.name), y, t)
        steps.append(Step("exit", path, y, t))
        return y, t

    loss, _ = call(spec.tree, "", input_grad, 0)
    return tuple(steps), loss


def called_containers(spec: CaseSpec) -> frozenset[str]:
    """torch's Sequential modules that the case calls: FSDP1 units (called
    through their wrapper) and modules given to fully_shard (FSDP2's hooks
    on them), as a user's model calls a Sequential
    (conformance.case.build.call_child). They are entered and exited like
    any module (no parameters of their own); every other torch container
    is only iterated."""
    kinds = {path: m.cls for path, m in walk(spec.tree)}
    if spec.plan.api == "fsdp2":
        paths = {m for grp in spec.plan.groups for m in grp.modules}
    else:
        pred = predict_fsdp1(spec)
        paths = {u.path for u in pred.units} if pred.error is None else set()
    return frozenset(p for p in paths if p and kinds.get(p) == "Sequential")


def backward_order(steps: tuple[Step, ...]) -> list[Step]:
    """The steps in the order backward reaches them: the forward reversed,
    except that modules whose outputs are one tensor (a module returning its
    last child's output) see their pre-backward hooks fire together, in the
    order they were registered (the forward's)."""
    out: list[Step] = []
    done: set[int] = set()
    for s in reversed(steps):
        if s.kind == "exit":
            if s.tensor in done:
                continue
            done.add(s.tensor)
            out += [x for x in steps if x.kind == "exit" and x.tensor == s.tensor]
        else:
            out.append(s)
    return out


def param_shapes(spec: CaseSpec) -> dict[str, tuple[tuple[int, ...], bool]]:
    out = {}

    def walk(m: ModuleSpec, path: str) -> None:
        for p in m.params:
            out[join(path, p.name)] = (p.shape, p.requires_grad)
        for c in m.children:
            walk(c, join(path, c.name))

    walk(spec.tree, "")
    for t in spec.ties:  # a tied name is the very Parameter at its source (conformance.case.build)
        out[join(t.module, t.name)] = out[t.source]
    return out


def padded_numel(shape: tuple[int, ...], world: int) -> int:
    """FSDP2's per-parameter Shard(0): each rank holds ceil(dim0 / W) rows
    (padded); the unsharded side of a collective is W of those."""
    rest = math.prod(shape[1:])
    return world * math.ceil(shape[0] / world) * rest


@dataclass(frozen=True)
class Knobs:
    """FSDP2's schedule settings in force for one iteration (a microbatch):
    set_requires_gradient_sync, set_reshard_after_backward,
    set_is_last_backward and set_reshard_after_forward (None: unchanged) on
    the root (recurse), and an explicit ``unshard`` (the module whose
    unshard() runs and is waited for before the forward; None: none), then
    with ``reshard`` its reshard()."""

    sync: bool = True
    reshard_after_backward: bool = True
    is_last_backward: bool = True
    reshard_after_forward: bool | None = None
    unshard: str | None = None
    reshard: bool = False


@dataclass(frozen=True)
class FSDP2Comm:
    """What an FSDP2 run sets besides its groups: mixed precision, explicit
    prefetching, the groups whose matrices are Shard(1), and per iteration
    its Knobs."""

    knobs: tuple[Knobs, ...]
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    forward_prefetch: tuple[tuple[str, tuple[str, ...]], ...] = ()
    backward_prefetch: tuple[tuple[str, tuple[str, ...]], ...] = ()
    shard_dim1: tuple[str, ...] = ()
    # parameters whose requires_grad flips after the first iteration (CommPlan.refreeze)
    refreeze: tuple[str, ...] = ()
    # groups (their first module) told set_unshard_in_backward(False): no
    # all-gather in backward, their own pre-backward's or a prefetch's
    no_backward_unshard: tuple[str, ...] = ()
    # groups (their first module) given set_all_reduce_hook: the hook runs
    # once per reduction of the group's gradients, on the reduce-scatter
    # output (a one-rank mesh's too, which has no reduce-scatter)
    all_reduce_hook: tuple[str, ...] = ()
    # groups (their first module) given set_custom_all_gather and
    # set_custom_reduce_scatter: every all-gather and reduce-scatter of
    # theirs goes through them
    custom_comms: tuple[str, ...] = ()
    # per iteration, the modules the simulated rank's forward passes over
    # (empty: none); a group reduce-scatters every trainable parameter it
    # holds whether or not the rank used it (set_reduce_scatter_unused_params)
    skips: tuple[frozenset[str], ...] = ()
    # per iteration, set_separate_reduce_scatter_group(True / False) on the
    # root (recurse) before it, or None (empty: never): while enabled every
    # reduce-scatter runs on one process group of its own over the shard
    # ranks, a new one after each disable
    separate_rs: tuple[bool | None, ...] = ()
    # HSDP: the replicate dim's size of a 2-D mesh (0: a 1-D mesh, no
    # all-reduce group), and per iteration set_requires_all_reduce (empty:
    # always): a reduction all-reduces the reduce-scatter output (with what
    # earlier reductions without all-reduce left) over the replicate dim
    # only where it is set, and the all-reduce hook runs after it
    replicate: int = 0
    all_reduce: tuple[bool, ...] = ()


NO_BACKWARD_FIRST = ("requires_grad flipped after a first iteration with no backward (its loss needed no gradient): its forward left "
                     "parameters unsharded (FSDP2's root, reshard_after_forward False or an int; FSDP1's SHARD_GRAD_OP and NO_SHARD), "
                     "and fully_shard's docstring has the registered parameters be the sharded ones to be modified (reshard() first); "
                     "FSDP1 FULL_SHARD's form is the finding fsdp1-unfreeze-frozen-unit-orig-params, which the schedule area checks")


# ---- FSDP2 -----------------------------------------------------------------


def simulate_fsdp2(spec: CaseSpec, world: int, c: FSDP2Comm, input_grad: bool = False) -> Expected:
    """FSDP2's collectives and events, iteration by iteration (the suite's
    generic forward, loss (out ** 2).sum(), a backward when it requires grad;
    ``input_grad``: the model's input requires grad)."""
    pred = predict_fsdp2(spec, ANY_TORCH)
    if pred.supported:
        return Expected(why=pred.supported)
    params = param_shapes(spec)
    ag_dtype = c.param_dtype or "float32"
    rs_dtype = c.reduce_dtype or ag_dtype
    groups = {}  # module path -> (label, managed, trainable, reshard)
    for g in pred.groups:
        if not g.managed:
            continue  # no parameters: no parameter group, nothing to communicate
        raf = g.reshard
        if not isinstance(raf, bool):
            if not (1 < raf < world and world % raf == 0):
                return Expected(why=f"reshard_after_forward={raf} is not a non-trivial divisor of the world size {world}")
        groups[g.modules[0]] = (", ".join(g.modules), g.managed, g.trainable, raf)
    states = {g.modules[0] for g in pred.groups}  # every module given to fully_shard, with parameters or not
    steps, loss = timeline(spec, frozenset(f for f, (_, rg) in params.items() if rg), input_grad)
    # after a refreeze: the same groups, other trainable parameters (FSDP2
    # sets each unsharded parameter's requires_grad from the sharded one's at
    # every all-gather, and reduce-scatters the gradients there are)
    later = None
    trainable_later: set[str] = set()  # groups frozen in the first iteration, trainable after the refreeze
    if c.refreeze:
        if not loss:
            return Expected(why=NO_BACKWARD_FIRST)
        after = flip_requires_grad(spec, c.refreeze)
        after_pred = predict_fsdp2(after, ANY_TORCH)
        if after_pred.supported:
            return Expected(why=f"after the refreeze: {after_pred.supported}")
        trainable = {g.modules[0]: g.trainable for g in after_pred.groups}
        trainable_later = {m for m in groups if not groups[m][2] and trainable.get(m)}
        after_params = param_shapes(after)
        later = (*timeline(after, frozenset(f for f, (_, rg) in after_params.items() if rg), input_grad), trainable)
    order = [s.path for s in steps if s.kind == "enter" and s.path in groups]  # pre-order: all_states' order
    fwd_prefetch = {m: [t for t in ts if t in groups] for m, ts in c.forward_prefetch}
    bwd_prefetch = {m: [t for t in ts if t in groups] for m, ts in c.backward_prefetch}
    for m in c.shard_dim1:
        if m in groups and any(len(params[f][0]) >= 2 and params[f][0][1] % world for f in groups[m][1]):
            return Expected(why=f"Shard(1) of a matrix in {m or '<root>'} whose dim 1 the world size {world} does not divide (FSDP2 shards dim 1 evenly only)")

    def numel(m: str, f: str) -> int:
        shape = params[f][0]
        if m in c.shard_dim1 and len(shape) >= 2:
            return math.prod(shape)  # Shard(1), even
        return padded_numel(shape, world)

    notes: set[str] = set()
    # fully_shard([a, b]) runs the group's pre-forward (its all-gather, and
    # its post-backward hook on that call's inputs) at whichever of its
    # modules runs first and its post-forward after the last; the timeline
    # below follows a group on the first module it was given: its
    # collectives (once per forward, once per resharded backward, one
    # reduce-scatter) hold, its events' places among other groups' do not
    order_why = ("a multi-module FSDP2 group: the oracle places a group's hooks on its first module only"
                 if any(len(g.modules) > 1 for g in pred.groups if g.managed) else "")
    if any(m in groups and not isinstance(groups[m][3], bool) and any(len(params[f][0]) >= 2 for f in groups[m][1])
           for m in c.shard_dim1):
        notes.add("int-reshard-of-shard-dim1")  # a Shard(1) matrix resharded to the int world after forward
    if any(m in groups and not isinstance(groups[m][3], bool) and any(len(params[f][0]) >= 2 and params[f][0][0] == 1 for f in groups[m][1])
           for m in c.shard_dim1):
        # ... a one-row one: the forward's reshard raises on some ranks only (the others then wait)
        notes.add("int-reshard-of-shard-dim1-one-row")
    def via(m: str) -> str:
        return f"custom {groups[m][0]}" if m in c.custom_comms else ""

    full = {m: sum(numel(m, f) for f in groups[m][1]) for m in groups}
    grads = {m: sum(numel(m, f) for f in groups[m][2]) for m in groups}
    has_grads = {m: bool(groups[m][2]) for m in groups}
    state = {m: "sharded" for m in groups}  # sharded | unsharded | post (resharded to the int world)
    post_ranks = {m: world for m in groups}  # the world a "post" group is sharded over
    pending = {m: False for m in groups}  # an all-gather issued, not yet waited for
    raf_now = {m: groups[m][3] for m in groups}
    post_order: list[str] = []  # cleared by the last backward's final callback
    indices: dict[str, list[int]] = {m: [] for m in groups}
    out = []
    trainable_now = frozenset(f for f, (_, rg) in params.items() if rg)
    rs_group = [0]  # the separate reduce-scatter group in force (its number; 0: the shard group)
    made = [0]  # separate groups made so far
    for it, k in enumerate(c.knobs):
        if c.separate_rs and c.separate_rs[it] is not None:
            if not c.separate_rs[it]:
                rs_group[0] = 0
            elif not rs_group[0]:  # enabling while enabled keeps the group (idempotent)
                made[0] += 1
                rs_group[0] = made[0]
        if it == 1 and later is not None:
            steps, loss, trainable = later
            grads = {m: sum(numel(m, f) for f in trainable[m]) for m in groups}
            has_grads = {m: bool(trainable[m]) for m in groups}
        if c.skips:
            steps, loss = timeline(spec, trainable_now, input_grad, c.skips[it])
        events: list[Event] = []
        colls: list[Collective] = []
        training = {m: "IDLE" for m in groups}
        if k.reshard_after_forward is not None:
            raf_now = {m: k.reshard_after_forward for m in groups}
            if any(state[m] == "post" for m in groups):
                # set_reshard_after_forward while a group is resharded to its
                # int world (a forward with no backward since): its next
                # all-gather still gathers the shards it holds
                notes.add("set-reshard-after-forward-while-post-sharded")

        def unshard(m: str, st: str, phase: str) -> None:
            """Issue the all-gather (a prefetch stops here; the group's own
            pre-forward or pre-backward waits for it)."""
            if state[m] == "unsharded" or pending[m] or (st == "PRE_BACKWARD" and m in c.no_backward_unshard):
                return
            label = groups[m][0]
            events.append(Event("unshard", label, st))
            if world > 1:
                ranks = post_ranks[m] if state[m] == "post" else world
                colls.append(Collective(phase, "all_gather", label, full[m], ranks, ag_dtype, via=via(m)))
            pending[m] = True

        def wait(m: str) -> None:
            if pending[m]:
                state[m], pending[m] = "unsharded", False

        def reshard(m: str, st: str) -> None:
            raf = raf_now[m]
            if st == "FORWARD":
                if raf is False:
                    return
                new = "sharded" if raf is True else "post"
            else:
                new = "sharded"
            if new == "post":
                post_ranks[m] = raf
            if state[m] != new:
                events.append(Event("reshard", groups[m][0], st))
                state[m] = new

        def post_backward(m: str) -> None:
            training[m] = "POST_BACKWARD"
            if k.reshard_after_backward:
                reshard(m, "POST_BACKWARD")
            if k.sync and has_grads[m] and world > 1:  # with gradients accumulated since the last sync
                # a group frozen at lazy init takes its dtypes then (the finding
                # fsdp2-unfreeze-frozen-group-mixed-precision names this reason)
                colls.append(Collective("backward", "reduce_scatter", groups[m][0], grads[m], world, rs_dtype, via=via(m),
                                        pg=f"separate {rs_group[0]}" if rs_group[0] else "",
                                        reason="trainable-later" if m in trainable_later else ""))
            reduced = k.sync and has_grads[m]
            all_reduce = not c.all_reduce or c.all_reduce[it]
            if reduced and c.replicate and all_reduce:  # HSDP: over the replicate dim (a one-rank one too)
                colls.append(Collective("backward", "all_reduce", groups[m][0], grads[m] // world, c.replicate, rs_dtype))
            if reduced and m in c.all_reduce_hook and (all_reduce or not c.replicate):
                # the user's all-reduce, on the reduce-scatter output (HSDP: on the all-reduce output)
                colls.append(Collective("backward", "all_reduce_hook", groups[m][0], grads[m] // world, 1, rs_dtype))
            events.append(Event("post_backward", groups[m][0], "POST_BACKWARD"))

        if k.unshard is not None and k.unshard in groups:  # the module's unshard(), waited for
            unshard(k.unshard, "IDLE", "forward")
            wait(k.unshard)
            if k.reshard:
                reshard(k.unshard, "IDLE")
        for s in steps:
            if s.path not in states:
                continue
            if s.kind == "enter":
                if s.path in groups:
                    training[s.path] = "FORWARD"
                    unshard(s.path, "FORWARD", "forward")
                    wait(s.path)
                for t in fwd_prefetch.get(s.path, ()):  # a state without parameters prefetches too
                    unshard(t, "FORWARD", "forward")
            elif s.path in groups:
                reshard(s.path, "FORWARD")
                indices[s.path].append(len(post_order))
                post_order.append(s.path)
                training[s.path] = "IDLE"
        if loss:
            for s in backward_order(steps):
                if s.path not in states or not s.grad:
                    continue
                m = s.path
                if s.kind == "exit":
                    if m in groups and training[m] != "PRE_BACKWARD":
                        training[m] = "PRE_BACKWARD"
                        unshard(m, "PRE_BACKWARD", "backward")
                        wait(m)
                        if m not in bwd_prefetch and indices[m]:
                            i = indices[m].pop()
                            if i > 0:
                                unshard(post_order[i - 1], "PRE_BACKWARD", "backward")
                    for t in bwd_prefetch.get(m, ()):
                        unshard(t, "PRE_BACKWARD", "backward")
                elif m in groups:
                    post_backward(m)
            # the root's final callback: every group whose inputs did not
            # require grad (its post-backward hook never ran), in pre-order
            for m in order:
                if training[m] != "POST_BACKWARD":
                    post_backward(m)
            if k.is_last_backward:
                # finalize_backward: an all-gather prefetched but never waited
                # for (a mistargeted prefetch) is dropped; the group stays
                # sharded; the post-forward order starts again
                for m in groups:
                    pending[m] = False
                    indices[m].clear()
                post_order.clear()
        out.append(Iteration(tuple(colls), tuple(events), loss))
    return Expected(_number_groups_as_seen(tuple(out)), notes=frozenset(notes), order_why=order_why)


def _number_groups_as_seen(iterations: tuple[Iteration, ...]) -> tuple[Iteration, ...]:
    """Separate process groups numbered in the order their first collective
    comes, as the recorder numbers the groups it sees (a group made and
    never used is never seen)."""
    order: dict[str, str] = {}
    for it in iterations:
        for c in it.collectives:
            if c.pg and c.pg not in order:
                order[c.pg] = f"separate {len(order) + 1}"
    if all(k == v for k, v in order.items()):
        return iterations
    return tuple(dataclasses.replace(it, collectives=tuple(dataclasses.replace(c, pg=order.get(c.pg, "")) for c in it.collectives))
                 for it in iterations)


# ---- FSDP1 -----------------------------------------------------------------


def simulate_fsdp1(spec: CaseSpec, world: int, c: CommPlan, input_grad: bool = False) -> Expected:
    """FSDP1's collectives iteration by iteration, each with the hook that
    issues it (``input_grad``: the model's input requires grad)."""
    pred = predict_fsdp1(spec)
    if pred.error is not None:
        return Expected(why="FSDP1 rejects the case (FROZEN-ERROR)")
    params = param_shapes(spec)
    ag_dtype = c.param_dtype or "float32"
    rs_dtype = c.reduce_dtype or ag_dtype
    units = {}  # path -> (numel, has trainable)
    for u in pred.units:
        if u.managed:
            numel = sum(math.prod(params[f][0]) for f in u.managed)
            units[u.path] = (numel, bool(u.trainable))
    strategy = c.sharding_strategy
    sharded = strategy != "NO_SHARD"
    # the flat parameter: padded to a multiple of the world size when
    # sharded; use_orig_params=True also aligns each parameter (undocumented)
    full = {p: (math.ceil(n / world) * world if sharded else n) for p, (n, _) in units.items()}
    # use_orig_params=True: a unit's flat parameter requires grad as a whole,
    # its frozen parameters' gradients included (the frozen-parameter warning:
    # "the gradient memory usage will be higher than expected (<total> numel
    # instead of <trainable> numel before sharding via reduce-scatter)")
    grad = frozenset(f for u in pred.units if u.trainable for f in u.managed)
    steps, loss = timeline(spec, grad, input_grad)
    # after a refreeze (use_orig_params=True): the same units; at the root's
    # pre-forward each flat parameter requires grad as any of its original
    # parameters does (FlatParamHandle._reset_flat_param_grad_info_if_needed:
    # "As long as one parameter requires gradient, then the flat parameter
    # must require gradient")
    later = None
    if c.refreeze:
        if not loss:
            return Expected(why=NO_BACKWARD_FIRST)
        after_spec = flip_requires_grad(spec, c.refreeze)
        after = predict_fsdp1(after_spec)
        trainable = {u.path: bool(u.trainable) for u in after.units}
        after_grad = frozenset(f for u in after.units if u.trainable for f in u.managed)
        later = (*timeline(after_spec, after_grad, input_grad), {p: (n, trainable[p]) for p, (n, _) in units.items()})
    # "kept": resharded to its shard, the unsharded flat parameter still
    # allocated (the next unshard gathers nothing)
    state = {p: "sharded" if sharded else "unsharded" for p in units}
    pre_order: list[str] = []  # recorded on the first iteration
    late: dict[str, str] = {}  # units resharded by the final callback, and how they got there
    out = []
    for it in range(c.iterations):
        if it == 1 and later is not None:
            steps, loss, units = later
        # inside no_sync(): no reduction (FSDP1's no_sync docstring), and a
        # strategy that does not reshard after forward (SHARD_GRAD_OP) keeps
        # the unsharded parameters after backward, so the next forward
        # gathers nothing (upstream test_fsdp_comm.py, test_communication
        # with use_no_sync: 0 all-gathers in the forward after a no_sync
        # iteration under SHARD_GRAD_OP)
        sync = not (c.fsdp1_no_sync and c.fsdp1_no_sync[it])
        free = sync or strategy == "FULL_SHARD"
        colls: list[Collective] = []
        post_order: list[str] = []
        needs_bw = {p: False for p in units}
        prefetched = {p: False for p in units}
        ran_pre_bw = {p: False for p in units}
        ran_post_bw = {p: False for p in units}
        ran_fwd: set[str] = set()

        def unshard(p: str, phase: str, ctx: str) -> None:
            if state[p] == "sharded":
                colls.append(Collective(phase, "all_gather", p, full[p], world, ag_dtype, ctx, reason=late.pop(p, "")))
            elif state[p] == "kept":
                late.pop(p, None)
            state[p] = "unsharded"

        def reshard(p: str, keep: bool = False) -> None:
            if sharded:
                state[p] = "kept" if keep else "sharded"
                prefetched[p] = False

        for s in steps:
            p = s.path
            if p not in units:
                continue
            if s.kind == "enter":
                ctx = f"pre_forward {p}"
                if not prefetched[p]:
                    unshard(p, "forward", ctx)
                prefetched[p] = False
                ran_fwd.add(p)
                if it == 0:
                    pre_order.append(p)
                elif c.fsdp1_forward_prefetch:
                    i = pre_order.index(p) + 1
                    if i < len(pre_order):
                        t = pre_order[i]
                        if t not in ran_fwd and not prefetched[t]:
                            unshard(t, "forward", ctx)
                            prefetched[t] = True
            else:
                # FULL_SHARD reshards after forward, except the root's unit
                if strategy == "FULL_SHARD" and p != "":
                    reshard(p)
                needs_bw[p] = s.grad
                post_order.append(p)
        if loss:
            def prefetch(p: str, phase: str, ctx: str, either: bool = False) -> None:
                i = post_order.index(p)
                if i > 0:
                    t = post_order[i - 1]
                    if needs_bw[t] and not prefetched[t]:
                        # either: the prefetch or the target's own pre-backward
                        # gather, whichever autograd's hook order runs first
                        unshard(t, phase, f"{ctx} or pre_backward {t}" if either else ctx)
                        prefetched[t] = True

            def pre_backward(p: str) -> None:
                ran_pre_bw[p] = True
                ctx = f"pre_backward {p}"
                if needs_bw[p] and not prefetched[p]:
                    unshard(p, "backward", ctx)
                needs_bw[p] = False
                if c.fsdp1_backward_prefetch == "BACKWARD_PRE":
                    prefetch(p, "backward", ctx)

            for s in backward_order(steps):
                p = s.path
                if p not in units:
                    continue
                if s.kind == "exit" and s.grad and not ran_pre_bw[p]:
                    pre_backward(p)
                elif s.kind == "enter" and (units[p][1] or s.grad):
                    if not units[p][1] and s.input >= 0:
                        # a frozen unit's reshard-only hook is a hook on its
                        # input's gradient (_register_post_backward_reshard_only_hook,
                        # registered at its pre-forward): given the activation
                        # itself (not a view; MixedPrecision's cast_forward_inputs
                        # is False here, so no cast of it either), it fires after
                        # the pre-backward hooks that units whose output that
                        # tensor is registered on it earlier (thorough seed 72)
                        for x in steps:
                            if x.kind == "exit" and x.tensor == s.input and x.grad and x.path in units and not ran_pre_bw[x.path]:
                                pre_backward(x.path)
                    # the flat parameter's gradient is ready (its post-backward
                    # hook), or for a frozen unit its inputs' gradients (the
                    # reshard-only post-backward hook)
                    ctx = f"post_backward {p}"
                    ran_post_bw[p] = True
                    reshard(p, keep=not free)
                    if c.fsdp1_backward_prefetch == "BACKWARD_POST":
                        # a frozen unit has no gradient computation to prefetch
                        # after ("after the current set of parameters' gradient
                        # computation"): its reshard-only hook fires with its
                        # inputs' gradients, which may be the next unit's own
                        # pre-backward moment; where it gathers is not promised
                        prefetch(p, "backward", ctx, either=not units[p][1])
                    if units[p][1] and sync:
                        op = "reduce_scatter" if sharded else "all_reduce"
                        colls.append(Collective("backward", op, p, full[p], world, rs_dtype, ctx))
            for p in units:  # the final callback reshards what is left unsharded
                if sharded and state[p] == "unsharded":
                    late[p] = "after-no-backward-hook" if not (ran_pre_bw[p] or ran_post_bw[p]) else "after-final-callback-reshard"
                    reshard(p, keep=not free)
        out.append(Iteration(tuple(colls), (), loss))
    return Expected(tuple(out), exact_numel=not spec.plan.use_orig_params)
