"""Checkpoint adapter: full state dicts (SD-FULL), load paths and ties
(TIES-KEPT), torch.distributed.checkpoint save under one plan and world size
and load under another (CKPT-RESHARD, OPTIM-STATE). Version differences of
the state-dict APIs are hidden here. A generated case trains on
(model(x) ** 2).sum(); a real model's case (ModelCase) on its target's own
loss of its inputs (a new seed each step, the same on every rank)."""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import distribute_tensor

from conformance.areas.checkpoint.observation import CkptObservation
from conformance.areas.checkpoint.oracle import matrix_names, predict_ckpt, with_mask
from conformance.areas.common import fsdp1_adapter as a1
from conformance.areas.common import fsdp2_adapter as a2
from conformance.areas.common.fsdp2_adapter import error_line as _err1
from conformance.areas.common.fsdp2_adapter import load_cause
from conformance.areas.common.precision_adapter import wrap_kwargs
from conformance.areas.common.support import on_rank_device, placed, rank_device
from conformance.areas.common.training import NOISE_FACTOR, TRAIN_ATOL, TRAIN_RTOL, diverged, make_optimizer, noise, reference_loss
from conformance.case.build import build, is_sharded, read_attr
from conformance.case.model_case import is_model_case
from conformance.case.spec import CaseSpec
from conformance.case.target import graph_of, target_loss

LR = 0.05
OTHER_LR = 0.5  # param_groups=2: the second group's learning rate, a fraction of LR
LR_DECAY = 0.8  # the schedule step before the save (_schedule)


# ---- torch version differences -------------------------------------------------


def _errors() -> tuple[type[BaseException], ...]:
    """What a checkpoint call may raise: CheckpointException derives from
    BaseException, not Exception."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:
        return (Exception,)
    return (Exception, CheckpointException)


ERRORS = _errors()


def _err(e: BaseException) -> str:
    """'Type: first line'; for a CheckpointException (whose first line only
    names the ranks) the first failing rank's own exception as well:
    'CheckpointException: rank R: InnerType: its first line'."""
    failures = getattr(e, "failures", None)
    if type(e).__name__ != "CheckpointException" or not isinstance(failures, dict) or not failures:
        return _err1(e) + load_cause(e)
    rank = min(failures)
    wrapped = failures[rank]
    # a (exception, stack summary) pair, or an object with .exc in other releases
    inner = wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped)
    if not isinstance(inner, BaseException):
        return _err1(e)
    return f"{type(e).__name__}: rank {rank}: {_err1(inner)}"


try:  # imported with the adapter, so that a pool's fork server preloads it
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
except ImportError:  # a torch without it: dcp_api() says so, cases SKIP
    pass


def dcp_api():
    """(torch.distributed.checkpoint, its state_dict module), or None when this
    torch has no torch.distributed.checkpoint.state_dict (before 2.2)."""
    try:
        import torch.distributed.checkpoint as dcp
        import torch.distributed.checkpoint.state_dict as sd
    except ImportError:
        return None
    return dcp, sd


def missing_api(spec: CaseSpec) -> str | None:
    """Why this torch cannot run the case (a SKIP), or None."""
    api = dcp_api()
    if api is None:
        return f"torch {torch.__version__} has no torch.distributed.checkpoint.state_dict"
    _, sd = api
    fields = {f.name for f in dataclasses.fields(sd.StateDictOptions)}
    ck = spec.ckpt
    if ck is not None and ck.load_path == "set_model_state_dict-broadcast" and "broadcast_from_rank0" not in fields:
        return f"torch {torch.__version__}: StateDictOptions has no broadcast_from_rank0"
    return None


# ---- the case at save and at load ----------------------------------------------


def load_spec(spec: CaseSpec) -> CaseSpec:
    """The case as the load side builds it: its load plan and load-time mask
    (without load_frozen: the mask at the save, refreeze applied, as the
    oracle and the uninterrupted run have it)."""
    ck = spec.ckpt
    frozen = _mask(spec) if ck.load_frozen is None else frozenset(ck.load_frozen)
    return with_mask(dataclasses.replace(spec, plan=ck.load_plan or spec.plan), frozen)


def wrap(spec: CaseSpec, built, meta_init: bool = False, precise: bool = False) -> nn.Module:
    """The case's wrap; ``precise``: under its checkpoint plan's mixed
    precision (none where the plan has none)."""
    extra = wrap_kwargs(spec, spec.ckpt.precision if precise else None)
    if spec.plan.api == "fsdp1":
        if meta_init:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            # the docstring's param_init_fn: each meta module materialized on
            # its own (the case's modules have no reset_parameters)
            return FSDP(built.model, auto_wrap_policy=a1.make_policy(spec, built), device_id=rank_device(),
                        use_orig_params=spec.plan.use_orig_params,
                        param_init_fn=lambda m: m.to_empty(device=rank_device(), recurse=False), **extra)
        return a1.wrap(spec, built, **extra)
    a2.shard(spec, built, extra)
    if meta_init:
        built.model.to_empty(device=rank_device())
    return built.model


def _optimizer(spec: CaseSpec, model: nn.Module) -> torch.optim.Optimizer:
    """The case's optimizer over every parameter, frozen ones included (a
    parameter that trains later, or trained before, keeps its place and its
    state); with param_groups=2 the matrices at LR and every other parameter
    a group of its own at LR * OTHER_LR without weight decay."""
    ck = spec.ckpt
    if ck.param_groups == 1:
        return make_optimizer(ck.optimizer, model.parameters(), LR)
    matrices = matrix_names(spec)
    groups: tuple[list, list] = ([], [])
    for name, p in model.named_parameters():
        groups[a1.clean(name) not in matrices].append(p)
    return make_optimizer(ck.optimizer, [{"params": groups[0]}, {"params": groups[1], "lr": LR * OTHER_LR, "weight_decay": 0.0}], LR)


def _schedule(opt: torch.optim.Optimizer) -> None:
    """A learning-rate schedule's step, taken before the save: the saved
    hyperparameters differ from the ones the load side builds its optimizer
    with, so that the load must restore them."""
    for g in opt.param_groups:
        g["lr"] = g["lr"] * LR_DECAY


def step_loss(spec: CaseSpec, built, model: nn.Module, step: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The loss of training step ``step`` (the same batch on every rank): a
    generated case's (model(x_step) ** 2).sum(), a real model's own loss of
    its target's inputs at seed + step; ``dtype``: a floating input's (the
    float64 reference's)."""
    if is_model_case(spec):
        target = built.target
        return target_loss(target, model(**on_rank_device(dict(target.inputs(spec.seed + step)))))
    x = built.example_input()
    if dtype is not None and x.is_floating_point():
        x = x.to(dtype)
    loss, _ = reference_loss(model, [x * (1.0 + 0.25 * step)])
    return loss


def train_step(spec: CaseSpec, built, model: nn.Module, opt: torch.optim.Optimizer, step: int,
               dtype: torch.dtype | None = None) -> None:
    """One step on this step's batch (the same on every rank)."""
    opt.zero_grad(set_to_none=True)
    loss = step_loss(spec, built, model, step, dtype)
    if loss.requires_grad:
        loss.backward()
    opt.step()


def set_frozen(model: nn.Module, fqns, frozen: bool) -> None:
    for f in fqns:
        read_attr(model, f).requires_grad_(not frozen)


def single_process(spec: CaseSpec, *, until_save: bool, dtype: torch.dtype | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The reference: the same schedule on one process, no FSDP; ``dtype``
    (float64): the same training in that precision, whose distance from the
    float32 reference is the reference's own rounding noise."""
    ck = spec.ckpt
    ref = placed(build(spec))
    if dtype is not None:
        ref.model.to(dtype)
    opt = _optimizer(spec, ref.model)
    for step in range(ck.steps):
        train_step(spec, ref, ref.model, opt, step, dtype)
        if step == 0 and ck.refreeze:
            flip(ref.model, ck.refreeze, spec)
    _schedule(opt)
    if until_save:
        return ref.model, opt
    apply_load_mask(spec, ref.model)
    for step in range(ck.steps, ck.steps + ck.steps_after):
        train_step(spec, ref, ref.model, opt, step, dtype)
    return ref.model, opt


def _noise_only(init: nn.Module, ref32: nn.Module, ref64: nn.Module, fqns) -> set[str]:
    """The parameters among ``fqns`` whose trajectory is rounding noise: the
    float32 reference moved them, the float64 one did not (to 1e-9 of their
    size): their gradient is zero in exact arithmetic (a LayerNorm's weight
    over one element: x - mean is 0), so any two summation orders move them
    apart by noise alone, by more than the float32-float64 distance predicts
    (seed 54: FSDP resumed 0.2881, uninterrupted 0.2843, the reference
    0.2831, from 0.2842 at the start). A frozen parameter moves in neither
    and stays compared. ``init``: the case's model as built."""
    out = set()
    for f in fqns:
        try:
            p0, p32, p64 = (read_attr(m, f).detach().double().cpu() for m in (init, ref32, ref64))
        except AttributeError:
            continue
        if p0.shape != p32.shape or p0.shape != p64.shape or not p0.is_floating_point():
            continue
        still64 = bool(((p64 - p0).abs() <= 1e-9 * (1.0 + p0.abs())).all())
        if still64 and not torch.equal(p32, p0):
            out.add(f)
    return out


def _by_id(spec: CaseSpec) -> dict[str, str]:
    """Parameter id (a CaseSpec's spec FQN where it was made, a ModelCase's
    canonical FQN) -> canonical FQN."""
    return {pid: fqn for fqn, pid in graph_of(spec).named_parameters()}


def flip(model: nn.Module, pids, spec: CaseSpec) -> None:
    names = _by_id(spec)
    for pid in pids:
        p = read_attr(model, names[pid])
        p.requires_grad_(not p.requires_grad)


def apply_load_mask(spec: CaseSpec, model: nn.Module) -> None:
    if spec.ckpt.load_frozen is None:
        return
    frozen = set(spec.ckpt.load_frozen)
    for pid, fqn in _by_id(spec).items():
        read_attr(model, fqn).requires_grad_(pid not in frozen)


# ---- full values, independent of the state-dict APIs ------------------------------


def canonical_names(spec: CaseSpec) -> list[str]:
    """Canonical parameter FQNs of the unwrapped model (first alias of each)."""
    return list(a1.Aliases(build(spec).model).canon_of_param.values())


def full_params(spec: CaseSpec, model: nn.Module, inner: nn.Module) -> dict[str, torch.Tensor]:
    """{canonical FQN: full value} (summon_full_params / DTensor.full_tensor)."""
    names = canonical_names(spec)
    if spec.plan.api == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False):
            return {f: read_attr(model, f).detach().clone() for f in names}
    return {f: t.clone() for f, t in a2.full_tensors({f: read_attr(inner, f) for f in names}).items()}


def _plain(t) -> bool:
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, nn.Parameter) and not is_sharded(t)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = a.detach(), b.detach()
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        x = a.item() if isinstance(a, torch.Tensor) else a
        y = b.item() if isinstance(b, torch.Tensor) else b
        return x == y
    return a == b


def _close(a, b, floor: torch.Tensor | float = 0.0) -> bool:
    """``a`` equals the reference ``b`` within the training tolerance plus
    NOISE_FACTOR times ``floor``, the reference's own rounding noise (its
    distance from the float64 reference): a gradient that is zero in exact
    arithmetic, such as a LayerNorm weight's over one element, is rounding
    noise that momentum and large losses carry into the values (seed 54:
    0.2935 against 0.2889 after two SGD steps, FSDP and resume agreeing)."""
    a = torch.as_tensor(a).detach().float().cpu()
    b = torch.as_tensor(b).detach().float().cpu()
    if a.shape != b.shape:
        return False
    bound = TRAIN_ATOL + TRAIN_RTOL * b.abs() + NOISE_FACTOR * torch.as_tensor(floor, dtype=torch.float32)
    # a drawn case whose training diverges (squared loss through a chain of
    # layers) reaches NaN in the reference too; NaN where the reference has
    # NaN is the same training, NaN elsewhere still differs
    return bool(((a - b).abs() <= bound).logical_or(a == b).logical_or(a.isnan() & b.isnan()).all())


# ---- SD-FULL -----------------------------------------------------------------------


def full_state_dict(spec: CaseSpec, model: nn.Module) -> dict:
    ck = spec.ckpt
    if ck.full_sd == "fsdp1-full":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        cfg = FullStateDictConfig(offload_to_cpu=ck.offload, rank0_only=ck.rank0_only)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            return {a1.clean(k): v for k, v in model.state_dict().items()}
    _, sd = dcp_api()
    opts = sd.StateDictOptions(full_state_dict=True, cpu_offload=ck.offload, ignore_frozen_params=ck.ignore_frozen)
    return sd.get_model_state_dict(model, options=opts)


def _same_values(a, b) -> bool:
    """Shape and values equal, ``a`` read in ``b``'s dtype (its dtype is
    compared on its own)."""
    a, b = a.detach(), b.detach()
    return a.shape == b.shape and bool(torch.equal(a.to(b.dtype).cpu(), b.cpu()))


def _through(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded through ``dtype``, in its own dtype."""
    return t.to(dtype).to(t.dtype)


def observe_full(spec: CaseSpec) -> CkptObservation:
    base = _base("sd-full", spec)
    if (why := missing_api(spec)) is not None:
        return CkptObservation(**base, skipped=why)
    built, ref = placed(build(spec)), placed(build(spec))
    t0 = time.perf_counter()
    try:
        model = wrap(spec, built, precise=True)
    except ERRORS as e:
        return CkptObservation(**base, error=_err(e), phase="wrap")
    if spec.ckpt.warm and (err := _forward(spec, built, model, 0)) is not None:  # a model in use: one forward first
        return CkptObservation(**base, error=err, phase="forward")
    try:
        got = full_state_dict(spec, model)
    except ERRORS as e:
        return CkptObservation(**base, error=_err(e), phase="state_dict")
    seconds = time.perf_counter() - t0  # wrapping, the forward and the full state dict: FSDP's (or DCP's) work
    want = ref.model.state_dict()
    pred = predict_ckpt(spec)
    low = getattr(torch, pred.buffer_dtype) if pred.buffer_dtype else None
    for k in pred.rounded_buffers:
        # cast to buffer_dtype by the forward and kept there: saved in full
        # precision, at the values the forward left
        if k in want and want[k].is_floating_point():
            want[k] = _through(want[k], low)
    common = [k for k in got if k in want and isinstance(got[k], torch.Tensor)]
    dtypes = tuple(sorted((k, str(got[k].dtype).removeprefix("torch.")) for k in common if got[k].dtype != want[k].dtype))
    not_plain = tuple(sorted(k for k, v in got.items() if not _plain(v) or (spec.ckpt.offload and v.device.type != "cpu")))
    try:
        # reading a value can raise: a tensor whose storage FSDP freed during
        # the same state_dict() call (thorough seed 1984394500)
        wrong = tuple(sorted(k for k in common if _plain(got[k]) and not _same_values(got[k], want[k])))
        # the wrong values that are the unwrapped model's rounded through buffer_dtype
        rounded = () if low is None else tuple(
            k for k in wrong if want[k].is_floating_point() and _same_values(got[k], _through(want[k], low)))
    except ERRORS as e:
        return CkptObservation(**base, error=_err(e), phase="read")
    return CkptObservation(**base, keys=tuple(sorted(got)), wrong_values=wrong, wrong_dtypes=dtypes, not_plain=not_plain,
                           rounded=rounded, seconds=(("fsdp", seconds),))


# ---- TIES-KEPT ------------------------------------------------------------------------


def _ties(model: nn.Module, tied: dict[str, list[str]]) -> tuple[tuple[str, bool], ...]:
    return tuple((canon, len({id(read_attr(model, n)) for n in names}) == 1) for canon, names in sorted(tied.items()))


def _count(model: nn.Module) -> int:
    return len(list(model.parameters()))


def _source_state(spec: CaseSpec) -> dict[str, torch.Tensor]:
    """The state dict to load: the case's model from another seed (values
    distinguishable from the ones it starts with), ties shared."""
    other = placed(build(dataclasses.replace(spec, seed=(spec.seed + 1) % 2**32)))
    return {k: v.detach().clone() for k, v in other.model.state_dict().items()}


def observe_ties(spec: CaseSpec) -> CkptObservation:
    base = _base("ties", spec)
    if (why := missing_api(spec)) is not None:
        return CkptObservation(**base, skipped=why)
    _, sd = dcp_api()
    path = spec.ckpt.load_path
    source = _source_state(spec)
    # ties share a tensor in the source too (state_dict keeps aliases)
    tied = a1.Aliases(build(spec).model).tied
    for canon, names in tied.items():
        for n in names:
            source[n] = source[canon]
    meta = path == "meta-to_empty"
    if meta:
        with torch.device("meta"):
            built = placed(build(spec))
    else:
        built = placed(build(spec))
    before = len(canonical_names(spec))  # the unwrapped model's parameters
    t0 = time.perf_counter()
    try:
        if path == "load_state_dict-assign" and spec.plan.api == "fsdp1":
            # FSDP1 loads full state dicts into its flat parameters; assign=True
            # is for the module before wrapping (weights loaded, then wrapped)
            built.model.load_state_dict(source, assign=True)
            model = wrap(spec, built, precise=True)
        else:
            model = wrap(spec, built, meta_init=meta, precise=True)
    except ERRORS as e:
        return CkptObservation(**base, error=_err(e), phase="wrap")
    if spec.ckpt.warm and (err := _forward(spec, built, model, 1)) is not None:  # a model in use (FSDP2's lazy init done)
        return CkptObservation(**base, error=err, phase="forward-before-load")
    try:
        if path in ("load_state_dict", "load_state_dict-assign") and not (path.endswith("assign") and spec.plan.api == "fsdp1"):
            _load_state_dict(spec, model, source, assign=path.endswith("assign"))
        elif path in ("set_model_state_dict", "meta-to_empty"):
            # a copy: set_model_state_dict may replace the dict's tensors
            sd.set_model_state_dict(model, _copy(source), options=sd.StateDictOptions(full_state_dict=True))
        elif path == "set_model_state_dict-broadcast":
            src = _copy(source) if dist.get_rank() == 0 else {}
            sd.set_model_state_dict(model, src, options=sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        err = None
    except ERRORS as e:
        err = _err(e)
    err = _agreed_error(err)
    if err is not None:
        return CkptObservation(**base, error=err, phase="load")
    seconds = time.perf_counter() - t0  # wrapping, the warm forward and the load: FSDP's (and DCP's) work
    try:
        values = full_params(spec, model, built.model)
    except ERRORS as e:
        return CkptObservation(**base, error=_err(e), phase="state_dict")
    wrong = tuple(sorted(f for f, v in values.items() if not _same(v, source[f])))
    ties, after = _ties(built.model, tied), _count(model)  # as the load left them (FSDP2's lazy init re-registers parameters)
    losses = None
    if base["backend"] != "fake":
        # the first forward after the load computes with the loaded values
        # (FSDP2 re-reads a parameter load_state_dict(assign=True) replaced:
        # FSDPParam's load post-hook and, before the first forward, lazy init)
        try:
            with torch.no_grad():
                got = step_loss(spec, built, model, 0).item()
        except ERRORS as e:
            return CkptObservation(**base, error=_err(e), phase="forward")
        ref = placed(build(spec))
        ref.model.load_state_dict(source)
        try:
            # under mixed precision the forward computes in param_dtype: the
            # reference is the same wrap of a model built with the loaded
            # state (FSDP's own pipeline, nothing loaded into it)
            reference = ref.model if spec.ckpt.precision is None else wrap(spec, ref, precise=True)
            with torch.no_grad():
                losses = (got, step_loss(spec, ref, reference, 0).item())
        except ERRORS as e:
            return CkptObservation(**base, error=_err(e), phase="reference")
    return CkptObservation(**base, ties=ties, params_before=before, params_after=after,
                           wrong_values=wrong, forward_loss=losses, seconds=(("fsdp", seconds),))


def _forward(spec: CaseSpec, built, model: nn.Module, step: int) -> str | None:
    """One forward without backward on step ``step``'s batch; what raised,
    agreed between the ranks (_agreed_error), or None."""
    try:
        with torch.no_grad():
            step_loss(spec, built, model, step)
        err = None
    except ERRORS as e:
        err = _err(e)
    return _agreed_error(err)


def _agreed_error(err: str | None) -> str | None:
    """Every rank learns whether any rank raised, so that none goes on into
    collectives the others never reach (a load that raises on some ranks
    only hangs the job at its next collective: seed 2601). A rank that did
    not raise while others did reports 'RankDivergence: ...'."""
    errs: list = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    failed = [r for r, e in enumerate(errs) if e is not None]
    if err is None and failed:
        return f"RankDivergence: rank {dist.get_rank()} did not raise; rank(s) {failed} raised {errs[failed[0]]}"
    return err


def _load_state_dict(spec: CaseSpec, model: nn.Module, source: dict, *, assign: bool) -> None:
    if spec.plan.api == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            model.load_state_dict(source)
        return
    # FSDP2's own recipe: a state dict of DTensors laid out as the model's

    sharded = {}
    for k, cur in model.state_dict().items():
        v = source[k]
        sharded[k] = distribute_tensor(v, cur.device_mesh, cur.placements) if is_sharded(cur) else v
    model.load_state_dict(sharded, assign=assign)


# ---- CKPT-RESHARD / OPTIM-STATE: save, then load elsewhere ---------------------------


def _full_state(model, opt) -> tuple[dict, dict]:
    """Full model and optimizer state dicts, copied (on one rank a "full"
    tensor may be the parameter itself, which training goes on to change)."""
    _, sd = dcp_api()
    opts = sd.StateDictOptions(full_state_dict=True)
    return _copy(sd.get_model_state_dict(model, options=opts)), _copy(sd.get_optimizer_state_dict(model, opt, options=opts))


def _copy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_copy(v) for v in x)
    return x


def save(spec: CaseSpec, dir: str) -> dict:
    """Train, save with torch.distributed.checkpoint into ``dir``, record the
    saved full state there, continue training (the uninterrupted run)."""
    base = _base("roundtrip", spec)
    if (why := missing_api(spec)) is not None:
        return CkptObservation(**base, skipped=why).to_dict()
    dcp, sd = dcp_api()
    ck = spec.ckpt
    built = placed(build(spec))
    times = {}
    try:
        with _timed(times, "fsdp"):  # wrapping and training steps
            model = wrap(spec, built)
            opt = _optimizer(spec, model)
            for step in range(ck.steps):
                train_step(spec, built, model, opt, step)
                if step == 0 and ck.refreeze:
                    flip(built.model, ck.refreeze, spec)
            _schedule(opt)
    except ERRORS as e:
        return CkptObservation(**base, error=_err(e), phase="train").to_dict()
    with _timed(times, "dcp"):
        try:
            msd, osd = sd.get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir(dir))
        except ERRORS as e:
            return CkptObservation(**base, error=_err(e), phase="save").to_dict()
    try:
        full_model, full_optim = _full_state(model, opt)
    except ERRORS as e:
        return CkptObservation(**base, error=_err(e), phase="state_dict").to_dict()
    cont = None
    # the uninterrupted run: what the load side must reproduce (FSDP1 takes
    # no requires_grad change after wrapping, so only with the same mask)
    same_mask = spec.ckpt.load_frozen is None or _mask(spec) == frozenset(spec.ckpt.load_frozen)
    if spec.plan.api == "fsdp2" or same_mask:
        try:
            with _timed(times, "fsdp"):  # the FSDP model's steps after the save
                apply_load_mask(spec, built.model)
                for step in range(ck.steps, ck.steps + ck.steps_after):
                    train_step(spec, built, model, opt, step)
            cont = full_params(spec, model, built.model)
        except ERRORS as e:
            return CkptObservation(**base, error=_err(e), phase="resume").to_dict()
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save({"model": full_model, "optim": full_optim, "continued": cont}, os.path.join(dir, "saved.pt"))
    dist.barrier()
    return CkptObservation(**base, optim_saved=tuple(sorted(full_optim.get("state", {}))), seconds=tuple(times.items())).to_dict()


def _mask(spec: CaseSpec) -> frozenset[str]:
    """The parameters frozen at the save (the case's mask, refreeze applied), by id."""
    g = graph_of(spec)
    frozen = {pid for _, pid in g.named_parameters() if not g.requires_grad(pid)}
    return frozenset(frozen ^ set(spec.ckpt.refreeze))


def ckpt_dir(dir: str) -> str:
    return os.path.join(dir, "ckpt")


def load(spec: CaseSpec, dir: str) -> dict:
    """Build the case under its load plan, mask and world size, load the
    checkpoint in ``dir``, compare with what was saved, train on."""
    ck = spec.ckpt
    lspec = load_spec(spec)
    base = _base("roundtrip", lspec)
    if (why := missing_api(spec)) is not None:
        return CkptObservation(**base, skipped=why).to_dict()
    dcp, sd = dcp_api()
    built = placed(build(lspec))
    times = {}
    try:
        with _timed(times, "fsdp"):
            model = wrap(lspec, built)
            opt = _optimizer(lspec, model)
    except ERRORS as e:
        return CkptObservation(**base, error=_err(e), phase="wrap").to_dict()
    with _timed(times, "dcp"):
        try:
            msd, osd = sd.get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=ckpt_dir(dir))
            sd.set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        except ERRORS as e:
            return CkptObservation(**base, error=_err(e), phase="load").to_dict()
    saved = torch.load(os.path.join(dir, "saved.pt"), map_location="cpu", weights_only=False)
    try:
        full_model, full_optim = _full_state(model, opt)
    except ERRORS as e:
        return CkptObservation(**base, error=_err(e), phase="state_dict").to_dict()
    model_diff = _dict_diff(full_model, saved["model"])
    saved_state, got_state = saved["optim"].get("state", {}), full_optim.get("state", {})
    optim_diff = []
    for fqn in sorted(set(saved_state) | set(got_state)):
        a, b = got_state.get(fqn), saved_state.get(fqn)
        if a is None or b is None:
            continue  # presence is OPTIM-STATE's, compared by name
        optim_diff += [f"{fqn}.{k}" for k in _dict_diff(a, b)]
    groups_diff = _groups_diff(full_optim.get("param_groups", []), saved["optim"].get("param_groups", []))
    groups_params = _groups_params(full_optim.get("param_groups", []), saved["optim"].get("param_groups", []))
    ref_model, ref_opt = single_process(spec, until_save=True)
    ref_state = _ref_state(ref_model, ref_opt)
    # a real model's reference is not rerun in float64: no noise floor
    fp64 = not is_model_case(spec)
    init = placed(build(spec)).model if fp64 else None
    ref64_model, ref64_opt = single_process(spec, until_save=True, dtype=torch.float64) if fp64 else (None, None)
    ref64_state = _ref_state(ref64_model, ref64_opt) if fp64 else {}
    noise_saved = _noise_only(init, ref_model, ref64_model, ref_state) if fp64 else set()
    ref_diff = []
    for fqn, st in ref_state.items():
        got = next((saved_state[n] for n in _aliases(ref_model, fqn) if n in saved_state), None)
        if got is None or fqn in noise_saved:  # presence is compared by name; a noise trajectory is no value
            continue
        floor = noise({k: v for k, v in st.items() if isinstance(v, torch.Tensor)}, ref64_state.get(fqn, {}))
        ref_diff += [f"{fqn}.{k}" for k, v in st.items() if k not in got or not _close(got[k], v, floor.get(k, 0.0))]
    # resume: the load mask, the steps after the save
    try:
        with _timed(times, "fsdp"):
            for step in range(ck.steps, ck.steps + ck.steps_after):
                train_step(lspec, built, model, opt, step)
        final = full_params(lspec, model, built.model)
    except ERRORS as e:
        return CkptObservation(**base, error=_err(e), phase="resume").to_dict()
    ref_final, _ = single_process(spec, until_save=False)
    ref_values = {f: read_attr(ref_final, f).detach() for f in final}
    ref64_final = single_process(spec, until_save=False, dtype=torch.float64)[0] if fp64 else None
    floors = noise(ref_values, {f: read_attr(ref64_final, f) for f in ref_values}) if fp64 else {}
    noise_final = _noise_only(init, ref_final, ref64_final, ref_values) if fp64 else set()
    cont = saved.get("continued")
    if _diverged(spec, ref_values):
        # the reference training diverged: two correct summation orders end
        # arbitrarily far apart, no tolerance judges the resume (seed 2601:
        # squared loss through a chain of Linears, 4.7e18 after four steps)
        resume_ref, resume_cont = (), None
    else:
        compared = {f: v for f, v in final.items() if f not in noise_final}
        resume_ref = tuple(sorted(f for f, v in compared.items() if not _close(v, ref_values[f], floors.get(f, 0.0))))
        resume_cont = None if cont is None else tuple(sorted(
            f for f, v in final.items() if f not in cont or (f in compared and not _close(v, cont[f], floors.get(f, 0.0)))))
    return CkptObservation(
        **base, model_diff=tuple(model_diff), optim_saved=tuple(sorted(saved_state)), optim_loaded=tuple(sorted(got_state)),
        optim_ref=tuple(sorted(ref_state)), optim_diff=tuple(optim_diff), optim_ref_diff=tuple(ref_diff),
        groups_diff=groups_diff, groups_params=groups_params, resume_ref_diff=resume_ref, resume_cont_diff=resume_cont, seconds=tuple(times.items()),
    ).to_dict()


def _diverged(spec: CaseSpec, ref_values: dict[str, torch.Tensor]) -> bool:
    """The single-process reference's parameters after the resume are not
    finite or grew past DIVERGED times their initial size (as PARITY judges
    a diverged reference)."""
    initial = placed(build(spec)).model
    return diverged({f: read_attr(initial, f).detach().float() for f in ref_values}, {f: v.float() for f, v in ref_values.items()})


def _aliases(model: nn.Module, canon: str) -> list[str]:
    names = a1.Aliases(model).tied.get(canon)
    return names or [canon]


def _ref_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    canon = a1.Aliases(model).canon_of_param
    return {canon[id(p)]: dict(st) for p, st in opt.state.items() if st}


def _dict_diff(got: dict, want: dict) -> list[str]:
    out = [k for k in sorted(set(got) ^ set(want))]
    out += [k for k in sorted(set(got) & set(want)) if not _same(got[k], want[k])]
    return out


def _groups_diff(got: list, want: list) -> tuple[str, ...]:
    if len(got) != len(want):
        return (f"{len(got)} param_groups, saved {len(want)}",)
    out = []
    for i, (g, w) in enumerate(zip(got, want)):
        for k in sorted(set(g) | set(w)):
            if k == "params":
                if sorted(g.get(k, ())) != sorted(w.get(k, ())):
                    out.append(f"group {i}: params")
            elif not _same(g.get(k), w.get(k)):
                out.append(f"group {i}: {k}")
    return tuple(out)


def _groups_params(got: list, want: list) -> tuple:
    """(index, loaded-only names, saved-only names) of each group whose
    params differ."""
    out = []
    for i, (g, w) in enumerate(zip(got, want)):
        a, b = set(g.get("params", ())), set(w.get("params", ()))
        if a != b:
            out.append((i, tuple(sorted(a - b)), tuple(sorted(b - a))))
    return tuple(out)


# ---- helpers -------------------------------------------------------------------------


def _base(kind: str, spec: CaseSpec) -> dict:
    return dict(kind=kind, api=spec.plan.api, rank=dist.get_rank(), world_size=dist.get_world_size(), backend=str(dist.get_backend()),
                torch_version=torch.__version__)


@contextmanager
def _timed(times: dict, what: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[what] = times.get(what, 0.0) + time.perf_counter() - t0
