"""MP-DTYPES and ACCUM: run a training schedule (optimizer steps, freeze
masks that change between steps, microbatches with gradient sync off on all
but the last, mixed precision) under FSDP1 or FSDP2 next to fp32
single-process training of the same model on every rank's data, and record
what FSDP did; MP-PIPELINE's emulation of the promised pipeline runs next
to it. Reads FSDP internals only for FSDP1's flat gradients (and, for
MP-PIPELINE, their layout: _fqns, _numels_with_padding, _is_padding_mask).

A generated case's microbatch loss is (model(x) ** 2).sum() on a tensor; a
real model's (ModelCase) is its target's own loss on the target's inputs at
a seed per rank, step and microbatch. A real model's modules compute in
dtypes of their own choosing between FSDP's boundaries (HF upcasts norms and
softmax): its forwards' inputs are recorded where FSDP casts them (the
modules given to fully_shard or wrapped as units, cast_forward_inputs on;
FSDP1's root with cast_root_forward_inputs), its floating buffers and every
module's own parameters everywhere."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.utils._python_dispatch import TorchDispatchMode

from conformance.areas.common import fsdp1_adapter as a1
from conformance.areas.common import fsdp2_adapter as a2
from conformance.areas.common.fsdp2_adapter import error_line as _err2
from conformance.areas.common.fsdp2_adapter import full_tensors
from conformance.areas.common.precision_adapter import dtype as _dtype
from conformance.areas.common.precision_adapter import precision_api, wrap_kwargs
from conformance.areas.common.ranks import any_rank_failed
from conformance.areas.common.support import on_rank_device, placed, unchanged
from conformance.areas.common.training import make_optimizer, reference_loss, rel_err
from conformance.areas.schedule.observation import ForwardSeen, MicrobatchSeen, ScheduleObservation, ValueSeen
from conformance.areas.schedule.oracle import EPS, REUSE_ROUNDINGS, cast_paths, predict_schedule, reduction_slack, unit_strategy
from conformance.case.build import BATCH, Built, build, method_callable, read_attr
from conformance.case.model_case import is_model_case
from conformance.case.spec import CaseSpec
from conformance.case.target import cached_target, target_loss
from conformance.case.tree import walk

REDUCE_OPS = ("reduce_scatter", "all_reduce", "allreduce")


def _err(e: BaseException) -> str:
    """Type and first line, object addresses removed (ranks must agree on it)."""

    return re.sub(r" at 0x[0-9a-f]+", "", _err2(e))


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def missing_api() -> str | None:
    """Why the installed torch cannot run training schedules, or None: the
    mixed-precision classes with every field a Precision names, FSDP2's
    set_requires_gradient_sync and FSDP1's no_sync."""

    try:
        MixedPrecision, MixedPrecisionPolicy = precision_api()
        _, FSDPModule, _ = a2.fsdp2_api()
    except ImportError as e:
        return f"torch {torch.__version__} lacks FSDP mixed precision or fully_shard ({e})"
    want = {MixedPrecisionPolicy: ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"),
            MixedPrecision: ("param_dtype", "reduce_dtype", "buffer_dtype", "keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs")}
    for cls, names in want.items():
        lacking = set(names) - {f.name for f in dataclasses.fields(cls)}
        if lacking:
            return f"torch {torch.__version__}: {cls.__name__} lacks {sorted(lacking)}"
    if not hasattr(FSDPModule, "set_requires_gradient_sync"):
        return f"torch {torch.__version__}: FSDPModule lacks set_requires_gradient_sync"

    if not hasattr(FSDP, "no_sync"):
        return f"torch {torch.__version__}: FullyShardedDataParallel lacks no_sync"
    return None


def data(spec: CaseSpec, step: int, micro: int, rank: int):
    """The input of one rank's microbatch: differs by rank and microbatch, so
    that a lost or doubled contribution changes the gradient (a real
    model's: its target's keyword arguments at that seed)."""
    seed = spec.seed * 7919 + step * 613 + micro * 31 + rank
    if is_model_case(spec):
        return on_rank_device(dict(cached_target(spec.target).inputs(seed)))
    gen = torch.Generator().manual_seed(seed)
    return on_rank_device(0.5 * torch.randn(BATCH, generator=gen))


def cast(x, dtype: torch.dtype):
    """The input as the test feeds it: a tensor in ``dtype``; a real model's
    keyword arguments with their floating tensors in ``dtype``."""
    if isinstance(x, dict):
        return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in x.items()}
    return x.to(dtype)


def call(fn, x):
    return fn(**x) if isinstance(x, dict) else fn(x)


def microbatch_loss(spec: CaseSpec, out) -> torch.Tensor:
    """One microbatch's loss of one forward's output, in float32."""
    if is_model_case(spec):
        return target_loss(cached_target(spec.target), out).float()
    return (out.float() ** 2).sum()


def output_tensor(out) -> torch.Tensor:
    """The tensor an output's dtype is read from: itself, a model output's
    logits (or last hidden state), else its first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "last_hidden_state", "prediction_logits"):
        t = getattr(out, name, None)
        if isinstance(t, torch.Tensor):
            return t
    values = out.values() if isinstance(out, dict) else out
    return next(t for t in values if isinstance(t, torch.Tensor))


def reference(spec: CaseSpec, forward, batches: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The single-process reference of one data-parallel microbatch (the
    mean of every rank's loss; see training.reference_loss)."""
    if not is_model_case(spec):
        return reference_loss(forward, batches)
    per_rank = [microbatch_loss(spec, call(forward, x)) for x in batches]
    return torch.stack(per_rank).sum() / len(batches), per_rank


class ReduceRecorder:
    """A dispatch mode recording the gradient-reduction collectives (op, dtype)."""

    def __init__(self):

        rec = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket)
                if any(op in name for op in REDUCE_OPS):
                    ts = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
                    rec.seen.append((name, _name(ts[0].dtype) if ts else "?"))
                return func(*args, **(kwargs or {}))

        self.seen: list[tuple[str, str]] = []
        self.mode = Mode()


class ForwardRecorder:
    """Forward pre-hooks (registered before wrapping: FSDP's own pre-forward
    runs first) on every module of the case, recording the dtypes its forward
    sees, once per module and step."""

    def __init__(self, spec: CaseSpec, built: Built, aliases: a1.Aliases):
        self.step = 0
        self.seen: dict[tuple[int, str], ForwardSeen] = {}
        # ids of the modules whose inputs are recorded; None: every module's
        self.boundaries: set[int] | None = None
        self.user_casts: int | None = None  # the root whose inputs the user casts (UserCast records them)
        if is_model_case(spec):
            for _, mod in built.model.named_modules():
                names = [n for n, p in mod._parameters.items() if p is not None]
                bufs = [n for n, b in mod._buffers.items() if b is not None and b.is_floating_point()]
                mod.register_forward_pre_hook(self._hook(aliases.canon_of_module[id(mod)], names, bufs))
            self.boundaries = set()
            return
        ties = {}
        for t in spec.ties:
            ties.setdefault(t.module, []).append(t.name)
        for path, m in walk(spec.tree):
            mod = built.modules[path]
            names = [p.name for p in m.params] + [n for n in ties.get(path, []) if n not in {p.name for p in m.params}]
            bufs = [b.name for b in m.buffers]
            mod.register_forward_pre_hook(self._hook(aliases.canon_of_module[id(mod)], names, bufs))

    def _hook(self, path: str, names: list[str], bufs: list[str]):
        def hook(mod: nn.Module, args):
            key = (self.step, path)
            if key in self.seen:
                return
            recorded = (self.boundaries is None or id(mod) in self.boundaries) and id(mod) != self.user_casts
            ins = tuple(_name(a.dtype) for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()) if recorded else ()
            params = tuple((n, _name(getattr(mod, n).dtype)) for n in names)
            buffers = tuple((n, _name(getattr(mod, n).dtype)) for n in bufs)
            self.seen[key] = ForwardSeen(self.step, path, ins, params, buffers)

        return hook


class UserCast:
    """The user's own cast of the root's floating forward inputs to
    param_dtype, where FSDP promises none there (FSDP2
    cast_forward_inputs=False; FSDP1 cast_root_forward_inputs=False): the
    test feeds the model float32 and this forward pre-hook, registered on
    the root after wrapping, casts them. It runs after FSDP's pre-forward
    (registered before it: FSDP2 prepends its own, FSDP1's runs in the
    wrapper's forward), so it sees what FSDP handed the root's forward, and
    records those dtypes beside the ones fed (MP-DTYPES: FSDP left them as
    fed). A registered method (the first microbatch's ``s.first``) bypasses
    the root's hooks; its input is cast before the call, and not recorded."""

    def __init__(self, root: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.fed: tuple[str, ...] | None = None  # armed: the dtypes the test fed
        self.handed: tuple[str, ...] | None = None
        root.register_forward_pre_hook(self._hook, with_kwargs=True)

    @staticmethod
    def dtypes(args, kwargs) -> tuple[str, ...]:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        return tuple(_name(t.dtype) for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point())

    def arm(self, x) -> None:
        self.fed, self.handed = self.dtypes((x,), {}), None

    def _hook(self, mod: nn.Module, args, kwargs):
        if self.fed is not None and self.handed is None:  # the test's call, not a method's own self(...)
            self.handed = self.dtypes(args, kwargs)
        return _cast_floats(args, self.dtype), _cast_floats(kwargs, self.dtype)

    def take(self) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
        fed, handed, self.fed, self.handed = self.fed, self.handed, None, None
        return fed, handed


def _err_rel(a: torch.Tensor | None, b: torch.Tensor | None, like: torch.Tensor, slack: torch.Tensor | None = None) -> float:
    """training.rel_err; a missing gradient counts as zeros."""
    a = torch.zeros_like(like) if a is None else a
    b = torch.zeros_like(like) if b is None else b
    return rel_err(a, b, slack)


def _cast_floats(tree, dtype: torch.dtype):
    return torch.utils._pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


class Emulation:
    """The promised mixed-precision pipeline on one process (MP-PIPELINE).

    FSDP2: the MixedPrecisionPolicy docstring step by step: the model
    computes with its parameters in param_dtype; every module given to
    fully_shard casts its floating forward inputs to param_dtype
    (cast_forward_inputs) and the root its output to output_dtype; each
    rank's microbatch runs forward and backward on its own; while gradient
    sync is disabled each rank's gradients accumulate in reduce_dtype; a
    synced microbatch reduces them (the sum over ranks, then the mean, in
    reduce_dtype) and the sharded gradient, in the parameter's dtype,
    accumulates the reductions.

    FSDP1: the MixedPrecision docstring: parameters in param_dtype for
    forward and backward, floating buffers in buffer_dtype; the root casts
    its forward inputs to param_dtype (cast_root_forward_inputs), every
    other FSDP instance too where cast_forward_inputs; a synced microbatch's
    gradients are reduced in reduce_dtype (their mean over ranks), then cast
    back to the parameter's dtype, in which the sharded gradient accumulates
    over synced microbatches. FSDP1 documents no dtype for gradients
    accumulated under no_sync: a step with an unsynced microbatch has no
    promised gradient (``unpromised``); its losses are still the pipeline's.
    FSDP1 pre-divides the gradient by a power of two before the
    reduce-scatter and post-divides the rest after it
    (_get_gradient_predivide_factor, against overflow): implemented, not
    documented; with two ranks the pre-division is by 2 and the
    post-division by 1, both exact for normal numbers, so the mean computed
    here as sum then division rounds identically; with more ranks the sum
    may run in another order, and a subnormal contribution's division
    rounds: both bounded element by element (oracle.reduction_slack)."""

    def __init__(self, spec: CaseSpec, pred, fsdp_paths: list[str], world: int):
        """``fsdp_paths``: the canonical paths of the modules given to
        fully_shard (FSDP2) or wrapped as FSDP1 units (the root's is "")."""
        self.spec, self.world = spec, world
        self.api = spec.plan.api
        self.built = placed(build(spec))
        self.compute, self.reduce = _dtype(pred.compute_dtype), _dtype(pred.reduce_dtype)
        self.names = list(pred.trainable)
        pr = spec.schedule.precision
        self.cast_paths = cast_paths(self.api, pr, fsdp_paths)
        model = self.built.model
        if self.api == "fsdp1" and pr is not None and pr.buffer_dtype is not None:
            # "FSDP casts them to buffer_dtype in the first forward pass and keeps them in that dtype thereafter"
            for m in model.modules():
                for n, b in m._buffers.items():
                    if b is not None and b.is_floating_point():
                        m._buffers[n] = b.to(_dtype(pr.buffer_dtype))
        self.unpromised = False  # FSDP1: this step has an unsynced microbatch (no promised gradient)
        self.overflowed = False
        for path in self.cast_paths:
            model.get_submodule(path).register_forward_pre_hook(
                lambda mod, args, kwargs: (_cast_floats(args, self.compute), _cast_floats(kwargs, self.compute)), with_kwargs=True)
        self.output_dtype = _dtype(pr.output_dtype) if pr is not None and pr.output_dtype else None
        if self.output_dtype is not None:
            model.register_forward_hook(lambda mod, args, out: _cast_floats(out, self.output_dtype))
        self.reduce_name = pred.reduce_dtype
        self.acc: list[dict[str, torch.Tensor]] = []
        self.grads: dict[str, torch.Tensor] = {}
        self.slack: dict[str, torch.Tensor] = {}  # how far another order of the ranks' sum may move self.grads (oracle.reduction_slack)
        # a reused parameter's gradient: each microbatch's may round to another
        # reduce_dtype value than FSDP's (its contributions summed in another
        # order); per rank, the magnitudes of what it accumulates since the
        # last synchronization, for an element-wise slack (thorough seed
        # 16651, bfloat16: microbatch gradients that cancel leave one rounding
        # of theirs large against the sum)
        self.reused = set(pred.reused_params)
        self.mag: list[dict[str, torch.Tensor]] = []

    def start(self, values: dict[str, torch.Tensor], frozen: set[str]) -> None:
        with torch.no_grad():
            for f, v in values.items():
                p = read_attr(self.built.model, f)
                p.data = v.to(self.compute)
                p.requires_grad_(f not in frozen)
        self.acc = [{} for _ in range(self.world)]
        self.mag = [{} for _ in range(self.world)]
        self.grads, self.slack = {}, {}
        self.unpromised = False
        self.overflowed = False  # a loss, an accumulated or a reduced gradient of this step not finite

    def _callable(self, first: int):
        if first < 0:
            return self.built.model
        fn = method_callable(self.built.model, self.spec, first)
        m = self.spec.methods[first]
        # a registered forward method runs its module's pre-forward (the
        # input cast) and post-forward (the root's output cast)
        cast_in = m.module in self.cast_paths
        root_out = self.output_dtype if m.module == "" else None
        if not cast_in and root_out is None:
            return fn

        def cast_call(*args, **kwargs):
            if cast_in:
                args, kwargs = _cast_floats(args, self.compute), _cast_floats(kwargs, self.compute)
            out = fn(*args, **kwargs)
            return _cast_floats(out, root_out) if root_out is not None else out

        return cast_call

    def microbatch(self, si: int, k: int, first: int, sync: bool, in_dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's microbatch; its losses by rank."""
        fn = self._callable(first)
        if self.api == "fsdp1" and not sync:
            self.unpromised = True
        params = {f: read_attr(self.built.model, f) for f in self.names}
        losses = []
        for r in range(self.world):
            for p in self.built.model.parameters():
                p.grad = None
            loss = microbatch_loss(self.spec, call(fn, cast(data(self.spec, si, k, r), in_dtype)))
            if loss.requires_grad:
                loss.backward()
            losses.append(loss.detach())
            self.overflowed |= not bool(torch.isfinite(loss.detach()).all())
            for f, p in params.items():
                if p.grad is None:
                    continue
                if f in self.acc[r]:
                    self.acc[r][f].add_(p.grad)  # in reduce_dtype: the sum rounded once into it
                else:
                    self.acc[r][f] = p.grad.to(self.reduce, copy=True)
                if f in self.reused:
                    m = p.grad.detach().float().abs()
                    self.mag[r][f] = m if f not in self.mag[r] else self.mag[r][f] + m
                self.overflowed |= not bool(torch.isfinite(self.acc[r][f]).all())
        if sync:
            for f in self.names:
                have = [a[f] for a in self.acc if f in a]
                if not have:
                    continue
                total = have[0]
                for a in have[1:]:
                    total = total + a
                reduced = (total / self.world).to(torch.float32)  # the sharded parameter's own dtype
                self.overflowed |= not bool(torch.isfinite(total).all())
                self.grads[f] = reduced if f not in self.grads else self.grads[f] + reduced
                slack = reduction_slack(have, self.world, reduced, EPS[self.reduce_name])  # FSDP may sum in another order
                mags = [m[f] for m in self.mag if f in m]
                if mags:  # a few roundings of every microbatch's reused gradient, averaged as the ranks' are
                    slack = slack + REUSE_ROUNDINGS * EPS[self.reduce_name] * sum(mags) / self.world
                self.slack[f] = slack if f not in self.slack else self.slack[f] + slack
            self.acc = [{} for _ in range(self.world)]
            self.mag = [{} for _ in range(self.world)]
        return losses


class Runner:
    """One schedule on one rank: the FSDP model, the reference, their optimizers."""

    def __init__(self, spec: CaseSpec):
        self.spec = spec
        self.pred = predict_schedule(spec)
        self.api = spec.plan.api
        self.uop = spec.plan.use_orig_params
        self.built, self.ref = placed(build(spec)), placed(build(spec))
        # the reference again, computing in the compute dtype (parameters and
        # inputs cast, single process): how far rounding alone moves this
        # case's results from fp32 training (None: nothing to round)
        self.low_dtype = None if self.pred.compute_dtype == "float32" else _dtype(self.pred.compute_dtype)
        self.low = placed(build(spec)) if self.low_dtype is not None else None
        if self.low is not None and is_model_case(spec) and self.pred.buffer_dtype != "float32":
            # a real model's arithmetic mixes its buffers in: as FSDP1's buffer_dtype casts them
            for m in self.low.model.modules():
                for n, b in m._buffers.items():
                    if b is not None and b.is_floating_point():
                        m._buffers[n] = b.to(_dtype(self.pred.buffer_dtype))
        self.aliases = a1.Aliases(self.built.model)
        self.names = list(self.pred.trainable)  # every canonical FQN
        self.recorder = ForwardRecorder(spec, self.built, self.aliases)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.fsdp_seconds = 0.0  # wrapping, the FSDP model's microbatches and optimizer steps, reading its full values and gradients
        self.emu: Emulation | None = None  # MP-PIPELINE's reference, made once wrapped
        self.emulation_error: str | None = None
        self.user_cast: UserCast | None = None  # made once wrapped, where FSDP promises no cast of the root's inputs

    def wrap(self) -> None:
        s = self.spec.schedule
        kw = wrap_kwargs(self.spec, s.precision)
        if self.api == "fsdp1":
            if s.sharding_strategy != "FULL_SHARD":
                kw["sharding_strategy"] = ShardingStrategy[s.sharding_strategy]
            self.model = a1.wrap(self.spec, self.built, **kw)
        else:
            a2.shard(self.spec, self.built, kw)
            self.model = self.built.model
            _, _, register = a2.fsdp2_api()
            for m in self.spec.methods:
                register(self.built.modules[m.module], m.name)
        self.opt = make_optimizer(s.optimizer, self.model.parameters(), s.lr)
        self.ropt = make_optimizer(s.optimizer, self.ref.model.parameters(), s.lr)
        if self.recorder.boundaries is not None:
            self.recorder.boundaries = self.cast_boundaries()
        # where FSDP promises no cast of the root's inputs, the user casts them
        root_dtype = _dtype(self.pred.input_dtype)
        if root_dtype != torch.float32:
            self.user_cast = UserCast(self.built.model, root_dtype)
            self.recorder.user_casts = id(self.built.model)

    def make_emulation(self) -> None:
        """MP-PIPELINE's reference, where it applies and values mean something
        (the fake tier's collectives move no data)."""
        if self.pred.emulation or dist.get_backend() == "fake":
            return
        if self.api == "fsdp1":
            paths = [self.aliases.canon_of_module[id(u.module)] for u in FSDP.fsdp_modules(self.model)]
        else:
            _, FSDPModule, _ = a2.fsdp2_api()
            paths = [n for n, m in self.model.named_modules() if isinstance(m, FSDPModule)]
        self.emulate(lambda: setattr(self, "emu", Emulation(self.spec, self.pred, paths, self.world)))

    def emulate(self, what, *args):
        """One call into the emulation (MP-PIPELINE); its own failure ends it
        (recorded), never the schedule."""
        try:
            return what(*args)
        except Exception as e:
            self.emulation_error = _err(e)
            self.emu = None
            return None

    def cast_boundaries(self) -> set[int]:
        """The modules whose forward inputs FSDP casts to param_dtype: FSDP2's
        fully_shard modules (cast_forward_inputs, default on); FSDP1's units
        with cast_forward_inputs, its root with cast_root_forward_inputs."""
        pr = self.spec.schedule.precision
        if pr is None or pr.param_dtype is None:
            return set()
        if self.api == "fsdp2":
            if pr.cast_forward_inputs is False:
                return set()
            _, FSDPModule, _ = a2.fsdp2_api()
            return {id(m) for m in self.model.modules() if isinstance(m, FSDPModule)}
        units = FSDP.fsdp_modules(self.model)
        out = {id(u.module) for u in units} if pr.cast_forward_inputs else set()
        if pr.cast_root_forward_inputs:
            out.add(id(self.built.model))
        return out

    # -- the FSDP model's parameters, by canonical FQN -------------------------------
    def handles(self) -> dict[str, torch.Tensor]:
        """The parameters the user sees (FSDP2 DTensors, FSDP1 use_orig_params
        views); {} for FSDP1's flat parameters."""
        if self.api == "fsdp2":
            return {f: read_attr(self.built.model, f) for f in self.names}
        if not self.uop:
            return {}
        out = {}
        for n, p in self.model.named_parameters():
            out.setdefault(self.aliases.param_canon.get(a1.clean(n), a1.clean(n)), p)
        return out

    def full_values(self) -> dict[str, torch.Tensor]:
        if self.api == "fsdp2":
            full = full_tensors({f: read_attr(self.built.model, f) for f in self.names})
            return {f: t.clone() for f, t in full.items()}

        with FSDP.summon_full_params(self.model, writeback=False):
            return {f: read_attr(self.model, f).detach().clone() for f in self.names}

    def full_grads(self) -> dict[str, torch.Tensor | None] | None:
        """Unsharded gradients with their dtypes, or None where FSDP1 keeps
        only flat gradients (use_orig_params=False). Under FSDP1's
        keep_low_precision_grads, summon_full_params(with_grads=True) raises
        on the ranks whose shard holds a low-precision gradient and not on
        the others (which then wait in its all-gather): None there too."""
        if self.api == "fsdp2":
            # the sharded parameter's .grad: what the optimizer sees
            return full_tensors({f: read_attr(self.built.model, f).grad for f in self.names})
        if not self._summons_grads():
            return None

        with FSDP.summon_full_params(self.model, writeback=False, with_grads=True):
            return {f: (None if read_attr(self.model, f).grad is None else read_attr(self.model, f).grad.clone()) for f in self.names}

    def flat_grads(self) -> list[tuple[str, torch.Tensor | None, torch.Tensor]]:
        """FSDP1: (unit path, its flat parameter's gradient, the flat
        parameter) per unit (internals)."""

        out = []
        for unit in FSDP.fsdp_modules(self.model):
            handle = getattr(unit, "_handle", None)
            if handle is not None and handle.flat_param is not None:
                out.append((self.aliases.canon_of_module.get(id(unit.module), "?"), handle.flat_param.grad, handle.flat_param))
        return out

    def emulated_grads(self) -> dict[str, torch.Tensor] | None:
        """The emulated pipeline's gradients of this step (MP-PIPELINE), or
        None where it promises none: not emulated; FSDP1 with an unsynced
        microbatch in the step (no documented accumulation dtype); FSDP1
        keep_low_precision_grads (the gradient's dtype is a known deviation,
        fsdp1-keep-low-precision-grads-param-dtype: MP-DTYPES reports it)."""
        if self.emu is None:
            return None
        pr = self.spec.schedule.precision
        if self.api == "fsdp1" and (self.emu.unpromised or (pr is not None and pr.keep_low_precision_grads)):
            return None
        return self.emu.grads

    def flat_err(self, g: torch.Tensor | None, flat: torch.Tensor, path: str, emu: dict[str, torch.Tensor]) -> float | None:
        """A flat gradient's error against the emulated shard; None where it
        is no shard (fsdp1-mixed-precision-forward-without-backward: an
        unsharded gradient after a forward without backward, the optimizer
        then raises, MP-DTYPES and ACCUM report it)."""
        shard = self.emulated_shard(flat, path, emu)
        if g is not None and g.numel() != shard.numel():
            return None
        return _err_rel(g, shard, shard, self.emulated_shard(flat, path, self.emu.slack)) if shard.numel() else None

    def emulated_shard(self, flat: torch.Tensor, path: str, emu: dict[str, torch.Tensor]) -> torch.Tensor:
        """FSDP1 use_orig_params=False: this rank's shard of the unit's flat
        parameter as the emulated gradients fill it: each original
        parameter's gradient flattened in the flat parameter's order (zeros
        for padding and for parameters without one), the whole padded to a
        multiple of the world size and chunked by rank (a1.flat_layout); a
        NO_SHARD unit keeps the whole, unpadded."""
        parts = []
        for name, numel in a1.flat_layout(flat):
            g = None
            if name is not None:
                fqn = a1.clean(f"{path}.{name}" if path else name)
                g = emu.get(self.aliases.param_canon.get(fqn, fqn))
            parts.append(torch.zeros(numel) if g is None else g.detach().float().reshape(-1).cpu())
        full = torch.cat(parts) if parts else torch.zeros(0)
        strategy = self.spec.schedule.sharding_strategy if is_model_case(self.spec) else unit_strategy(self.spec, path)
        if strategy == "NO_SHARD" or self.world == 1:
            return full.to(flat.device)
        chunk = -(-full.numel() // self.world)
        full = torch.nn.functional.pad(full, (0, chunk * self.world - full.numel()))
        return full[self.rank * chunk:(self.rank + 1) * chunk].to(flat.device)

    def set_frozen(self, frozen: set[str]) -> None:
        for f, p in self.handles().items():
            p.requires_grad_(f not in frozen)
        for f in self.names:
            read_attr(self.ref.model, f).requires_grad_(f not in frozen)
            if self.low is not None:
                read_attr(self.low.model, f).requires_grad_(f not in frozen)

    def set_skip(self, skip: tuple[str, ...]) -> None:
        for built in (self.built, self.ref, self.low, self.emu.built if self.emu is not None else None):
            if built is None:
                continue
            for path, mod in built.modules.items():
                mod.__dict__["_case_skip"] = {c.rpartition(".")[2] for c in skip if c.rpartition(".")[0] == path}

    # -- one step -------------------------------------------------------------------
    def step(self, si: int, obs: dict, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One optimizer step from the full values ``start``; returns the values after it."""
        s = self.spec.schedule
        st = s.steps[si]
        frozen = set(st.frozen)
        self.recorder.step = si
        if self.api == "fsdp2" or self.uop:
            self.set_frozen(frozen)
        with torch.no_grad():  # the reference restarts from FSDP's values: each step is compared on its own
            for f, v in start.items():
                read_attr(self.ref.model, f).copy_(v.float())
                if self.low is not None:
                    read_attr(self.low.model, f).data = v.to(self.low_dtype)
        if self.emu is not None:
            self.emulate(self.emu.start, start, frozen)
        noise = [0.0]  # this step's rounding noise (see rounding_noise)
        self.opt.zero_grad(set_to_none=True)
        self.ropt.zero_grad(set_to_none=True)
        in_dtype = _dtype(self.pred.input_dtype)
        for k, mb in enumerate(st.microbatches):
            sync = st.sync_every or k == len(st.microbatches) - 1
            self.set_skip(mb.skip)
            where = f"step {si} microbatch {k}"
            rec = ReduceRecorder()
            failed = None
            t_fsdp = time.perf_counter()
            try:
                if self.api == "fsdp2":
                    self.model.set_requires_gradient_sync(sync)
                ctx = self.model.no_sync() if self.api == "fsdp1" and not sync else contextlib.nullcontext()
                fn = self.model
                if si == 0 and k == 0 and s.first >= 0:
                    fn = method_callable(self.model, self.spec, s.first)
                x = data(self.spec, si, k, self.rank)
                if self.user_cast is not None and fn is self.model:
                    self.user_cast.arm(x)  # fed as it is: FSDP leaves it, the user's hook casts it
                else:
                    x = cast(x, in_dtype)
                with ctx, rec.mode:
                    out = call(fn, x)
                    loss = microbatch_loss(self.spec, out)
                    if loss.requires_grad:  # not when this microbatch uses frozen parameters only
                        loss.backward()
                    elif self.api == "fsdp2":  # forward only: the root (and reshard_after_forward=False groups) stay unsharded
                        _, FSDPModule, _ = a2.fsdp2_api()
                        for m in self.model.modules():
                            if isinstance(m, FSDPModule):
                                m.reshard()
            except Exception as e:
                failed = e
            self.fsdp_seconds += time.perf_counter() - t_fsdp
            self.agree(obs, where, failed)
            ref_fn = self.ref.model if not (si == 0 and k == 0 and s.first >= 0) else method_callable(self.ref.model, self.spec, s.first)
            total, losses = reference(self.spec, ref_fn, [data(self.spec, si, k, r) for r in range(self.world)])
            if total.requires_grad:
                total.backward()
            mine = losses[self.rank].detach()
            noise += self._low_losses(si, k, losses)
            emulated = self.emulate(self.emu.microbatch, si, k, s.first if si == 0 and k == 0 else -1, sync, in_dtype) if self.emu else None
            emu_err = None if emulated is None else _err_rel(loss, emulated[self.rank], emulated[self.rank])
            fed, handed = self.user_cast.take() if self.user_cast is not None else (None, None)
            obs["microbatches"].append(MicrobatchSeen(si, k, sync, tuple(rec.seen), _name(output_tensor(out).dtype),
                                                      _err_rel(loss, mine, mine), emu_err, fed=fed, handed=handed))
        self.set_skip(())
        if self.pred.reference_zero_grads:  # FSDP1's FlatParameters: see SchedulePrediction
            for f in self.pred.unused_in_used_unit[si]:
                p = read_attr(self.ref.model, f)
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        failed = None
        if self._summons_grads():  # every rank alike (the spec decides): the agreement is one more collective
            try:
                self._check_flat_grads()
            except FlatGradNotSharded as e:
                failed = e
            self.agree(obs, f"step {si} gradients", failed)
        try:
            self._record_grads(si, obs)
        except Exception as e:
            failed = e
        self.agree(obs, f"step {si} gradients", failed)
        t_fsdp = time.perf_counter()
        try:
            if self.spec.schedule.precision is not None and self.spec.schedule.precision.keep_low_precision_grads:
                for p in self.model.parameters():  # a full-precision optimizer needs full-precision gradients
                    if p.grad is not None:
                        p.grad = p.grad.to(p.dtype)
            self.opt.step()
        except Exception as e:
            failed = e
        self.fsdp_seconds += time.perf_counter() - t_fsdp
        self.agree(obs, f"step {si} optimizer", failed)
        if self.low is not None:
            noise += [_err_rel(read_attr(self.low.model, f).grad, read_attr(self.ref.model, f).grad, read_attr(self.ref.model, f))
                      for f in self.names]
            for p in self.low.model.parameters():
                p.grad = None
        obs["noise"].append(max(noise))
        if self._overflows({f: read_attr(self.ref.model, f) for f in self.names}):
            obs["overflow"].append(si)
        self.ropt.step()
        # FSDP1 use_orig_params=True with keep_low_precision_grads: summon_full_params
        # with low-precision gradients present raises on the ranks that hold a
        # gradient shard only (the others wait in its all-gather); they were read above
        self.opt.zero_grad(set_to_none=True)
        after = self.values(obs, f"step {si} values")
        ref = {f: read_attr(self.ref.model, f) for f in self.names}
        for f in self.names:
            obs["params"].append(ValueSeen(si, f, _name(after[f].dtype), False, False, _err_rel(after[f], ref[f], ref[f]),
                                           unchanged(after[f], start[f])))
        return after

    def _overflows(self, ref: dict[str, torch.Tensor]) -> bool:
        """Whether this step's promised pipeline leaves its dtypes' range
        (ScheduleObservation.overflow_steps): the emulation's own values
        where it ran, else the reference's gradients (their mean, which the
        promised reduction must represent in reduce_dtype)."""
        if self.emu is not None and self.emu.overflowed:
            return True
        top = torch.finfo(_dtype(self.pred.reduce_dtype)).max
        return any(float(p.grad.abs().max()) > top for p in ref.values() if p.grad is not None and p.grad.numel())

    def _low_losses(self, si: int, k: int, losses: list[torch.Tensor]) -> list[float]:
        """One microbatch of the low-precision reference (every rank's data,
        gradients accumulated like the reference's); its losses' errors
        against the fp32 reference's."""
        if self.low is None:
            return []
        s = self.spec.schedule
        fn = self.low.model if not (si == 0 and k == 0 and s.first >= 0) else method_callable(self.low.model, self.spec, s.first)
        total, low = reference(self.spec, fn, [cast(data(self.spec, si, k, r), self.low_dtype) for r in range(self.world)])
        if total.requires_grad:
            total.backward()
        return [_err_rel(a, b, b) for a, b in zip(low, losses)]

    def agree(self, obs: dict, where: str, failed: BaseException | None) -> None:
        """Record this rank's failure at ``where``; stop every rank (_Stop)
        if any rank failed there (see any_rank_failed)."""
        if failed is not None:
            obs["step_error"] = f"{where}: {_err(failed)}"
        if any_rank_failed(failed is not None):
            if failed is None:
                obs["peer_failed"] = where
            raise _Stop from failed

    def values(self, obs: dict, where: str) -> dict[str, torch.Tensor]:
        """full_values, its failure recorded like a step's (summon_full_params
        can raise on some ranks only: those then stop here while the others
        wait in its all-gather, a hang inside FSDP)."""
        failed, out = None, {}
        t_fsdp = time.perf_counter()
        try:
            out = self.full_values()
        except Exception as e:
            failed = e
        self.fsdp_seconds += time.perf_counter() - t_fsdp  # summon_full_params / full_tensor: FSDP's (and DTensor's) work
        self.agree(obs, where, failed)
        return out

    def _summons_grads(self) -> bool:
        """Whether full_grads unshards gradients: FSDP1 with
        use_orig_params=True, not keep_low_precision_grads."""
        pr = self.spec.schedule.precision
        return self.api == "fsdp1" and self.uop and not (pr is not None and pr.keep_low_precision_grads)

    def _check_flat_grads(self) -> None:
        """FSDP1, before summon_full_params(with_grads=True) (full_grads):
        FlatGradNotSharded on a rank where a unit's flat gradient is not what
        that unshards, a gradient of its sharded flat parameter's shape and
        dtype. There it raises inside summon_full_params while the other ranks
        wait in its all-gather: a hang that would hide what FSDP left behind
        (fsdp1-mixed-precision-forward-without-backward's unreduced
        low-precision gradient). Every rank agrees on it first (step)."""
        for path, g, flat in self.flat_grads():
            want = tuple(getattr(flat, "_sharded_size", flat.shape))
            if g is not None and (tuple(g.shape) != want or g.dtype != flat.dtype):
                raise FlatGradNotSharded(
                    f"<flat parameter of {path or 'the root'}>'s gradient is {_name(g.dtype)} {list(g.shape)}, its sharded flat parameter "
                    f"{_name(flat.dtype)} {list(want)}: summon_full_params(with_grads=True) would raise on this rank while the others "
                    "wait in its all-gather (not called)")

    def _record_grads(self, si: int, obs: dict) -> None:
        ref = {f: read_attr(self.ref.model, f) for f in self.names}
        emu = self.emulated_grads()
        if self.api == "fsdp1":
            for path, g, flat in self.flat_grads():
                # (a rank whose shard of a unit unused in the last microbatch is empty has none)
                err = None
                if emu is not None and not self.uop:
                    err = self.emulate(self.flat_err, g, flat, path, emu)
                obs["flat"].append(ValueSeen(si, f"<flat parameter of {path or 'the root'}>", None if g is None else _name(g.dtype), g is None, False, None,
                                             emulated_err=err))
        t_fsdp = time.perf_counter()
        grads = self.full_grads()
        self.fsdp_seconds += time.perf_counter() - t_fsdp  # unsharded gradients: FSDP's (and DTensor's) work
        # whether a (frozen) parameter has a gradient: FSDP1's own sharded
        # views, where the unsharded gradients of summon_full_params may be zeros
        own = {f: h.grad is None for f, h in self.handles().items()}
        if grads is None:
            for f, none in own.items():
                obs["grads"].append(ValueSeen(si, f, None, none, ref[f].grad is None, None))
            return
        for f in self.names:
            g, r = grads[f], ref[f].grad
            obs["grads"].append(ValueSeen(si, f, None if g is None else _name(g.dtype), own.get(f, g is None), r is None, _err_rel(g, r, ref[f]),
                                          emulated_err=None if emu is None else _err_rel(g, emu.get(f), ref[f], self.emu.slack.get(f))))


class _Stop(Exception):
    pass


class FlatGradNotSharded(RuntimeError):
    """A unit's flat gradient that summon_full_params(with_grads=True) cannot
    unshard (Runner._check_flat_grads)."""


def observe(spec: CaseSpec) -> ScheduleObservation:
    base = dict(api=spec.plan.api, rank=dist.get_rank(), world_size=dist.get_world_size(),
                backend=str(dist.get_backend()), torch_version=torch.__version__)
    t0 = time.perf_counter()
    run = Runner(spec)
    failed = None
    t_wrap = time.perf_counter()
    try:
        run.wrap()
    except Exception as e:
        failed = e
    run.fsdp_seconds += time.perf_counter() - t_wrap
    # (every rank creates the side group here, before FSDP can disagree)
    if any_rank_failed(failed is not None):
        return ScheduleObservation(**base, wrap_error=_err(failed) if failed else None, peer_failed=None if failed else "wrap",
                                   seconds=time.perf_counter() - t0)
    run.make_emulation()
    obs: dict = {"microbatches": [], "grads": [], "params": [], "flat": [], "step_error": None, "peer_failed": None, "noise": [], "overflow": []}
    try:
        values = run.values(obs, "initial values")
        for si in range(len(spec.schedule.steps)):
            values = run.step(si, obs, values)
    except _Stop:
        pass
    buffers = tuple((run.aliases.canon_of_module.get(id(m), "?") + "." + n if run.aliases.canon_of_module.get(id(m)) else n, _name(b.dtype))
                    for m in run.built.modules.values() for n, b in m._buffers.items() if b is not None and b.is_floating_point())
    return ScheduleObservation(
        **base, step_error=obs["step_error"], peer_failed=obs["peer_failed"], rounding_noise=tuple(obs["noise"]), overflow_steps=tuple(obs["overflow"]), forwards=tuple(run.recorder.seen.values()),
        microbatches=tuple(obs["microbatches"]), grads=tuple(obs["grads"]) + tuple(obs["flat"]), params=tuple(obs["params"]),
        buffers_after=buffers, seconds=time.perf_counter() - t0, fsdp_seconds=run.fsdp_seconds, emulation_error=run.emulation_error,
    )
