"""Standalone, torch-only reproduction scripts for training-schedule cases
(MP-DTYPES, ACCUM, MP-PIPELINE): the case's model under FSDP1 or FSDP2 with
its mixed precision, its steps, freeze masks and microbatches, next to fp32
single-process training on every rank's data (and an emulation of the
promised mixed-precision pipeline: FSDP1's compares losses, and the
gradients of synced steps with use_orig_params=True); prints what differs."""

from __future__ import annotations

import textwrap

from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.areas.common.fsdp2_oracle import shard_order
from conformance.areas.common.repro import (
    FSDP2_RUNTIME,
    HARNESS,
    assemble,
    class_code,
    from_import,
    header,
    model_lines,
    policy_code,
    policy_imports,
)
from conformance.areas.schedule.oracle import EPS, PIPELINE_SLACK, cast_paths, other_slack, predict_schedule, reuse_slack
from conformance.case.graph import ModelGraph
from conformance.case.spec import CaseSpec
from conformance.case.tree import join, walk

# What a schedule adds to the harness and the case's forward (FSDP2_RUNTIME, whose call_child and
# generic_forward honour a microbatch's case_skip).
_RUNTIME = '''
def encode(self, x):  # the registered method a schedule may call first
    return self.forward(x)


class ReduceDtypes(TorchDispatchMode):
    """The gradient-reduction collectives a backward issues, with their dtypes."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if "reduce_scatter" in name or "allreduce" in name or "all_reduce" in name:
            ts = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            self.seen.append(f"{name}:{ts[0].dtype if ts else '?'}")
        return func(*args, **(kwargs or {}))
'''

_MAIN = '''
def data(step, micro, rank):
    gen = torch.Generator().manual_seed(SEED * 7919 + step * 613 + micro * 31 + rank)
    return (0.5 * torch.randn(2, generator=gen)).to(DEVICE)


def optimizer(params):
    params = list(params)
    if OPTIMIZER == "Adam":
        return torch.optim.Adam(params, lr=LR)
    if OPTIMIZER == "AdamW":
        return torch.optim.AdamW(params, lr=LR)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def cast_floats(tree, dtype):
    return torch.utils._pytree.tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t, tree)


def pipeline_tolerance(name=None, microbatches=1):
    """MP-PIPELINE: fp32 slack (with more than two ranks, beyond
    order_slack); a few roundings more for a loss of a case that reuses a
    parameter or module, and for the gradient of a reused parameter
    (autograd sums its contributions in no promised order), per microbatch
    its step accumulates; under FSDP2 any other gradient of such a case a
    few fp32 roundings more."""
    reused = REUSE_ALL or (name in REUSED if name is not None else bool(REUSED))
    return PIPELINE_SLACK + (REUSE_SLACK * max(1, microbatches) if reused else OTHER_SLACK)


def order_slack(have, world, red):
    """How far, element by element, two orders of the ranks' sum in
    reduce_dtype may land apart (no order is promised): 2 (n-1) u sum |x_i|
    (Higham, eq. 4.4), over the world, plus a rounding of the mean on each
    side where the world is no power of two; none with two ranks. Where a
    contribution is subnormal (or becomes so divided), FSDP's power-of-two
    pre-division rounds it: a rounding of the mean on each side and the
    subnormal spacing per contribution more."""
    if len(have) < 2:
        return torch.zeros_like(red)
    out = torch.zeros_like(red, dtype=torch.float32)
    if world > 2:
        mag = sum(a.float().abs() for a in have)
        out = 2 * 1.01 * (len(have) - 1) * REDUCE_EPS * mag / world
        out = out if world & (world - 1) == 0 else out + 2 * 1.01 * REDUCE_EPS * red.abs()
    fi = torch.finfo(have[0].dtype)
    sub = torch.zeros_like(out, dtype=torch.bool)
    for a in have:
        sub |= (a != 0) & (a.float().abs() < world * fi.tiny)
    return torch.where(sub, out + 2 * 1.01 * REDUCE_EPS * red.float().abs() + len(have) * fi.tiny * fi.eps, out)


def rel(a, b, slack=None):
    a = torch.zeros_like(b) if a is None else a.detach().float()
    b = b.detach().float()
    d = (a - b).abs() if slack is None else ((a - b).abs() - slack).clamp_min(0)
    return float(d.max() / (1 + b.abs().max())) if b.numel() else 0.0


def unsharded_flat_grad(fsdp):
    """FSDP1, before summon_full_params(with_grads=True): a unit's flat
    gradient that is not of its sharded flat parameter's shape and dtype
    makes the summon raise on this rank while the others wait in its
    all-gather (internals, as the suite reads them)."""
    for unit in FSDP.fsdp_modules(fsdp):
        flat = getattr(getattr(unit, "_handle", None), "flat_param", None)
        if flat is None or flat.grad is None:
            continue
        g, want = flat.grad, tuple(getattr(flat, "_sharded_size", flat.shape))
        if tuple(g.shape) != want or g.dtype != flat.dtype:
            return f"a unit's flat gradient is {g.dtype} {list(g.shape)}, its sharded flat parameter {flat.dtype} {list(want)}"
    return None


def raised(rank, where, e):
    """A deviation: what FSDP raised on this rank, and where."""
    return f"[rank {rank}] {where} raised {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def main():
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = []
    model, mods = build()
    model.to(DEVICE)
    ref = copy.deepcopy(model)  # fp32 single-process training
    ref_mods = {p: ref.get_submodule(p) for p in mods}
    seen = {}
    for path, mod in mods.items():
        names = [n for n, _ in mod.named_parameters(recurse=False)]
        def hook(m, args, path=path, names=names):
            seen.setdefault(path, ([a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()],
                                   {n: getattr(m, n).dtype for n in names}))
        mod.register_forward_pre_hook(hook)
    fsdp = wrap(model, mods)
    inner = model if API == "fsdp2" else fsdp.module
    armed, handed = [], []
    if USER_CASTS:  # FSDP promises no cast of the root's inputs: the user's own, after FSDP's pre-forward
        def user_cast(m, args, kwargs):
            if armed:  # the test's call: what FSDP handed the root's forward
                handed.append([a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()])
                armed.clear()
            return cast_floats(args, INPUT_DTYPE), cast_floats(kwargs, INPUT_DTYPE)
        inner.register_forward_pre_hook(user_cast, with_kwargs=True)
    opt, ropt = optimizer(fsdp.parameters()), optimizer(ref.parameters())
    names = [n for n, _ in ref.named_parameters()]
    if EMULATE:  # the promised mixed-precision pipeline on one process (the suite's MP-PIPELINE)
        emu, emu_mods = build()
        emu.to(DEVICE)
        for m in emu.modules() if BUFFER_CAST is not None else ():  # FSDP1's buffer_dtype
            for n, b in list(m._buffers.items()):
                if b is not None and b.is_floating_point():
                    m._buffers[n] = b.to(BUFFER_CAST)
        for path in CAST_AT if CAST_INPUTS else ():  # the modules that cast their inputs to param_dtype
            emu_mods[path].register_forward_pre_hook(lambda m, a, kw: (cast_floats(a, COMPUTE), cast_floats(kw, COMPUTE)), with_kwargs=True)
        if OUTPUT is not None:  # the root casts its output
            emu.register_forward_hook(lambda m, a, out: cast_floats(out, OUTPUT))

    def full_values():
        if API == "fsdp2":
            return {n: (lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t)(read_attr(inner, n).detach()).clone() for n in names}
        with FSDP.summon_full_params(fsdp, writeback=False):
            return {n: read_attr(fsdp, n).detach().clone() for n in names}

    def set_skip(skip):
        for ms in (mods, ref_mods) + ((emu_mods,) if EMULATE else ()):
            for path, mod in ms.items():
                mod.__dict__["case_skip"] = {c.rpartition(".")[2] for c in skip if c.rpartition(".")[0] == path}

    for si, (frozen, microbatches, sync_every) in enumerate(SCHEDULE):
        if API == "fsdp2" or USE_ORIG_PARAMS:
            for n, p in list(inner.named_parameters()) + list(ref.named_parameters()):
                p.requires_grad_(n.replace("_fsdp_wrapped_module.", "") not in frozen)
        try:
            start = full_values()
        except Exception as e:
            return finish(raised(rank, f"step {si} values", e), None)
        with torch.no_grad():  # the reference restarts from FSDP's values at every step
            for n, v in start.items():
                read_attr(ref, n).copy_(v.float())
                if EMULATE:
                    read_attr(emu, n).data = v.to(COMPUTE)
                    read_attr(emu, n).requires_grad_(n not in frozen)
        acc, emu_grads, emu_slack = [{} for _ in range(world)], {}, {}  # each rank's unsynced gradients; the reductions; their order slack
        opt.zero_grad(set_to_none=True)
        ropt.zero_grad(set_to_none=True)
        for k, skip in enumerate(microbatches):
            sync = sync_every or k == len(microbatches) - 1
            set_skip(skip)
            seen.clear()
            fn = fsdp.encode if (si, k, FIRST_METHOD) == (0, 0, True) else fsdp
            try:
                if API == "fsdp2":
                    fsdp.set_requires_gradient_sync(sync)
                with (fsdp.no_sync() if API == "fsdp1" and not sync else contextlib.nullcontext()), ReduceDtypes() as rec:
                    plain = USER_CASTS and fn is fsdp  # fed as it is: FSDP leaves it, the user's hook casts it
                    armed[:], handed[:] = [True] if plain else [], []
                    out = fn(data(si, k, rank) if plain else data(si, k, rank).to(INPUT_DTYPE))
                    loss = (out.float() ** 2).sum()
                    if loss.requires_grad:
                        loss.backward()
            except Exception as e:
                return finish(raised(rank, f"step {si} microbatch {k}", e), None)
            ref_fn = ref.encode if (si, k, FIRST_METHOD) == (0, 0, True) else ref
            losses = [(ref_fn(data(si, k, r)) ** 2).sum() for r in range(world)]
            total = sum(losses) / world
            if total.requires_grad:
                total.backward()
            where = f"[rank {rank}] step {si} microbatch {k}"
            if handed and any(d != torch.float32 for d in handed[0]):
                wrong.append(f"{where}: the root's forward got {handed[0]} inputs where FSDP promises no cast ({NO_CAST}), expected them as fed (torch.float32)")
            if OUTPUT_DTYPE is not None and str(out.dtype) != OUTPUT_DTYPE:
                wrong.append(f"{where}: output {out.dtype}, expected {OUTPUT_DTYPE}")
            if rel(loss, losses[rank]) > TOLERANCE:
                wrong.append(f"{where}: loss off by {rel(loss, losses[rank]):.3g} from fp32 training")
            if EMULATE:
                emu_losses = []
                for r in range(world):  # each rank's microbatch on its own, in param_dtype
                    for p in emu.parameters():
                        p.grad = None
                    x = data(si, k, r).to(INPUT_DTYPE)
                    if (si, k, FIRST_METHOD) == (0, 0, True):  # the registered method runs the root's pre- and post-forward
                        eo = emu.encode(cast_floats(x, COMPUTE) if CAST_INPUTS else x)
                        eo = cast_floats(eo, OUTPUT) if OUTPUT is not None else eo
                    else:
                        eo = emu(x)
                    el = (eo.float() ** 2).sum()
                    if el.requires_grad:
                        el.backward()
                    emu_losses.append(el.detach())
                    for n in names:  # accumulated in reduce_dtype while sync is off
                        p = read_attr(emu, n)
                        if p.grad is not None:
                            if n in acc[r]:
                                acc[r][n].add_(p.grad)
                            else:
                                acc[r][n] = p.grad.to(REDUCE, copy=True)
                if sync:  # the mean over ranks in reduce_dtype; the sharded gradient accumulates it in fp32
                    for n in names:
                        have = [a[n] for a in acc if n in a]
                        if have:
                            t = have[0]
                            for a in have[1:]:
                                t = t + a
                            red = (t / world).float()
                            emu_grads[n] = red if n not in emu_grads else emu_grads[n] + red
                            sl = order_slack(have, world, red)
                            emu_slack[n] = sl if n not in emu_slack else emu_slack[n] + sl
                    acc = [{} for _ in range(world)]
                if rel(loss, emu_losses[rank]) > pipeline_tolerance():
                    wrong.append(f"{where}: loss off by {rel(loss, emu_losses[rank]):.3g} from the emulated pipeline (tolerance {pipeline_tolerance():.3g})")
            if sync and world > 1 and any(not r.endswith(REDUCE_DTYPE) for r in rec.seen):
                wrong.append(f"{where}: gradients reduced as {sorted(set(rec.seen))}, expected in {REDUCE_DTYPE}")
            for path, (_, dtypes) in seen.items():
                for n, dt in dtypes.items():
                    if f"{path}.{n}".lstrip(".") in MANAGED and str(dt) != COMPUTE_DTYPE:
                        wrong.append(f"{where}: {path}.{n} is {dt} inside forward, expected {COMPUTE_DTYPE}")
        set_skip(())
        if API == "fsdp2":
            grads = {n: read_attr(inner, n).grad for n in names}
            grads = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g) if g is not None else None for n, g in grads.items()}
        elif USE_ORIG_PARAMS and not KEEP_LOW_PRECISION_GRADS:
            bad = [None] * world  # every rank agrees before the summon's collectives
            dist.all_gather_object(bad, unsharded_flat_grad(fsdp))
            if any(bad):
                return finish(bad[rank] and f"[rank {rank}] step {si} gradients: {bad[rank]}", None)
            try:
                with FSDP.summon_full_params(fsdp, writeback=False, with_grads=True):
                    grads = {n: read_attr(fsdp, n).grad for n in names}
                    grads = {n: None if g is None else g.clone() for n, g in grads.items()}
            except Exception as e:
                return finish(raised(rank, f"step {si} gradients", e), None)
        else:
            grads = {}
        # whether a frozen parameter has a gradient: FSDP1's own views (summon_full_params may give zeros),
        # else what was read (a parameter named_parameters() lacks)
        own = ({k.replace("_fsdp_wrapped_module.", ""): p.grad is None for k, p in inner.named_parameters(remove_duplicate=False)}
               if API == "fsdp1" else {})
        for n in names:
            r = read_attr(ref, n)
            if n in grads and n in frozen and not own.get(n, grads[n] is None):
                wrong.append(f"[rank {rank}] step {si}: the frozen {n} has a gradient")
            if n in grads and n not in frozen:
                g = grads[n]
                if g is not None and str(g.dtype) != GRAD_DTYPE:
                    wrong.append(f"[rank {rank}] step {si}: {n}.grad is {g.dtype}, expected {GRAD_DTYPE}")
                if (off := rel(g, r.grad if r.grad is not None else torch.zeros_like(r))) > TOLERANCE:
                    wrong.append(f"[rank {rank}] step {si}: {n}.grad off by {off:.3g} from fp32 training")
                if EMULATE and GRADS_PROMISED[si] and (off := rel(g, emu_grads.get(n, torch.zeros_like(r)), emu_slack.get(n))) > pipeline_tolerance(n, len(microbatches)):
                    wrong.append(f"[rank {rank}] step {si}: {n}.grad off by {off:.3g} from the emulated pipeline (tolerance {pipeline_tolerance(n, len(microbatches)):.3g} beyond the order slack)")
        if API == "fsdp1" and not USE_ORIG_PARAMS and not KEEP_LOW_PRECISION_GRADS:  # the flat parameters' gradients
            for n, p in fsdp.named_parameters():
                if p.grad is not None and str(p.grad.dtype) != GRAD_DTYPE:
                    wrong.append(f"[rank {rank}] step {si}: the gradient of {n} is {p.grad.dtype}, expected {GRAD_DTYPE}")
        if KEEP_LOW_PRECISION_GRADS:
            for p in fsdp.parameters():
                if p.grad is not None:
                    if str(p.grad.dtype) != GRAD_DTYPE:
                        wrong.append(f"[rank {rank}] step {si}: a gradient FSDP keeps is {p.grad.dtype}, expected {GRAD_DTYPE}")
                    p.grad = p.grad.to(p.dtype)
        try:
            opt.step()
        except Exception as e:
            return finish(raised(rank, f"step {si} optimizer", e), None)
        ropt.step()
        try:
            after = full_values()
        except Exception as e:
            return finish(raised(rank, f"step {si} values", e), None)
        for n in names:
            if n in frozen and not (torch.equal(after[n], start[n]) or bool(((after[n] == start[n]) | (after[n].isnan() & start[n].isnan())).all())):  # a NaN that stays NaN is unchanged
                wrong.append(f"[rank {rank}] step {si}: the frozen {n} changed")
            elif COMPARE_PARAMS and (off := rel(after[n], read_attr(ref, n))) > TOLERANCE:
                wrong.append(f"[rank {rank}] step {si}: {n} after the step off by {off:.3g} from fp32 training")
    wrong += [f"[rank {rank}] buffer {n} is {b.dtype} after training, expected {BUFFER_DTYPE}" for n, b in inner.named_buffers()
              if str(b.dtype) != BUFFER_DTYPE]
    finish("; ".join(wrong[:3]) + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else "") or None,
           "dtypes, gradients and updates as the policy and fp32 single-process training say"
           + (", losses and gradients as the emulated pipeline's" if EMULATE else ""))


if __name__ == "__main__":
    main()
'''


def _dt(name: str | None) -> str:
    return "None" if name is None else f"torch.{name}"


def schedule_script(spec: CaseSpec, violations: list | None = None, title: str = "", *, modes=None, finding: str = "",
                    name: str = "repro.py") -> str:
    """A torch-only script that trains the case under FSDP next to fp32
    single-process training, compares dtypes, gradients and updates with the
    oracle's prediction and prints the verdict."""
    s = spec.schedule
    api = spec.plan.api
    pred = predict_schedule(spec)
    expected = (f"Expected (the oracle): forward in {pred.compute_dtype}, reduction in {pred.reduce_dtype}, gradients in {pred.grad_dtype}, "
                f"buffers {pred.buffer_dtype}{', output ' + pred.output_dtype if pred.output_dtype else ''}; "
                f"gradients and updates as fp32 single-process training within {pred.tolerance:g} (relative).")
    if modes is None:  # the reduction dtype needs two ranks to show
        modes = (("torchrun --nproc-per-node 2 repro.py", True, ""), ("python repro.py", True, ""))
    doc = header(f"({api} training schedule) {title}".rstrip(), violations, expected, modes, finding, name)
    pol_imports, fsdp_names = policy_imports(spec) if api == "fsdp1" else ([], [])
    if api == "fsdp1" and s.sharding_strategy != "FULL_SHARD" and "ShardingStrategy" not in fsdp_names:
        fsdp_names = [*fsdp_names, "ShardingStrategy"]
    # the standard library's imports in ruff's order (a policy may add functools)
    imports = sorted(["import contextlib", "import copy", "import os", "import socket", *(i for i in pol_imports if not i.startswith("from"))])
    imports += ["", "import torch", "import torch.distributed as dist", "import torch.nn as nn", "import torch.nn.functional as F"]
    pr = s.precision
    if api == "fsdp1":
        names = ["FullyShardedDataParallel as FSDP", *(["MixedPrecision"] if pr is not None else []), *fsdp_names]
        imports += from_import("torch.distributed.fsdp", names) + [i for i in pol_imports if i.startswith("from")]
    else:  # (FSDP: the FSDP1 branches of the shared code name it)
        names = ["FullyShardedDataParallel as FSDP", *(["MixedPrecisionPolicy"] if pr is not None else []), "fully_shard",
                 *(["register_fsdp_forward_method"] if s.first >= 0 else [])]
        imports += ["from torch.distributed.device_mesh import init_device_mesh", *from_import("torch.distributed.fsdp", names)]
    imports.append("from torch.utils._python_dispatch import TorchDispatchMode")
    lines, var = model_lines(spec)
    # the suite's own initial values (conformance.case.build): the same generator,
    # order and scale, so that the script computes the very numbers the
    # suite saw (rounding errors and tolerances depend on them)
    lines.append("gen = torch.Generator().manual_seed(SEED)")
    lines.append("with torch.no_grad():")
    tied = {(t.module, t.name) for t in spec.ties}  # the suite draws their values before tying them
    for path, m in walk(spec.tree):
        for p in m.params:
            if (path, p.name) in tied:
                lines.append(f"    torch.randn({tuple(p.shape)!r}, generator=gen)  # {join(path, p.name)}'s draw: the tie replaced it")
            else:
                lines.append(f"    {var[path]}.{p.name}.copy_(torch.randn({tuple(p.shape)!r}, generator=gen) * 0.5)")
        for b in m.buffers:
            lines.append(f"    {var[path]}.{b.name}.copy_(torch.randn({tuple(b.shape)!r}, generator=gen))")
    lines.append("    pass")
    drawn = {c.name for c in spec.classes}
    graph = ModelGraph(spec)
    for path, m in walk(spec.tree):
        if m.cls in drawn:
            lines.append(f"{var[path]}.case_params = {[n for n, _ in graph.nodes[path].params]!r}")
            lines.append(f"{var[path]}.case_buffers = {[b.name for b in m.buffers]!r}")
    lines.append("mods = {" + ", ".join(f"{p!r}: {v}" for p, v in var.items()) + "}")
    lines.append("return m0, mods")
    build = "def build():\n" + textwrap.indent("\n".join(lines), "    ") + "\n"
    if api == "fsdp1":
        mp = "None"
        if pr is not None:
            kw = [f"param_dtype={_dt(pr.param_dtype)}", f"reduce_dtype={_dt(pr.reduce_dtype)}", f"buffer_dtype={_dt(pr.buffer_dtype)}",
                  f"keep_low_precision_grads={pr.keep_low_precision_grads}", f"cast_root_forward_inputs={pr.cast_root_forward_inputs}"]
            if pr.cast_forward_inputs is not None:
                kw.append(f"cast_forward_inputs={pr.cast_forward_inputs}")
            mp = f"MixedPrecision({', '.join(kw)})"
        body = policy_code(spec, {p: f"mods[{p!r}]" for p in var}) + (
            f"\nreturn FSDP(m0, auto_wrap_policy=policy, use_orig_params={spec.plan.use_orig_params}, "
            + (f"sharding_strategy=ShardingStrategy.{s.sharding_strategy}, " if s.sharding_strategy != "FULL_SHARD" else "")
            + f"mixed_precision={mp}, device_id=DEVICE)"
        )
        wrap = "def wrap(m0, mods):\n" + textwrap.indent(body, "    ") + "\n"
    else:
        body = []
        for grp in shard_order(spec, graph):
            target = "[" + ", ".join(f"mods[{m!r}]" for m in grp.modules) + "]" if len(grp.modules) > 1 else f"mods[{grp.modules[0]!r}]"
            kw = "" if grp.reshard_after_forward is None else f", reshard_after_forward={grp.reshard_after_forward}"
            if pr is not None:
                mp = [f"param_dtype={_dt(pr.param_dtype)}", f"reduce_dtype={_dt(pr.reduce_dtype)}"]
                if pr.cast_forward_inputs is not None:
                    mp.append(f"cast_forward_inputs={pr.cast_forward_inputs}")
                if grp.modules == ("",) and pr.output_dtype:
                    mp.append(f"output_dtype={_dt(pr.output_dtype)}")
                kw += f", mp_policy=MixedPrecisionPolicy({', '.join(mp)})"
            body.append(f"fully_shard({target}, mesh=mesh{kw})")
        if s.first >= 0:
            body.append("register_fsdp_forward_method(m0, 'encode')")
        body.insert(0, "mesh = init_device_mesh(DEVICE.type, (dist.get_world_size(),))")
        body.append("return m0")
        wrap = "def wrap(m0, mods):\n    # bottom-up: each group after every group below it, the root last\n" + textwrap.indent("\n".join(body), "    ") + "\n"
    steps = [(list(st.frozen), [list(mb.skip) for mb in st.microbatches], st.sync_every) for st in s.steps]
    units = [grp_m for grp in shard_order(spec, graph) for grp_m in grp.modules] if api == "fsdp2" else [u.path for u in predict_fsdp1(spec).units]
    cast_at = sorted(cast_paths(api, pr, units))
    grads_promised = [api == "fsdp2" or (not (pr and pr.keep_low_precision_grads) and (st.sync_every or len(st.microbatches) == 1)) for st in s.steps]
    consts = (
        f"API = {api!r}\nUSE_ORIG_PARAMS = {spec.plan.use_orig_params}\nSEED = {spec.seed}\n"
        f"OPTIMIZER, LR = {s.optimizer!r}, {s.lr!r}\n"
        f"KEEP_LOW_PRECISION_GRADS = {bool(pr and pr.keep_low_precision_grads)}\n"
        f"INPUT_DTYPE = torch.{pred.input_dtype}  # what FSDP does not cast, the user does\n"
        f"USER_CASTS = {pred.input_dtype != 'float32'}  # FSDP promises no cast of the root's inputs: fed float32, cast by the user's hook\n"
        f"NO_CAST = {('cast_forward_inputs=False' if api == 'fsdp2' else 'cast_root_forward_inputs=False')!r}\n"
        f"FIRST_METHOD = {s.first >= 0}  # the very first microbatch calls the registered encode()\n"
        f"# per step: (frozen FQNs, per microbatch the modules it skips, sync on every microbatch)\n"
        f"SCHEDULE = {steps!r}\n"
        f"# the oracle's prediction\n"
        f"COMPUTE_DTYPE, REDUCE_DTYPE, GRAD_DTYPE = 'torch.{pred.compute_dtype}', '{pred.reduce_dtype}', 'torch.{pred.grad_dtype}'\n"
        f"BUFFER_DTYPE, OUTPUT_DTYPE = 'torch.{pred.buffer_dtype}', {repr('torch.' + pred.output_dtype) if pred.output_dtype else None}\n"
        f"TOLERANCE, COMPARE_PARAMS = {pred.tolerance!r}, {pred.compare_params}\n"
        f"MANAGED = {sorted(pred.trainable)!r}  # parameters FSDP casts for forward\n"
        f"# MP-PIPELINE: the promised pipeline, emulated ({pred.emulation or api.upper()})\n"
        f"EMULATE = {not pred.emulation}\n"
        f"COMPUTE, REDUCE, OUTPUT = torch.{pred.compute_dtype}, torch.{pred.reduce_dtype}, {_dt(pred.output_dtype)}\n"
        f"CAST_INPUTS = {bool(cast_at)}\n"
        f"CAST_AT = {cast_at!r}  # {'the modules given to fully_shard' if api == 'fsdp2' else 'the FSDP1 root (cast_root_forward_inputs) and units (cast_forward_inputs)'}\n"
        f"BUFFER_CAST = {_dt(pr.buffer_dtype if api == 'fsdp1' and pr is not None else None)}  # FSDP1's buffer_dtype\n"
        f"# per step: gradients promised (FSDP1 documents no dtype for no_sync accumulation, and keep_low_precision_grads' is a known deviation)\n"
        f"GRADS_PROMISED = {grads_promised!r}\n"
        f"PIPELINE_SLACK, REUSE_SLACK, OTHER_SLACK, REDUCE_EPS = {PIPELINE_SLACK!r}, {reuse_slack(pred)!r}, {other_slack(pred)!r}, {EPS[pred.reduce_dtype]!r}\n"
        f"REUSED, REUSE_ALL = {(list(pred.reused_params) or ([''] if pred.reused else []))!r}, {pred.reuse_all}  # reused parameters ('': a shared module)\n"
    )
    classes = class_code(spec).replace("    pass\n", "    forward = generic_forward\n")
    if s.first >= 0:
        root_cls = spec.tree.cls
        classes = classes.replace(f"class {root_cls}(", f"class {root_cls}(", 1) + f"\n\n{root_cls}.encode = encode\n"
    return assemble(doc, "\n".join(imports), [HARNESS, FSDP2_RUNTIME, _RUNTIME, classes, build, wrap, consts, _MAIN])
