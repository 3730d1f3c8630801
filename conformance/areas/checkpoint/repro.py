"""Standalone, torch-only reproduction scripts for checkpoint cases (SD-FULL,
TIES-KEPT, CKPT-RESHARD, OPTIM-STATE): the case's model, its save plan and
load plan, and the phase the invariant checks. A round trip runs as two
commands when the world size changes:
``torchrun --nproc-per-node S repro.py save DIR`` then
``torchrun --nproc-per-node L repro.py load DIR``."""

from __future__ import annotations

import dataclasses
import textwrap

from conformance.areas.checkpoint.oracle import matrix_names
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
from conformance.case.graph import ModelGraph
from conformance.case.spec import CaseSpec, WrapPlan
from conformance.case.tree import walk


def _imports(spec: CaseSpec) -> str:
    """What the script uses: the phases' own imports and the two plans' (fully_shard, an FSDP1 policy)."""
    plans = [spec.plan, spec.ckpt.load_plan or spec.plan]
    pol = [policy_imports(_with_plan(spec, p)) for p in plans if p.api == "fsdp1"]
    plain = sorted({i for imps, _ in pol for i in imps if not i.startswith("from")})
    froms = sorted({i for imps, _ in pol for i in imps if i.startswith("from")})
    fsdp = ["FullStateDictConfig", "FullyShardedDataParallel as FSDP", "StateDictType"] + (["fully_shard"] if any(p.api == "fsdp2" for p in plans) else [])
    if spec.ckpt.precision is not None:
        fsdp.append("MixedPrecision" if spec.plan.api == "fsdp1" else "MixedPrecisionPolicy")
    fsdp += sorted({n for _, names in pol for n in names})
    return "\n".join([
        *sorted({"import functools", "import os", "import shutil", "import socket", "import sys", "import tempfile", *plain}), "",
        "import torch", "import torch.distributed as dist", "import torch.distributed.checkpoint as dcp", "import torch.nn as nn",
        "import torch.nn.functional as F",
        *from_import("torch.distributed.checkpoint.state_dict", ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict",
                                                               "get_state_dict", "set_model_state_dict", "set_state_dict"]),
        *from_import("torch.distributed.fsdp", fsdp),
        *froms,
    ])


_MAIN = '''
def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def optimizer(model):
    """Every parameter; PARAM_GROUPS 2: the MATRICES, and the rest at half
    the learning rate without weight decay."""
    params = list(model.parameters())
    if PARAM_GROUPS == 2:
        names = [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in model.named_parameters()]
        params = [{"params": [p for n, p in names if n in MATRICES]},
                  {"params": [p for n, p in names if n not in MATRICES], "lr": 0.025, "weight_decay": 0.0}]
    if OPTIMIZER == "Adam":
        return torch.optim.Adam(params, lr=0.05, eps=1e-3)
    if OPTIMIZER == "AdamW":
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, eps=1e-3)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def step(model, opt, i):
    opt.zero_grad(set_to_none=True)
    loss = (model(torch.linspace(-1.0, 1.0, 2) * (1.0 + 0.25 * i)) ** 2).sum()
    if loss.requires_grad:
        loss.backward()
    opt.step()


def set_frozen(mods, frozen):
    for path, name in PARAMS:
        getattr(mods[path], name).requires_grad_(f"{path}.{name}".lstrip(".") not in frozen)


def show(what, obj):
    print(f"[rank {dist.get_rank()}] {what}: {obj}", flush=True)


def full_state_dict():
    model, mods = build(FROZEN_AT_SAVE)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    if BUFFER_DTYPE is not None and WARM:
        # MixedPrecision(buffer_dtype): the first forward casts the buffers and
        # keeps them so; a checkpoint saves them in full precision
        low = getattr(torch, BUFFER_DTYPE)
        for k in BUFFERS:
            want[k] = want[k].to(low).to(want[k].dtype)
    model = wrap(model, mods, SAVE_PLAN)
    if WARM:  # a model in use: one forward before the state dict
        with torch.no_grad():
            model(torch.linspace(-1.0, 1.0, 2))
    if FULL_SD == "fsdp1-full":
        cfg = FullStateDictConfig(offload_to_cpu=OFFLOAD, rank0_only=RANK0_ONLY)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            got = {k.replace("_fsdp_wrapped_module.", ""): v for k, v in model.state_dict().items()}
    else:
        got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=OFFLOAD, ignore_frozen_params=IGNORE_FROZEN))
    if RANK0_ONLY and FULL_SD == "fsdp1-full" and dist.get_rank() > 0:
        want = {}
    if IGNORE_FROZEN:
        want = {k: v for k, v in want.items() if k not in FROZEN_NAMES}
    if sorted(got) != sorted(want):
        WRONG.append(f"[rank {dist.get_rank()}] the full state dict has keys {sorted(got)}, expected {sorted(want)}")
    differ = sorted(k for k, v in got.items() if k in want and not torch.equal(full(v).to(want[k].dtype), want[k]))
    if differ:
        WRONG.append(f"[rank {dist.get_rank()}] the full state dict's values of {differ} differ from the unwrapped model's")
    dtypes = {k: str(v.dtype) for k, v in got.items() if k in want and v.dtype != want[k].dtype}
    if dtypes:
        WRONG.append(f"[rank {dist.get_rank()}] the full state dict holds {dtypes}, not the unwrapped model's dtype ({sorted({str(want[k].dtype) for k in dtypes})})")


def ties_kept():
    model, mods = build(FROZEN_AT_SAVE)
    other, other_mods = build(FROZEN_AT_SAVE, seed=1)
    source = {k: v.detach().clone() for k, v in other.state_dict().items()}
    n_before = len(list(model.parameters()))

    def load_into(model, mods):
        if LOAD_PATH == "meta-to_empty":
            with torch.device("meta"):
                model, mods = build(FROZEN_AT_SAVE)
            if SAVE_PLAN[0] == "fsdp1":
                model = wrap(model, mods, SAVE_PLAN, param_init_fn=lambda m: m.to_empty(device=torch.device("cpu"), recurse=False))
            else:
                model = wrap(model, mods, SAVE_PLAN)
                model.to_empty(device="cpu")
            set_model_state_dict(model, source, options=StateDictOptions(full_state_dict=True))
        elif LOAD_PATH == "load_state_dict-assign" and SAVE_PLAN[0] == "fsdp1":
            model.load_state_dict(source, assign=True)
            model = wrap(model, mods, SAVE_PLAN)
        else:
            model = wrap(model, mods, SAVE_PLAN)
            if WARM:  # a model in use: one forward before the load
                with torch.no_grad():
                    model(torch.linspace(-1.0, 1.0, 2) * 1.25)
            if LOAD_PATH.startswith("load_state_dict"):
                if SAVE_PLAN[0] == "fsdp1":
                    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                        model.load_state_dict(source)
                else:
                    from torch.distributed.tensor import distribute_tensor

                    sharded = {k: distribute_tensor(source[k], v.device_mesh, v.placements) if hasattr(v, "device_mesh") else source[k]
                               for k, v in model.state_dict().items()}
                    model.load_state_dict(sharded, assign=LOAD_PATH.endswith("assign"))
            else:
                bcast = LOAD_PATH.endswith("broadcast")
                src = source if dist.get_rank() == 0 or not bcast else {}
                set_model_state_dict(model, src, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=bcast))
        return model

    try:
        model, err = load_into(model, mods), None
    except Exception as e:
        err = f"[rank {dist.get_rank()}] the load raised {type(e).__name__}: {first_failure(e)}"
    agree(err)  # before the forward's collectives: a rank that raised leaves the others none to meet
    for group in TIED:
        objs = {id(model.get_parameter(n)) if SAVE_PLAN[0] == "fsdp2" else id(functools.reduce(getattr, n.split("."), model)) for n in group}
        if len(objs) > 1:
            WRONG.append(f"after the load ({LOAD_PATH}) the tied names {list(group)} are {len(objs)} Parameters, expected one")
    if len(list(model.parameters())) != n_before:
        WRONG.append(f"the model has {len(list(model.parameters()))} parameters after the load, {n_before} before")
    if dist.get_backend() != "fake":  # the first forward after the load computes with the loaded values
        if PRECISE:
            # mixed precision computes in param_dtype: the reference is the
            # same wrap of a model built with the loaded state
            other = wrap(other, other_mods, SAVE_PLAN)
        with torch.no_grad():
            got = (model(torch.linspace(-1.0, 1.0, 2)) ** 2).sum().item()
            want = (other(torch.linspace(-1.0, 1.0, 2)) ** 2).sum().item()
        if not abs(got - want) <= 1e-5 + 1e-3 * abs(want):
            what = "the same wrap of a model built with the loaded state" if PRECISE else "the unwrapped model with the loaded state"
            WRONG.append(f"the first forward after the load gives loss {got!r}; {what} gives {want!r}")


def train(model, mods, opt):
    """The steps before the save (REFREEZE flips requires_grad after the
    first), then a learning-rate schedule's step (the load must restore it)."""
    for i in range(STEPS):
        step(model, opt, i)
        if i == 0 and REFREEZE:
            for path_, name in PARAMS:
                if f"{path_}.{name}".lstrip(".") in REFREEZE:
                    p = getattr(mods[path_], name)
                    p.requires_grad_(not p.requires_grad)
    for g in opt.param_groups:
        g["lr"] *= 0.8


def with_state(names):
    """Parameter names, each tie as one (its first name)."""
    canon = {n: group[0] for group in TIED for n in group}
    return sorted({canon.get(n, n) for n in names})


def save(path):
    model, mods = build(FROZEN_AT_SAVE)
    model = wrap(model, mods, SAVE_PLAN)
    opt = optimizer(model)
    train(model, mods, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(path, "ckpt"))
    opts = StateDictOptions(full_state_dict=True)
    saved = {"model": get_model_state_dict(model, options=opts), "optim": get_optimizer_state_dict(model, opt, options=opts)}
    if dist.get_rank() == 0:
        torch.save(saved, os.path.join(path, "saved.pt"))
    show("optimizer state saved for", sorted(saved["optim"]["state"]))
    ref, ref_mods = build(FROZEN_AT_SAVE)  # single-process training: which parameters the optimizer gave state
    ref_opt = optimizer(ref)
    train(ref, ref_mods, ref_opt)
    want = with_state(n for n, p in ref.named_parameters() if ref_opt.state.get(p))
    if with_state(saved["optim"]["state"]) != want:
        WRONG.append(f"[rank {dist.get_rank()}] optimizer state saved for {with_state(saved['optim']['state'])}; single-process training gave state to {want}")
    dist.barrier()


def load(path):
    model, mods = build(FROZEN_AT_LOAD)
    model = wrap(model, mods, LOAD_PLAN)
    opt = optimizer(model)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    try:
        dcp.load(state, checkpoint_id=os.path.join(path, "ckpt"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except BaseException as e:  # CheckpointException is a BaseException
        WRONG.append(f"[rank {dist.get_rank()}] the load raised {type(e).__name__}: {first_failure(e)}")
        return
    opts = StateDictOptions(full_state_dict=True)
    saved = torch.load(os.path.join(path, "saved.pt"), weights_only=False)
    got_model, got_optim = get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, opt, options=opts)
    differ = sorted(k for k in saved["model"] if k not in got_model or not torch.equal(got_model[k], saved["model"][k]))
    if differ:
        WRONG.append(f"[rank {dist.get_rank()}] after the load the model values of {differ} differ from the saved")
    if sorted(got_optim["state"]) != sorted(saved["optim"]["state"]):
        WRONG.append(f"[rank {dist.get_rank()}] optimizer state saved for {sorted(saved['optim']['state'])}, after the load for {sorted(got_optim['state'])}")
    changed = [f"{f}.{k}" for f, st in saved["optim"]["state"].items() if f in got_optim["state"]
               for k, v in st.items() if not torch.equal(torch.as_tensor(got_optim["state"][f].get(k, float("nan"))), torch.as_tensor(v))]
    if changed:
        WRONG.append(f"[rank {dist.get_rank()}] the loaded optimizer state of {changed} differs from the saved")
    groups = [{k: (sorted(v) if k == "params" else v) for k, v in g.items()} for g in got_optim["param_groups"]]
    want = [{k: (sorted(v) if k == "params" else v) for k, v in g.items()} for g in saved["optim"]["param_groups"]]
    if groups != want:
        WRONG.append(f"[rank {dist.get_rank()}] after the load the param_groups are {groups}, saved {want}")


def first_failure(e):
    """A CheckpointException's first failing rank's own exception (its str()
    starts with the ranks and their tracebacks)."""
    failures = getattr(e, "failures", None) or {}
    if not failures:
        return " ".join(str(e).split())[:300]  # load_state_dict says what is missing on its second line
    rank = min(failures)
    inner = failures[rank][0] if isinstance(failures[rank], tuple) else getattr(failures[rank], "exc", failures[rank])
    return f"rank {rank}: {type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"


def note_world(phase):
    """The deviation may depend on the case's world sizes (one rank: FSDP1
    switches to NO_SHARD and keeps whole parameters): say so when this run
    has another."""
    worlds = {"save": {SAVE_WORLD}, "load": {LOAD_WORLD}, "both": {SAVE_WORLD, LOAD_WORLD}}.get(phase, {SAVE_WORLD})
    if dist.get_rank() == 0 and worlds != {dist.get_world_size()}:
        show("note", f"the case saves on {SAVE_WORLD} rank(s) and loads on {LOAD_WORLD}; this run has {dist.get_world_size()} "
             "(what depends on the sharding may not show: see the run line at the top)")


WRONG = []  # what differs from the spec, on this rank
STAGE = ["start"]  # what the case is doing now, for a raise


def agree(err):
    """Every rank says whether it raised (``err``); where one did, all finish."""
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    if any(errs):
        WRONG.extend([err] if err else [])
        done()


def main():
    init()
    try:
        run_case()
    except Exception as e:  # a raise is a deviation too (the suite's kind:raised), said on every rank that raised
        WRONG.append(f"[rank {dist.get_rank()}] the {STAGE[0]} raised {type(e).__name__}: {first_failure(e)}")
    done()


def done():
    finish("; ".join(WRONG) or None, {"full": "the full state dict has the unwrapped model's keys and values",
                                      "ties": "the tied names still share one Parameter after the load"}.get(PHASE, "the load restored the saved model and optimizer state"))


def run_case():
    note_world(None if PHASE != "roundtrip" else (sys.argv[1] if len(sys.argv) > 2 else "both"))
    if PHASE == "full":
        STAGE[0] = "full state dict"
        full_state_dict()
    elif PHASE == "ties":
        STAGE[0] = "load (ties)"
        ties_kept()
    elif len(sys.argv) > 2:  # save DIR | load DIR: one phase, this world size
        STAGE[0] = sys.argv[1]
        (save if sys.argv[1] == "save" else load)(sys.argv[2])
    else:  # both phases in this world size
        path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(path)
        try:
            STAGE[0] = "save"
            save(path[0])
            STAGE[0] = "load"
            load(path[0])
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path[0], ignore_errors=True)


if __name__ == "__main__":
    main()
'''

PHASE = {"SD-FULL": "full", "TIES-KEPT": "ties", "CKPT-RESHARD": "roundtrip", "OPTIM-STATE": "roundtrip"}


def _wrap_code(spec: CaseSpec, var: dict[str, str]) -> str:
    """wrap(model, mods, plan): plan is ("fsdp1", index) / ("fsdp2", index)
    into the case's two plans (0: save, 1: load)."""
    plans = [spec.plan, spec.ckpt.load_plan or spec.plan]
    pr = spec.ckpt.precision  # the save plan's (SD-FULL, TIES-KEPT)
    out = ["def wrap(model, mods, plan, param_init_fn=None):", "    api, i = plan"]
    for i, plan in enumerate(plans):
        out.append(f"    if i == {i}:")
        if plan.api == "fsdp1":
            case = _with_plan(spec, plan)
            pol = policy_code(case, {p: f"mods[{p!r}]" for p in var})
            out.append(textwrap.indent(pol, "        "))
            mp = f", mixed_precision=MixedPrecision({_dtypes(pr)})" if pr is not None and i == 0 else ""
            out.append(f"        return FSDP(model, auto_wrap_policy=policy, device_id=DEVICE, use_orig_params={plan.use_orig_params}, param_init_fn=param_init_fn{mp})")
        else:
            for grp in shard_order(_with_plan(spec, plan), ModelGraph(spec)):
                target = "[" + ", ".join(f"mods[{m!r}]" for m in grp.modules) + "]" if len(grp.modules) > 1 else f"mods[{grp.modules[0]!r}]"
                kw = "" if grp.reshard_after_forward is None else f", reshard_after_forward={grp.reshard_after_forward}"
                if pr is not None and i == 0:
                    kw += f", mp_policy=MixedPrecisionPolicy({_dtypes(pr)})"
                out.append(f"        fully_shard({target}{kw})")
            out.append("        return model")
    return "\n".join(out) + "\n"


def _dtypes(pr) -> str:
    """A Precision's dtypes as MixedPrecision / MixedPrecisionPolicy kwargs."""
    return ", ".join(f"{k}=torch.{getattr(pr, k)}" for k in ("param_dtype", "reduce_dtype", "buffer_dtype") if getattr(pr, k))


def _with_plan(spec: CaseSpec, plan: WrapPlan) -> CaseSpec:

    return dataclasses.replace(spec, plan=plan, ckpt=None)


def ckpt_script(spec: CaseSpec, violations: list | None = None, title: str = "", *, modes=None, finding: str = "",
                name: str = "repro.py") -> str:
    """A torch-only script for the case's checkpoint phase: it compares what
    it gets with what the spec says and prints the verdict."""
    ck = spec.ckpt
    phase = PHASE.get(title, "roundtrip")
    if modes is None:  # both phases in one world size: the case's save world, or one rank
        modes = ((f"torchrun --nproc-per-node {ck.save_world} repro.py", True, ""), ("python repro.py", True, ""))
    expected = {"full": "Expected: the full state dict has the unwrapped model's keys (rank 0 only with rank0_only) and values.",
                "ties": "Expected: tied names still share one Parameter after the load, the parameter count unchanged."}.get(
        phase, "Expected: the load restores the saved model values and optimizer state (a world-size change: "
               f"torchrun --nproc-per-node {ck.save_world} repro.py save DIR, then --nproc-per-node {ck.load_world} repro.py load DIR).")
    doc = header(f"(checkpoint) {title}".rstrip(), violations, expected, modes, finding, name)
    lines, var = model_lines(spec)
    lines[0] = "torch.manual_seed(seed)"
    graph = ModelGraph(spec)
    drawn = {c.name for c in spec.classes}
    for path, m in walk(spec.tree):
        if m.cls in drawn:
            lines.append(f"{var[path]}.case_params = {[n for n, _ in graph.nodes[path].params]!r}")
            lines.append(f"{var[path]}.case_buffers = {[b.name for b in m.buffers]!r}")
    lines.append("mods = {" + ", ".join(f"{p!r}: {v}" for p, v in var.items()) + "}")
    lines.append("set_frozen(mods, frozen)")
    lines.append("return m0, mods")
    build = "def build(frozen, seed=0):\n" + textwrap.indent("\n".join(lines), "    ") + "\n"
    # each parameter once, by the module and name it was made under
    params = [tuple(pid.rpartition(".")[::2]) for _, pid in graph.named_parameters()]
    at_save = sorted({pid for _, pid in graph.named_parameters() if not graph.requires_grad(pid)})
    # without load_frozen the load keeps the mask of the save (refreeze applied)
    at_load = sorted(set(at_save) ^ set(ck.refreeze)) if ck.load_frozen is None else sorted(ck.load_frozen)
    tied = [tuple(graph.aliases(pid)) for _, pid in graph.named_parameters() if len(graph.aliases(pid)) > 1]
    consts = "\n".join([
        f"PHASE = {phase!r}",
        f"PARAMS = {params!r}  # (module path, name): the case's parameters",
        f"FROZEN_AT_SAVE = {at_save!r}  # when built (REFREEZE flips some after the first step)",
        f"FROZEN_AT_LOAD = {at_load!r}",
        f"REFREEZE = {list(ck.refreeze)!r}  # requires_grad flips after the first step",
        f"TIED = {tied!r}",
        f"SAVE_PLAN = ({spec.plan.api!r}, 0)",
        f"LOAD_PLAN = ({(ck.load_plan or spec.plan).api!r}, 1)",
        f"OPTIMIZER, STEPS = {ck.optimizer!r}, {ck.steps}",
        f"PARAM_GROUPS = {ck.param_groups}  # 2: the matrices, and the rest at another learning rate",
        f"MATRICES = {sorted(matrix_names(spec))!r}",
        f"FULL_SD, OFFLOAD, RANK0_ONLY, IGNORE_FROZEN = {ck.full_sd!r}, {ck.offload}, {ck.rank0_only}, {ck.ignore_frozen}",
        f"LOAD_PATH, WARM = {ck.load_path!r}, {ck.warm!r}  # WARM: a forward before the load (full: before the state dict)",
        f"PRECISE = {ck.precision is not None!r}  # the save plan under mixed precision (see wrap)",
        f"BUFFER_DTYPE = {ck.precision.buffer_dtype if ck.precision else None!r}  # MixedPrecision's (the save plan's mixed precision: see wrap)",
        f"BUFFERS = {[k for k in graph.state_dict_keys() if k not in {f for f, _ in graph.named_parameters(remove_duplicate=False)}]!r}",
        f"SAVE_WORLD, LOAD_WORLD = {ck.save_world}, {ck.load_world}  # the case's world sizes",
        f"FROZEN_NAMES = {sorted({a for _, pid in graph.named_parameters() if not graph.requires_grad(pid) for a in graph.aliases(pid)})!r}",
    ]) + "\n"
    classes = class_code(spec).replace("    pass\n", "    forward = generic_forward\n")
    return assemble(doc, _imports(spec), [HARNESS, FSDP2_RUNTIME, classes, build, _wrap_code(spec, var), consts, _MAIN])
