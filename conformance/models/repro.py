"""Standalone repro scripts for a ModelCase: torch-only apart from importing
the target's package. The script rebuilds the model from the seed, the exact
freeze mask (by FQN) and the policy or FSDP2 groups (by qualified class name / module
path), wraps it, makes the calls (forward, the target's methods, a few
training steps with the target's loss) next to an unsharded copy, and prints
what FSDP did and what the spec says it must do."""

from __future__ import annotations

from conformance.areas.common.fsdp2_oracle import predict_fsdp2, shard_order
from conformance.case.model_case import ModelCase
from conformance.case.spec import CustomWrap, LambdaWrap, ModuleWrap, SizeBasedWrap, TransformerWrap
from conformance.case.target import graph_of

_COMMON = '''
import functools
import os
import socket
from importlib import import_module

import torch
import torch.distributed as dist


def load_target():
    mod, _, attr = TARGET.partition(":")
    obj = getattr(import_module(mod), attr)
    return obj if hasattr(obj, "factory") else obj()


def build():
    """The target's model at SEED with exactly the freeze mask FROZEN."""
    target = load_target()
    model = target.factory(SEED)
    by_id = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), (p, []))[1].append(fqn)
    for p, fqns in by_id.values():
        p.requires_grad_(not (set(FROZEN) & set(fqns)))
    return target, model


def classes_with_ids(model, ids):
    """The model's module classes (any class in their MROs) with these
    qualified names (module.QualName: two classes may share a __name__, as
    PEFT's lora.Linear and torch's nn.Linear do)."""
    return {
        k for m in model.modules() for k in type(m).__mro__
        if issubclass(k, torch.nn.Module) and f"{k.__module__}.{k.__qualname__}" in ids
    }


def tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in tensors(v)]
    return []


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def same(a, b):
    a, b = tensors(a), tensors(b)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return False
    return all(
        torch.allclose(full(x.detach()), full(y.detach()), rtol=1e-4, atol=1e-5) if x.is_floating_point()
        else torch.equal(full(x), full(y))
        for x, y in zip(a, b)
    )


def loss_of(target, out):
    if target.loss is not None:
        return target.loss(out)
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    logits = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
    return logits.float().sum()


def method_kwargs(target, name):
    mc = next(m for m in target.methods if m.name == name)
    kw = dict((mc.inputs or target.inputs)(SEED))
    kw.update(mc.kwargs)
    return kw


def init():
    """torchrun sets RANK; a plain `python` run is one gloo rank on a free port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")


def finish(deviation, as_specified):
    """Rank 0 prints the verdict last: DEVIATION if a rank saw one (None: it saw none)."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, deviation)
    dist.barrier()
    if dist.get_rank() == 0:
        found = next((d for d in seen if d), None)
        print(f"DEVIATION: {found}" if found else f"AS SPECIFIED: {as_specified}", flush=True)
    print(end="", flush=True)
    os._exit(0)  # every rank leaves here, the group not torn down (gloo's teardown can abort a rank now and then)


def close(a, b):
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 * (1 + abs(y)) for x, y in zip(a, b))


def train(target, model, steps):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.Adam(params, lr=LR, eps=1e-3) if OPTIMIZER == "Adam" else torch.optim.SGD(params, lr=LR, momentum=0.9)) if params else None
    losses = []
    for step in range(steps):
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        loss = loss_of(target, model(**dict(target.inputs(SEED + step))))
        if opt is not None:
            loss.backward()
            opt.step()
        losses.append(float(loss.detach()))
    return losses
'''

_FSDP1 = '''
def policy(model):
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import (
        CustomPolicy,
        ModuleWrapPolicy,
        lambda_auto_wrap_policy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    paths = {}
    for name, m in model.named_modules():
        paths.setdefault(id(m), name)
    kind, arg = POLICY
    if kind is None:
        return None
    if kind == "ModuleWrap":
        return ModuleWrapPolicy(classes_with_ids(model, arg))
    if kind == "TransformerWrap":
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes_with_ids(model, arg))
    if kind == "SizeBasedWrap":
        return functools.partial(size_based_auto_wrap_policy, min_num_params=arg)
    if kind == "LambdaWrap":
        return functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: paths.get(id(m)) in arg)
    targets, kwargs = arg

    def lambda_fn(m):
        path = paths.get(id(m))
        if path not in targets:
            return False
        kw = dict(kwargs.get(path, {}))
        if "sharding_strategy" in kw:
            kw["sharding_strategy"] = ShardingStrategy[kw["sharding_strategy"]]
        return kw or True

    return CustomPolicy(lambda_fn)


def main():
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    init()
    rank0 = dist.get_rank() == 0
    wrong = []
    target, model = build()
    _, ref = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fsdp = FSDP(model, auto_wrap_policy=policy(model), device_id=torch.device("cpu"), use_orig_params=USE_ORIG_PARAMS)
        except Exception as e:
            fsdp = None
            if rank0:
                print(f"FSDP raised {type(e).__name__}: {e}")
            if not (EXPECT_ERROR and isinstance(e, ValueError) and "requires_grad" in str(e)):
                wrong.append(f"FSDP raised {type(e).__name__}: {str(e).splitlines()[0]}")
    if fsdp is not None and EXPECT_ERROR:
        wrong.append("FSDP wrapped the model, expected the frozen-parameter ValueError")
    if rank0:
        for w in caught:
            if "requires_grad" in str(w.message):
                print(f"{w.category.__name__}: {w.message}")
    if fsdp is not None:
        for name, unit in fsdp.named_modules():
            if isinstance(unit, FSDP) and rank0:
                fqns = list(unit._handle.flat_param._fqns) if unit._handle is not None else []
                print(f"FSDP unit {name.replace('_fsdp_wrapped_module.', '') or '<root>'!r} manages {fqns}")
        try:
            keys = [k.replace("_fsdp_wrapped_module.", "") for k in fsdp.state_dict()]
            if sorted(keys) != sorted(ref.state_dict()):
                wrong.append(f"state_dict keys {sorted(set(keys) ^ set(ref.state_dict()))} differ from the unwrapped model's")
        except Exception as e:
            wrong.append(f"state_dict raised {type(e).__name__}: {str(e).splitlines()[0]}")
        if TRAIN_STEPS:  # fresh models, as the suite trains them
            try:
                _, model = build()
                _, ref = build()
                fsdp = FSDP(model, auto_wrap_policy=policy(model), device_id=torch.device("cpu"), use_orig_params=USE_ORIG_PARAMS)
                got = train(target, fsdp, TRAIN_STEPS)
                want = train(target, ref, TRAIN_STEPS)
                if not close(got, want):
                    wrong.append(f"training losses {got}, the unsharded model's {want}")
            except Exception as e:
                wrong.append(f"training raised {type(e).__name__}: {str(e).splitlines()[0]}")
    finish("; ".join(wrong) or None, "FSDP wrapped, kept the state-dict keys and trained as the unsharded model")


if __name__ == "__main__":
    main()
'''

_FSDP2 = '''
def main():
    try:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard, register_fsdp_forward_method

    def shard(model):
        modules = dict(model.named_modules())
        for paths, reshard in GROUPS:  # bottom-up, the root last
            mods = [modules[p] for p in paths]
            kw = {} if reshard is None else {"reshard_after_forward": reshard}
            fully_shard(mods if len(mods) > 1 else mods[0], **kw)

    init()
    wrong = []
    target, model = build()
    _, ref = build()
    try:
        shard(model)
        for name in REGISTER:
            register_fsdp_forward_method(model, name)
    except Exception as e:
        wrong.append(f"fully_shard raised {type(e).__name__}: {str(e).splitlines()[0]}")
        model = None
    if model is not None:
        calls = [("forward", dict(target.inputs(SEED)))] + [(n, method_kwargs(target, n)) for n in CALLS]
        for name, kw in calls:
            fn, ref_fn = (model, ref) if name == "forward" else (getattr(model, name), getattr(ref, name))
            try:
                out = fn(**kw)
            except Exception as e:
                wrong.append(f"{name} raised {type(e).__name__}: {str(e).splitlines()[0]}")
                break
            if not same(out, ref_fn(**kw)):
                wrong.append(f"{name}'s output differs from the unsharded model's")
            for (paths, reshard), own in zip(GROUPS, MANAGED):
                sharded = {hasattr(functools.reduce(getattr, f.split("."), model), "device_mesh") for f in own}
                if reshard is True and sharded != {True}:
                    wrong.append(f"after {name} the group {list(paths)} (reshard_after_forward=True) is not sharded")
        if TRAIN_STEPS:  # fresh models: an optimizer made after a forward would hold the root's unsharded parameters
            try:
                _, model = build()
                _, ref = build()
                shard(model)
                got = train(target, model, TRAIN_STEPS)
                want = train(target, ref, TRAIN_STEPS)
                if not close(got, want):
                    wrong.append(f"training losses {got}, the unsharded model's {want}")
            except Exception as e:
                wrong.append(f"training raised {type(e).__name__}: {str(e).splitlines()[0]}")
    finish("; ".join(wrong) or None, "every call's output as the unsharded model's, the groups resharded, training as the unsharded model")


if __name__ == "__main__":
    main()
'''


def _policy_literal(pol, ref: str) -> str:
    if pol is None:
        return "(None, None)"
    if isinstance(pol, (ModuleWrap, TransformerWrap)):
        from conformance.case.target import base_graph

        g = base_graph(ref)  # the script names each class by its id
        return repr((type(pol).__name__, tuple(g.resolve_class(c) for c in pol.classes)))
    if isinstance(pol, SizeBasedWrap):
        return repr(("SizeBasedWrap", pol.min_num_params))
    if isinstance(pol, LambdaWrap):
        return repr(("LambdaWrap", tuple(pol.targets)))
    if isinstance(pol, CustomWrap):
        return repr(("CustomWrap", (tuple(pol.targets), {t: dict(kw) for t, kw in pol.kwargs})))
    raise TypeError(f"unknown policy {pol!r}")


def _expected(case: ModelCase) -> str:
    lines = ["Expected (the oracle, from the FSDP spec):"]
    if case.plan.api == "fsdp1":
        from conformance.areas.common.fsdp1_oracle import predict_fsdp1

        pred = predict_fsdp1(case)
        if pred.error is not None:
            u = pred.error
            lines.append(f"  ValueError naming {u.path or '<root>'}: trainable {list(u.trainable)}, frozen {list(u.frozen)}")
        else:
            lines += [f"  FSDP unit {u.path or '<root>'!r} manages {list(u.managed)}" for u in pred.units]
            lines += [f"  UserWarning for {u.path or '<root>'}: {u.total_numel} numel instead of {u.trainable_numel}" for u in pred.warnings]
            lines += [f"  an error: tied {t.fqn} in unit {t.unit or '<root>'}, below the common ancestor {t.lca or '<root>'}" for t in pred.ties if t.below_lca]
    else:
        import torch

        from conformance.areas.common.fsdp2_oracle import predict_fsdp2

        pred = predict_fsdp2(case, torch.__version__)
        lines += [f"  group {list(g.modules)} manages {list(g.managed)} (reshard_after_forward={g.reshard})" for g in pred.groups]
        lines.append("  forward and each registered method: output equal to the unsharded model's; "
                     "after each, reshard_after_forward=True groups sharded, the root's group as its flag says")
    lines.append("  training: losses and final parameters equal the unsharded model's; frozen parameters unchanged")
    return "\n".join(lines)


def model_script(case: ModelCase, violations: list | None = None, title: str = "", *, modes=None, finding: str = "",
                 name: str = "repro.py") -> str:
    """A script (torch only, besides importing the target's package) that wraps
    the target's model as the case says, compares with the unsharded model
    and the oracle, and prints the verdict."""
    import torch

    from conformance.areas.common.repro import DEFAULT_MODES, header

    doc = header(f"{title + ' ' if title else ''}on target {case.target} ({case.plan.api})", violations, _expected(case),
                 modes or DEFAULT_MODES, finding, name)
    head = [doc]
    consts = [
        f"TARGET = {case.target!r}",
        f"SEED = {case.seed!r}",
        f"FROZEN = {list(case.frozen)!r}",
        f"TRAIN_STEPS = {case.train.steps if case.train else 0!r}",
        f"OPTIMIZER = {case.train.optimizer if case.train else 'SGD'!r}",
        f"LR = {case.train.lr if case.train else 0.05!r}",
    ]
    if case.plan.api == "fsdp1":
        from conformance.areas.common.fsdp1_oracle import predict_fsdp1

        consts += [f"POLICY = {_policy_literal(case.plan.policy, case.target)}", f"USE_ORIG_PARAMS = {case.plan.use_orig_params!r}",
                   f"EXPECT_ERROR = {predict_fsdp1(case).error is not None}  # the frozen-parameter ValueError (the oracle)"]
        body = _FSDP1
    else:
        order = shard_order(case.plan, graph_of(case))
        consts += [
            f"GROUPS = {[(tuple(g.modules), g.reshard_after_forward) for g in order]!r}",
            f"MANAGED = {[list(g.managed) for g in predict_fsdp2(case, torch.__version__).groups]!r}  # per group, the oracle's",
            f"REGISTER = {[m.name for m in case.methods if m.register]!r}",
            f"CALLS = {[m.name for m in case.methods]!r}",
        ]
        body = _FSDP2
    return "\n".join(head) + "\n" + _COMMON + "\n" + "\n".join(consts) + "\n\n" + body
