"""CaseSpec: the pure, immutable description of one conformance case."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Union

from conformance.case.graph import ModelGraph
from conformance.case.tree import join, walk

SPEC_VERSION = 1

# Base classes a drawn class may derive from. "Module" gives a plain custom
# module; the containers are torch's own; a drawn class may also derive from
# another drawn class, so that isinstance differs from exact type.
CONTAINER_BASES = ("Module", "Sequential", "ModuleList", "ModuleDict")
# torch leaf modules a tree may hold; their parameters are fixed by torch.
LEAF_TYPES = ("Linear", "Embedding", "LayerNorm")


class SpecError(ValueError):
    """A CaseSpec (or its JSON) that does not describe a buildable case."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    requires_grad: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModuleSpec:
    """One module: its class, its own parameters and buffers, its children in
    registration order. ``name`` is the attribute name in the parent ("" for
    the root)."""

    name: str
    cls: str
    params: tuple[ParamSpec, ...] = ()
    buffers: tuple[BufferSpec, ...] = ()
    children: tuple["ModuleSpec", ...] = ()


@dataclass(frozen=True)
class ClassSpec:
    """A module class the case defines: ``class name(base)``."""

    name: str
    base: str = "Module"


@dataclass(frozen=True)
class SharedModule:
    """Register the module at ``source`` again, as ``parent.name``."""

    parent: str
    name: str
    source: str


@dataclass(frozen=True)
class TiedParam:
    """Make ``module.name`` the very Parameter at FQN ``source`` (weight tying).
    Replaces a parameter of that name in place, else appends one."""

    module: str
    name: str
    source: str


# ---- wrap policies ---------------------------------------------------------


@dataclass(frozen=True)
class ModuleWrap:
    """torch.distributed.fsdp.wrap.ModuleWrapPolicy(classes)."""

    classes: tuple[str, ...]


@dataclass(frozen=True)
class CustomWrap:
    """CustomPolicy: targets by path; a target with kwargs gets a kwargs dict
    (keys from CUSTOM_KWARGS), one without gets True."""

    targets: tuple[str, ...]
    kwargs: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()


@dataclass(frozen=True)
class SizeBasedWrap:
    """functools.partial(size_based_auto_wrap_policy, min_num_params=...)."""

    min_num_params: int


@dataclass(frozen=True)
class LambdaWrap:
    """functools.partial(lambda_auto_wrap_policy, lambda_fn=path in targets)."""

    targets: tuple[str, ...]


@dataclass(frozen=True)
class TransformerWrap:
    """functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=...)."""

    classes: tuple[str, ...]


Policy = Union[ModuleWrap, CustomWrap, SizeBasedWrap, LambdaWrap, TransformerWrap]
POLICY_TYPES = (ModuleWrap, CustomWrap, SizeBasedWrap, LambdaWrap, TransformerWrap)
# Per-module kwargs a CustomPolicy may return; values must not change which
# parameters a unit manages. (limit_all_gathers and use_orig_params must be
# homogeneous across units: FSDP's lazy init rejects a mix.)
CUSTOM_KWARGS = {
    "sharding_strategy": ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
    "forward_prefetch": (True, False),
}


@dataclass(frozen=True)
class ShardGroup:
    """One fully_shard call (FSDP2): ``fully_shard(modules[0])``, or the
    multi-module form ``fully_shard([a, b, ...])`` with one parameter group
    for all of them (the supported way to shard a parameter tied across
    modules). None: torch's default reshard_after_forward (True for non-root
    modules, False for the root)."""

    modules: tuple[str, ...]
    # an int (>= 2): the world size to reshard to after forward (a non-trivial
    # divisor of the mesh's; the comm area draws it)
    reshard_after_forward: bool | int | None = None


@dataclass(frozen=True)
class WrapPlan:
    api: str = "fsdp1"  # "fsdp1" | "fsdp2"
    policy: Policy | None = None
    use_orig_params: bool = False
    ignored_modules: tuple[str, ...] = ()
    ignored_params: tuple[str, ...] = ()  # FQNs, passed as ignored_states
    # FSDP2: the fully_shard calls besides the root's (applied bottom-up: a
    # group is sharded after every group below it). The root is always
    # sharded last, by a group naming "" or else with the default.
    groups: tuple[ShardGroup, ...] = ()


# ---- user forward methods ----------------------------------------------------

# Names a drawn forward method may take: the upstream use cases (HF
# generate(), a ViT's forward_features) and a few more. None is an attribute
# of nn.Module.
METHOD_NAMES = ("generate", "forward_features", "encode", "decode", "score", "logits")
# What one step of a method body does with the running activation x:
# "param": read the parameter at attribute path ``target`` (relative to the
# method's module, e.g. "weight" or "embed.weight") directly, not through its
# module's forward: F.linear for a matrix (the HF generate() head that reuses
# the embedding's weight), tanh-mean for others; "child": call the submodule
# at ``target`` (FSDP-wrapped or not); "forward": self.forward(x) (no hooks);
# "call": self(x) (the module's own forward hooks run inside the method).
METHOD_OPS = ("param", "child", "forward", "call")


@dataclass(frozen=True)
class MethodStep:
    op: str
    target: str = ""


@dataclass(frozen=True)
class ForwardMethod:
    """``def name(self, x, shift=0.0, *, scale=1.0)`` on the module at
    ``module`` (a drawn class): x + shift through ``steps``, times scale.
    ``register``: pass it to register_fsdp_forward_method (FSDP2) or run it
    inside summon_full_params(recurse=False) (the FSDP1 workaround)."""

    module: str
    name: str
    steps: tuple[MethodStep, ...] = ()
    register: bool = True


@dataclass(frozen=True)
class MethodCall:
    """Call methods[method] (-1: the root's forward, model(x)) ``times`` times
    in a row; ``keyword``: as m(x, 0.25, scale=1.5) rather than m(x)."""

    method: int
    times: int = 1
    keyword: bool = False


@dataclass(frozen=True)
class TrainPlan:
    """A few optimizer steps on loss = (model(x_step) ** 2).sum() (PARITY).

    FSDP2 only, where fully_shard's module has the setters: ``force_sum``
    calls set_force_sum_reduction_for_comms(True) on every FSDP module (the
    collectives only SUM; FSDP divides separately: gradients are still the
    mean over ranks); ``divide_factor`` calls set_gradient_divide_factor(f)
    (gradients are the sum over ranks divided by f)."""

    optimizer: str = "SGD"  # "SGD" | "Adam"
    steps: int = 2
    lr: float = 0.05
    force_sum: bool = False
    divide_factor: float | None = None


OPTIMIZERS = ("SGD", "Adam")


# ---- checkpoints (lifecycle: state dicts, torch.distributed.checkpoint) -----

# How a full state dict is taken (SD-FULL): FSDP1's FULL_STATE_DICT with its
# FullStateDictConfig flags, or torch.distributed.checkpoint.state_dict's
# get_model_state_dict(full_state_dict=True) with its options.
FULL_SD_WAYS = ("fsdp1-full", "dcp-full")
# How a full state dict is loaded back (TIES-KEPT).
LOAD_PATHS = ("load_state_dict", "load_state_dict-assign", "set_model_state_dict", "set_model_state_dict-broadcast", "meta-to_empty")
CKPT_OPTIMIZERS = ("SGD", "Adam", "AdamW")
MAX_WORLD = 3


@dataclass(frozen=True)
class CheckpointPlan:
    """Save under the case's plan on ``save_world`` ranks, load under
    ``load_plan`` on ``load_world`` ranks. Optimizer over every parameter
    (frozen ones get no state until they train); ``steps`` before the save,
    ``steps_after`` after it (continued and resumed). ``refreeze``: FQNs whose
    requires_grad flips after the first step (before the save);
    ``load_frozen``: the parameters frozen at load (and after it).
    ``full_sd``/``rank0_only``/``offload``/``ignore_frozen``: how SD-FULL takes
    the full state dict; ``load_path``: how TIES-KEPT loads one;
    ``warm``: TIES-KEPT's model runs one forward before the load (a load
    into a model in use, FSDP2's lazy init done), SD-FULL's one before the
    state dict (a checkpoint of a model in use); ``precision``: the mixed
    precision of SD-FULL's and TIES-KEPT's wrap (one of CKPT_PRECISIONS:
    FSDP1's MixedPrecision, FSDP2's MixedPrecisionPolicy; buffer_dtype
    FSDP1's only). ``param_groups``: the round trip's optimizer, 1 group or 2
    as training scripts split them (the matrices, and every other parameter
    at another learning rate without weight decay: per-parameter groups, so
    FSDP2 or FSDP1 with use_orig_params=True at the save and at the load)."""

    save_world: int = 2
    load_world: int = 2
    load_plan: WrapPlan | None = None  # None: the case's own plan
    optimizer: str = "SGD"
    steps: int = 1
    steps_after: int = 1
    refreeze: tuple[str, ...] = ()
    load_frozen: tuple[str, ...] | None = None  # None: the case's own mask
    full_sd: str = "dcp-full"
    rank0_only: bool = False
    offload: bool = False
    ignore_frozen: bool = False
    load_path: str = "load_state_dict"
    warm: bool = False
    precision: Precision | None = None
    param_groups: int = 1


# ---- gradient clipping (clip area) -------------------------------------------

# norm_type by name: float(name) is the value ("inf": math.inf), and a name
# keeps the spec's JSON and repr plain (float("inf") is neither).
NORM_TYPES = ("2", "1", "3", "inf")
# How the gradients are clipped: torch.nn.utils.clip_grad_norm_;
# get_total_norm then clip_grads_with_norm_ (the two-step form); FSDP1's
# FullyShardedDataParallel.clip_grad_norm_ (the root's method, every parameter).
CLIP_WAYS = ("clip_grad_norm_", "get_total_norm", "fsdp1-method")
# max_norm as a fraction of the single-process total norm: below 1 the
# gradients are scaled down, from 1 on they are left as they are.
CLIP_FRACTIONS = (0.5, 0.1, 2.0)


@dataclass(frozen=True)
class ClipPlan:
    """One backward of loss = (model(x_rank) ** 2).sum() on data that differs
    by rank, then the gradients clipped ``way`` with norm ``norm_type`` to
    max_norm = ``fraction`` times the single-process norm; ``foreach``: the
    nn.utils ways' argument (None: torch's default). ``subset``: the path of
    the module whose parameters are clipped (None: every parameter; FSDP1's
    method always clips every one). ``precision``: mixed precision for the
    wrap, one of CLIP_PRECISIONS (FSDP2's MixedPrecisionPolicy takes
    param_dtype and reduce_dtype; FSDP1's MixedPrecision also
    keep_low_precision_grads)."""

    norm_type: str = "2"
    way: str = "clip_grad_norm_"
    foreach: bool | None = None
    fraction: float = 0.5
    subset: str | None = None
    precision: Precision | None = None


def validate_clip(spec: "CaseSpec") -> None:
    c = spec.clip
    if c is None:
        return
    if c.norm_type not in NORM_TYPES or c.way not in CLIP_WAYS or c.fraction not in CLIP_FRACTIONS:
        raise SpecError(f"clip plan {c!r}: norm_type one of {NORM_TYPES}, way one of {CLIP_WAYS}, fraction one of {CLIP_FRACTIONS}")
    if c.foreach not in (None, True, False):
        raise SpecError(f"clip plan {c!r}: foreach must be None, True or False")
    if (c.way == "fsdp1-method") != (spec.plan.api == "fsdp1"):
        raise SpecError(f"clip plan {c!r}: FSDP1 clips with its own method, FSDP2 with torch.nn.utils'")
    if c.way == "fsdp1-method" and (c.foreach is not None or c.subset is not None):
        raise SpecError(f"clip plan {c!r}: FSDP1's method takes no foreach and clips every parameter")
    if c.subset is not None and c.subset not in {p for p, _ in walk(spec.tree)}:
        raise SpecError(f"clip plan {c!r}: subset names no module")
    if c.precision is not None:
        if c.precision not in CLIP_PRECISIONS:
            raise SpecError(f"clip plan {c!r}: precision one of {CLIP_PRECISIONS}")
        if c.precision.keep_low_precision_grads and spec.plan.api != "fsdp1":
            raise SpecError(f"clip plan {c!r}: keep_low_precision_grads is FSDP1's (MixedPrecision)")
        if spec.plan.ignored_params or spec.plan.ignored_modules:
            raise SpecError(f"clip plan {c!r}: mixed precision casts no ignored parameter (bf16 activations would meet fp32 weights)")


# ---- init and order of user actions (init_order area) ------------------------

# What a user may call on the wrapped model before its first forward, in a
# drawn order: model.state_dict(); torch.distributed.checkpoint.state_dict's
# get_model_state_dict; FSDP2's FSDPModule.unshard() and unshard(async_op=True)
# followed by wait() (each a full step: the parameters are resharded by the
# first forward's own logic).
INIT_ACTIONS = ("state_dict", "get_model_state_dict", "unshard", "unshard-async")
# model.to(dtype) after fully_shard (FSDP2): the parameters stay DTensors of it.
INIT_DTYPES = ("float64",)
INIT_OPTIMIZERS = ("SGD", "Adam", "AdamW")


@dataclass(frozen=True)
class InitPlan:
    """When things happen around FSDP's lazy initialisation, then ``steps``
    optimizer steps of loss = (model(x_rank) ** 2).sum() on data that
    differs by rank. ``before``: actions run on the wrapped model before the
    first forward, in order (after the optimizer is built);
    ``optimizer_after_forward``: the optimizer is built after the first
    forward and backward (FSDP's lazy init done), before the first step,
    rather than right after wrapping; ``dtype``: model.to(dtype) after sharding (FSDP2);
    ``meta``: the model is built on the meta device, wrapped, then
    materialised (to_empty + the user's reset of every module's own
    parameters and buffers; FSDP1: param_init_fn); ``sync``: every rank
    builds the model from its own seed (seed + rank) and FSDP makes them
    rank 0's (FSDP1 sync_module_states=True; FSDP2 set_model_state_dict of
    rank 0's full state dict with broadcast_from_rank0); ``skip``: the path
    of a module rank 1's forward passes over (the others call it);
    ``replace`` (FSDP2): after sharding (and materialising or syncing),
    before the optimizer and every action, one parameter
    (replaced_parameter) is registered anew as an nn.Parameter computed
    from it, as DoRA initialises its magnitudes from the loaded weights:
    fully_shard re-reads the modules' parameters at lazy init
    (FSDPParamGroup.lazy_init: "Users may change or register parameters
    after construction time")."""

    before: tuple[str, ...] = ()
    optimizer_after_forward: bool = False
    dtype: str | None = None
    meta: bool = False
    sync: bool = False
    skip: str | None = None
    optimizer: str = "SGD"
    steps: int = 2
    replace: bool = False


# The value a replaced parameter gets (InitPlan.replace): new = old * SCALE + SHIFT
REPLACE_SCALE, REPLACE_SHIFT = -0.5, 0.125


@functools.lru_cache(maxsize=1024)  # validation, the strategy, the oracle and each rank ask it of one spec
def replaced_parameter(spec: "CaseSpec") -> str | None:
    """The parameter InitPlan.replace registers anew: the first, in
    named_parameters() order, that no other name reaches (no tie, no
    shared module: a replacement through one name would untie the others)
    and that holds some elements (an empty one's value shows nowhere)."""
    from conformance.case.graph import ModelGraph

    g = ModelGraph(spec)
    for fqn, pid in g.named_parameters():
        if len(g.aliases(pid)) == 1 and g.numel(pid) > 0:
            return fqn
    return None


def validate_init(spec: "CaseSpec") -> None:
    p = spec.init
    if p is None:
        return
    if any(a not in INIT_ACTIONS for a in p.before) or p.optimizer not in INIT_OPTIMIZERS or not 1 <= p.steps <= 3:
        raise SpecError(f"init plan {p!r}: actions from {INIT_ACTIONS}, optimizer one of {INIT_OPTIMIZERS}, 1..3 steps")
    if p.dtype is not None and p.dtype not in INIT_DTYPES:
        raise SpecError(f"init plan {p!r}: dtype one of {INIT_DTYPES}")
    if spec.plan.api == "fsdp1":
        if p.dtype is not None or any(a.startswith("unshard") for a in p.before):
            raise SpecError(f"init plan {p!r}: unshard() and to(dtype) are FSDP2's")
        if p.optimizer_after_forward and not spec.plan.use_orig_params:
            raise SpecError(f"init plan {p!r}: FSDP1 keeps the original parameters (optimizer after forward) only with use_orig_params=True")
    if p.meta and p.sync:
        raise SpecError(f"init plan {p!r}: meta-device init and rank-seeded sync are separate cases")
    if p.replace:
        if spec.plan.api != "fsdp2" or p.skip is not None:
            raise SpecError(f"init plan {p!r}: a replaced parameter is an FSDP2 case without a skipped module")
        if replaced_parameter(spec) is None:
            raise SpecError(f"init plan {p!r}: no parameter to replace (every one tied, shared or empty)")
    if p.skip is not None:
        paths = {path for path, _ in walk(spec.tree)}
        if p.skip == "" or p.skip not in paths:
            raise SpecError(f"init plan {p!r}: skip names no non-root module")
        if p.meta or p.sync or p.before or p.dtype or p.optimizer_after_forward:
            raise SpecError(f"init plan {p!r}: a rank-divergent case changes nothing else")
        if spec.shared or spec.ties:
            raise SpecError(f"init plan {p!r}: a skipped module is neither shared nor tied")
# ---- HSDP and 2-D meshes (hsdp area) -------------------------------------------

# How the hybrid layout is given: FSDP2's fully_shard(mesh=<2-D (replicate,
# shard) DeviceMesh>); FSDP1's FullyShardedDataParallel(device_mesh=<the same
# mesh>) or process_group=(shard group, replicate group).
HSDP_WAYS = ("fsdp2-mesh", "fsdp1-mesh", "fsdp1-pg")
HSDP_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
# (replicate, shard) shapes: 4 ranks (the 2-D mesh and its degenerate forms)
# and 2 ranks (the degenerate forms on the suite's default pool)
HSDP_MESHES = ((2, 2), (4, 1), (1, 4), (2, 1), (1, 2))
HSDP_OPTIMIZERS = ("SGD", "Adam")


@dataclass(frozen=True)
class HsdpPlan:
    """``steps`` optimizer steps of loss = (model(x_rank) ** 2).sum() on data
    that differs by rank (so by replica), the model sharded over the shard
    dim of a (replicate, shard) = ``mesh`` layout given ``way``; FSDP1 with
    sharding ``strategy`` (FSDP2 reshards as the plan's groups say). The
    same case also runs as flat FSDP over the whole world (FSDP2's 1-D mesh;
    FSDP1 FULL_SHARD, or SHARD_GRAD_OP for _HYBRID_SHARD_ZERO2)."""

    mesh: tuple[int, int] = (2, 2)
    way: str = "fsdp2-mesh"
    strategy: str = "HYBRID_SHARD"
    steps: int = 2
    optimizer: str = "SGD"
    lr: float = 0.05

    @property
    def world(self) -> int:
        return self.mesh[0] * self.mesh[1]


def validate_hsdp(spec: "CaseSpec") -> None:
    h = spec.hsdp
    if h is None:
        return
    if tuple(h.mesh) not in HSDP_MESHES or h.way not in HSDP_WAYS or h.strategy not in HSDP_STRATEGIES:
        raise SpecError(f"hsdp plan {h!r}: mesh one of {HSDP_MESHES}, way one of {HSDP_WAYS}, strategy one of {HSDP_STRATEGIES}")
    if (h.way == "fsdp2-mesh") != (spec.plan.api == "fsdp2"):
        raise SpecError(f"hsdp plan {h!r}: FSDP2 takes a mesh, FSDP1 a mesh or a process-group pair")
    if h.way == "fsdp2-mesh" and h.strategy != "HYBRID_SHARD":
        raise SpecError(f"hsdp plan {h!r}: a sharding strategy is FSDP1's (FSDP2 reshards as its groups say)")
    if h.optimizer not in HSDP_OPTIMIZERS or not 1 <= h.steps <= 3 or not h.lr > 0:
        raise SpecError(f"hsdp plan {h!r}: optimizer one of {HSDP_OPTIMIZERS}, 1..3 steps, lr > 0")
    if spec.plan.ignored_modules or spec.plan.ignored_params or spec.shared:
        # ignored parameters' gradients are the user's to reduce, over which replicas is no promise
        raise SpecError("hsdp plan: no ignored modules or parameters, no shared modules")
    if isinstance(spec.plan.policy, CustomWrap) and spec.plan.policy.kwargs:
        raise SpecError("hsdp plan: the sharding strategy is the plan's, for every unit (no per-unit kwargs)")


# ---- activation checkpointing (activation_checkpointing area) ----------------

# How a target module's forward is checkpointed: torch.distributed.algorithms.
# _checkpoint.checkpoint_wrapper (NO_REENTRANT / REENTRANT) replacing the module
# in its parent; torch.utils.checkpoint.checkpoint(forward, use_reentrant=False)
# around its forward; the same with context_fn=create_selective_checkpoint_contexts
# (selective AC: tanh outputs saved, the rest recomputed); the composable
# torch.distributed._composable.checkpoint(module) (FSDP2 only: the composable API).
AC_KINDS = ("wrapper-non-reentrant", "wrapper-reentrant", "utils-checkpoint", "selective", "composable")


@dataclass(frozen=True)
class ActivationCheckpointPlan:
    """Checkpoint the modules at ``targets`` (non-root, none inside another)
    the ``kind`` way, applied before FSDP wraps or shards the model (as
    torchtitan does), then ``steps`` SGD steps of loss =
    (model(x_rank) ** 2).sum() on data that differs by rank, x requiring grad
    (the reentrant variant needs a checkpointed input that does)."""

    kind: str = "wrapper-non-reentrant"
    targets: tuple[str, ...] = ()
    steps: int = 2


def validate_activation_checkpoint(spec: "CaseSpec") -> None:
    a = spec.activation_checkpoint
    if a is None:
        return
    if a.kind not in AC_KINDS or not 1 <= a.steps <= 3:
        raise SpecError(f"activation checkpoint plan {a!r}: kind one of {AC_KINDS}, 1..3 steps")
    if a.kind == "composable" and spec.plan.api != "fsdp2":
        raise SpecError("activation checkpoint plan: the composable checkpoint goes with FSDP2")
    paths = {p for p, _ in walk(spec.tree)}
    if not a.targets or any(t == "" or t not in paths for t in a.targets) or len(set(a.targets)) != len(a.targets):
        raise SpecError(f"activation checkpoint plan {a!r}: targets must be distinct non-root module paths")
    if any(x != y and y.startswith(x + ".") for x in a.targets for y in a.targets):
        raise SpecError(f"activation checkpoint plan {a!r}: a target inside another")
    if spec.shared or spec.plan.ignored_modules or spec.plan.ignored_params:
        # a wrapper replaces a module by path: a shared module's other name and
        # ignored modules or parameters named by path would not follow it
        raise SpecError("activation checkpoint plan: no shared modules, ignored modules or ignored parameters")


# ---- tensor parallelism + FSDP2 (tp area) ------------------------------------

# The parallel style a leaf takes (torch.distributed.tensor.parallel), each so
# that the leaf takes and returns plain, replicated tensors as the case's
# forward passes them: "colwise": ColwiseParallel(output_layouts=Replicate())
# (Linear, Embedding); "rowwise": RowwiseParallel(input_layouts=Replicate())
# (Linear, Embedding); "sequence": SequenceParallel(sequence_dim=0) on a
# LayerNorm, its input made a Replicate DTensor and its output gathered back
# (PrepareModuleInputOutput).
TP_STYLES = {"Linear": ("colwise", "rowwise"), "Embedding": ("colwise", "rowwise"), "LayerNorm": ("sequence",)}
# (dp, tp) shapes: the 2-D mesh on 4 ranks, its degenerate forms on 2
TP_MESHES = ((2, 2), (1, 2), (2, 1))
TP_OPTIMIZERS = ("SGD", "Adam")
# FSDP2 MixedPrecisionPolicy: none; param_dtype bf16 (reduce_dtype unset);
# param_dtype bf16 with reduce_dtype fp32
TP_PRECISIONS = ("none", "bf16", "bf16-fp32-reduce")


@dataclass(frozen=True)
class TpPlan:
    """Tensor parallelism + FSDP2 on a (dp, tp) = ``mesh`` DeviceMesh:
    parallelize_module over its "tp" dim with ``styles`` ((leaf path, style)),
    then fully_shard(mesh=mesh["dp"]) on the plan's groups and the root;
    ``steps`` optimizer steps of loss = (model(x) ** 2).sum() on data that
    differs by dp rank (the same across a dp rank's tp ranks), under the
    ``precision`` policy; then one more backward and its gradients clipped
    (clip_grad_norm_, norm ``norm_type``, ``foreach``) over every parameter
    (``clip_all``) or only those TP shards (on the 2-D mesh)."""

    mesh: tuple[int, int] = (2, 2)
    styles: tuple[tuple[str, str], ...] = ()
    steps: int = 2
    optimizer: str = "SGD"
    lr: float = 0.05
    precision: str = "none"
    norm_type: str = "2"
    foreach: bool = False
    clip_all: bool = True
    clip_way: str = "clip_grad_norm_"  # or "get_total_norm": get_total_norm then clip_grads_with_norm_
    # (colwise Linear, rowwise Linear) siblings whose activation stays sharded
    # between them, as in a transformer's MLP: the parent's forward runs
    # rowwise(tanh(colwise(x))) and the pair takes ColwiseParallel() (output
    # Shard(-1), local) and RowwiseParallel() (input Shard(-1)), the default
    # layouts torchtitan's plans pair; the colwise leaf's out_features is the
    # rowwise leaf's in_features
    pairs: tuple[tuple[str, str], ...] = ()

    @property
    def world(self) -> int:
        return self.mesh[0] * self.mesh[1]


def validate_tp(spec: "CaseSpec") -> None:
    t = spec.tp
    if t is None:
        return
    if tuple(t.mesh) not in TP_MESHES or t.optimizer not in TP_OPTIMIZERS or t.precision not in TP_PRECISIONS:
        raise SpecError(f"tp plan {t!r}: mesh one of {TP_MESHES}, optimizer one of {TP_OPTIMIZERS}, precision one of {TP_PRECISIONS}")
    if not 1 <= t.steps <= 3 or not t.lr > 0 or t.norm_type not in NORM_TYPES or t.foreach not in (True, False) or t.clip_all not in (True, False):
        raise SpecError(f"tp plan {t!r}: 1..3 steps, lr > 0, norm_type one of {NORM_TYPES}, foreach and clip_all booleans")
    if t.clip_way not in CLIP_WAYS[:2]:
        raise SpecError(f"tp plan {t!r}: clip_way one of {CLIP_WAYS[:2]}")
    if spec.plan.api != "fsdp2":
        raise SpecError("tp plan: tensor parallelism composes with FSDP2 (fully_shard(mesh=mesh['dp']))")
    if spec.plan.ignored_modules or spec.plan.ignored_params or spec.shared or spec.methods:
        raise SpecError("tp plan: no ignored modules or parameters, no shared modules, no forward methods")
    mods = dict(walk(spec.tree))
    paths = [p for p, _ in t.styles]
    if len(set(paths)) != len(paths):
        raise SpecError(f"tp plan {t!r}: a leaf takes one style")
    for path, style in t.styles:
        m = mods.get(path)
        if m is None or style not in TP_STYLES.get(m.cls, ()):
            raise SpecError(f"tp plan {t!r}: {path!r} must be a Linear, Embedding or LayerNorm leaf taking a style of {TP_STYLES}")
    styles = dict(t.styles)
    paired = [p for pair in t.pairs for p in pair]
    if len(set(paired)) != len(paired):
        raise SpecError(f"tp plan {t!r}: a leaf is in one pair")
    for a, b in t.pairs:
        ma, mb = mods.get(a), mods.get(b)
        if styles.get(a) != "colwise" or styles.get(b) != "rowwise" or ma is None or mb is None or ma.cls != "Linear" or mb.cls != "Linear":
            raise SpecError(f"tp plan {t!r}: pair {(a, b)!r} must be a colwise Linear and a rowwise Linear of the styles")
        if a.rpartition(".")[0] != b.rpartition(".")[0] or not a or not b:
            raise SpecError(f"tp plan {t!r}: pair {(a, b)!r} must be siblings")
        wa, wb = (next(q.shape for q in m.params if q.name == "weight") for m in (ma, mb))
        if wa[0] != wb[1]:
            raise SpecError(f"tp plan {t!r}: pair {(a, b)!r}: {a}'s out_features {wa[0]} must be {b}'s in_features {wb[1]}")
    owner = {join(p, q.name): p for p, m in walk(spec.tree) for q in m.params}
    for tie in spec.ties:
        if tie.module in paths or owner.get(tie.source) in paths:
            raise SpecError(f"tp plan: tie {tie!r} touches a tensor-parallel leaf (its parameter would be replaced under the tie)")


@dataclass(frozen=True)
class CaseSpec:
    tree: ModuleSpec
    classes: tuple[ClassSpec, ...] = ()
    shared: tuple[SharedModule, ...] = ()
    ties: tuple[TiedParam, ...] = ()
    plan: WrapPlan = field(default_factory=WrapPlan)
    seed: int = 0
    methods: tuple[ForwardMethod, ...] = ()
    calls: tuple[MethodCall, ...] = ()
    train: TrainPlan | None = None
    ckpt: CheckpointPlan | None = None
    schedule: Schedule | None = None  # MP-DTYPES, ACCUM
    clip: ClipPlan | None = None  # CLIP-NORM, CLIP-GRADS
    comm: CommPlan | None = None  # the communication invariants (COMM-*)
    microbatch: MicrobatchPlan | None = None  # FSDP2's schedule APIs per microbatch (MB-*)
    activation_checkpoint: ActivationCheckpointPlan | None = None  # AC-PARITY, AC-STATE-DICT, AC-ALLGATHER
    init: InitPlan | None = None  # INIT-ORDER, INIT-META, INIT-SYNC, INIT-DIVERGENT
    hsdp: HsdpPlan | None = None  # HSDP-* (2-D meshes, FSDP1's hybrid strategies)
    tp: TpPlan | None = None  # TP-* (tensor parallelism + FSDP2 on a (dp, tp) mesh)

    def __post_init__(self) -> None:
        validate(self)

    # -- JSON ---------------------------------------------------------------
    def to_json(self) -> str:
        return self._json

    @functools.cached_property
    def _json(self) -> str:
        # the spec is immutable: its JSON (digests, repro names, sizes) is made once
        return json.dumps({"version": SPEC_VERSION, "case": encode(self)}, sort_keys=True)

    def __getstate__(self) -> dict:
        # pickled (the rank pool ships specs so): without the cached JSON
        return {k: v for k, v in self.__dict__.items() if k != "_json"}

    @classmethod
    def from_json(cls, text: str) -> "CaseSpec":
        return load_json(text, CaseSpec, SPEC_VERSION, "case")

    def to_python(self) -> str:
        """Python source that rebuilds this spec (the repr, with its import)."""
        return "from conformance.case.spec import *\n\nspec = " + repr(self) + "\n"


def load_json(text: str, cls: type, version: int, key: str, types: tuple = ()):
    """A ``cls`` from the JSON object {"version": version, key: ...}; any
    other text is one SpecError naming what is wrong."""
    what = cls.__name__
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{what} JSON is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("version") != version or key not in data:
        raise SpecError(f"{what} JSON must be an object with version {version} and a '{key}'")
    try:
        return decode(cls, data[key], types=types)
    except SpecError:
        raise
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise SpecError(f"{what} JSON does not describe a case: {type(e).__name__}: {e}") from None


# ---- training schedules (MP-DTYPES, ACCUM) ----------------------------------

# Floating dtypes a precision setting may name (torch.<name>).
DTYPES = ("float32", "bfloat16", "float16")
SCHEDULE_OPTIMIZERS = ("SGD", "Adam", "AdamW")


@dataclass(frozen=True)
class Precision:
    """FSDP2 MixedPrecisionPolicy / FSDP1 MixedPrecision, dtypes by name
    (None: unset). output_dtype is FSDP2's only; buffer_dtype,
    keep_low_precision_grads and cast_root_forward_inputs FSDP1's only.
    cast_forward_inputs None: the API's default (FSDP2 True, FSDP1 False)."""

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    output_dtype: str | None = None
    buffer_dtype: str | None = None
    cast_forward_inputs: bool | None = None
    cast_root_forward_inputs: bool = True
    keep_low_precision_grads: bool = False


# The clip area's mixed precision (ClipPlan.precision): bf16 compute with
# the reduction in bf16 (reduce_dtype None: the compute dtype) or fp32, and
# FSDP1's gradients kept in the reduce dtype (keep_low_precision_grads).
CLIP_PRECISIONS = (
    Precision(param_dtype="bfloat16"),
    Precision(param_dtype="bfloat16", reduce_dtype="float32"),
    Precision(param_dtype="bfloat16", keep_low_precision_grads=True),
)

# The checkpoint area's mixed precision (CheckpointPlan.precision, SD-FULL):
# compute in bf16 or fp16 (the state dict still full precision), FSDP1's
# buffers cast to buffer_dtype at the first forward (saved in full
# precision all the same), or buffer_dtype alone.
CKPT_PRECISIONS = (
    Precision(param_dtype="bfloat16"),
    Precision(param_dtype="float16"),
    Precision(param_dtype="bfloat16", buffer_dtype="bfloat16"),
    Precision(param_dtype="float16", buffer_dtype="float16"),
    Precision(buffer_dtype="bfloat16"),
)


@dataclass(frozen=True)
class Microbatch:
    """One forward/backward; ``skip``: module paths whose forward it does not
    run (their parent's forward passes over them)."""

    skip: tuple[str, ...] = ()


@dataclass(frozen=True)
class ScheduleStep:
    """One optimizer step: ``frozen`` FQNs have requires_grad=False during it
    (the rest True); its microbatches run one after the other, gradient sync
    disabled on all but the last unless ``sync_every``."""

    frozen: tuple[str, ...] = ()
    microbatches: tuple[Microbatch, ...] = (Microbatch(),)
    sync_every: bool = False


@dataclass(frozen=True)
class Schedule:
    """Optimizer steps under mixed precision and gradient accumulation; the
    loss of a microbatch is (model(x) ** 2).sum() on data that differs by rank
    and microbatch. ``optimizer``: SGD (momentum 0.9), Adam or AdamW.
    ``sharding_strategy`` (FSDP1): the root's ShardingStrategy, which every
    unit without one of its own (a CustomWrap kwarg) inherits."""

    steps: tuple[ScheduleStep, ...] = (ScheduleStep(),)
    optimizer: str = "SGD"
    lr: float = 0.05
    precision: Precision | None = None
    first: int = -1  # the very first microbatch calls spec.methods[first] (registered, FSDP2); -1: forward
    sharding_strategy: str = "FULL_SHARD"


def validate_schedule_plan(s: "Schedule", api: str) -> None:
    """What a Schedule must be whatever its model (a CaseSpec's or a
    ModelCase's): the FQNs and paths it names are checked against the model."""
    if s.optimizer not in SCHEDULE_OPTIMIZERS or not s.lr > 0 or not s.steps:
        raise SpecError(f"schedule: optimizer one of {SCHEDULE_OPTIMIZERS}, lr > 0, at least one step")
    for st in s.steps:
        if not st.microbatches:
            raise SpecError("schedule: a step needs at least one microbatch")
    if s.sharding_strategy not in FSDP1_STRATEGIES or (api != "fsdp1" and s.sharding_strategy != "FULL_SHARD"):
        raise SpecError(f"schedule: sharding_strategy one of {FSDP1_STRATEGIES} (FSDP1; FSDP2 keeps FULL_SHARD)")
    pr = s.precision
    if pr is not None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype"):
            if getattr(pr, name) not in (None, *DTYPES):
                raise SpecError(f"precision: {name} must be None or one of {DTYPES}")
        if api == "fsdp2" and (pr.buffer_dtype or pr.keep_low_precision_grads or not pr.cast_root_forward_inputs):
            raise SpecError("precision: buffer_dtype, keep_low_precision_grads, cast_root_forward_inputs are FSDP1's")
        if api == "fsdp1" and pr.output_dtype:
            raise SpecError("precision: output_dtype is FSDP2's")


def validate_schedule(spec: "CaseSpec") -> None:
    s = spec.schedule
    if s is None:
        return
    validate_schedule_plan(s, spec.plan.api)
    paths = {p for p, _ in walk(spec.tree)}
    fqns = {f for f, _ in ModelGraph(spec).named_parameters(remove_duplicate=False)}
    for st in s.steps:
        if not set(st.frozen) <= fqns:
            raise SpecError(f"schedule: frozen names unknown parameters {sorted(set(st.frozen) - fqns)}")
        for mb in st.microbatches:
            if "" in mb.skip or not set(mb.skip) <= paths:
                raise SpecError(f"schedule: a microbatch skips an unknown or the root module: {mb.skip!r}")
    if not -1 <= s.first < len(spec.methods):
        raise SpecError(f"schedule: first={s.first} names no method")


# ---- communication (COMM-*) -------------------------------------------------

FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
FSDP1_BACKWARD_PREFETCH = (None, "BACKWARD_PRE", "BACKWARD_POST")


@dataclass(frozen=True)
class CommPlan:
    """``iterations`` forward/backward passes of loss = (model(x) ** 2).sum()
    (no optimizer: what is communicated does not depend on the values),
    each observed collective by collective.

    ``world``: 0, the engine's whole world; 1, each rank alone (a process
    group or mesh of its own rank). ``param_dtype`` / ``reduce_dtype``:
    the API's mixed precision (None: unset). FSDP2 (the plan's groups carry
    reshard_after_forward): ``forward_prefetch`` / ``backward_prefetch``,
    (module, modules) for set_modules_to_forward_prefetch /
    set_modules_to_backward_prefetch, each module a group's. FSDP1:
    ``sharding_strategy``, ``backward_prefetch`` (a BackwardPrefetch
    member's name or None), ``forward_prefetch``, ``limit_all_gathers``;
    ``fsdp1_no_sync``, per iteration, whether it runs inside the root's
    no_sync() (empty: none does), its gradients then kept for the next.
    ``refreeze``: parameters whose requires_grad flips after the first
    iteration, for all the later ones (progressive freezing, or unfreezing:
    FSDP2; FSDP1 with use_orig_params=True, whose flat parameters follow
    their original parameters' requires_grad at the root's pre-forward)."""

    iterations: int = 1
    world: int = 0
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    forward_prefetch: tuple[tuple[str, tuple[str, ...]], ...] = ()
    backward_prefetch: tuple[tuple[str, tuple[str, ...]], ...] = ()
    sharding_strategy: str = "FULL_SHARD"
    fsdp1_backward_prefetch: str | None = "BACKWARD_PRE"
    fsdp1_forward_prefetch: bool = False
    limit_all_gathers: bool = True
    fsdp1_no_sync: tuple[bool, ...] = ()
    refreeze: tuple[str, ...] = ()


def flip_requires_grad(spec: "CaseSpec", fqns) -> "CaseSpec":
    """The spec with the parameters ``fqns`` (their spec FQNs) frozen where
    they were trainable and trainable where they were frozen."""
    fqns = set(fqns)

    def flip(m: ModuleSpec, path: str) -> ModuleSpec:
        params = tuple(dataclasses.replace(p, requires_grad=not p.requires_grad) if join(path, p.name) in fqns else p
                       for p in m.params)
        return dataclasses.replace(m, params=params, children=tuple(flip(c, join(path, c.name)) for c in m.children))

    return dataclasses.replace(spec, tree=flip(spec.tree, ""))


def validate_comm(spec: "CaseSpec") -> None:
    c = spec.comm
    if c is None:
        return
    if not 1 <= c.iterations <= 4 or c.world not in (0, 1):
        raise SpecError("comm: iterations 1..4, world 0 (all ranks) or 1")
    for name in ("param_dtype", "reduce_dtype"):
        if getattr(c, name) not in (None, *DTYPES):
            raise SpecError(f"comm: {name} must be None or one of {DTYPES}")
    api = spec.plan.api
    group_modules = {m for g in spec.plan.groups for m in g.modules} | {""}
    for which in (c.forward_prefetch, c.backward_prefetch):
        for module, targets in which:
            if api != "fsdp2" or module not in group_modules or not set(targets) <= group_modules:
                raise SpecError("comm: explicit prefetching is FSDP2's, between modules the plan gives fully_shard")
    if len({m for m, _ in c.forward_prefetch}) != len(c.forward_prefetch) or len({m for m, _ in c.backward_prefetch}) != len(c.backward_prefetch):
        raise SpecError("comm: one prefetch list per module")
    if c.sharding_strategy not in FSDP1_STRATEGIES or c.fsdp1_backward_prefetch not in FSDP1_BACKWARD_PREFETCH:
        raise SpecError(f"comm: sharding_strategy one of {FSDP1_STRATEGIES}, backward prefetch one of {FSDP1_BACKWARD_PREFETCH}")
    if c.fsdp1_no_sync and (api != "fsdp1" or len(c.fsdp1_no_sync) != c.iterations
                            or not all(isinstance(b, bool) for b in c.fsdp1_no_sync)):
        raise SpecError("comm: fsdp1_no_sync is FSDP1's, one bool per iteration")
    if c.refreeze:
        if c.iterations < 2 or len(set(c.refreeze)) != len(c.refreeze) or not set(c.refreeze) <= set(param_fqns(spec.tree)):
            raise SpecError("comm: refreeze names distinct parameters of the tree, with at least two iterations")
        if api == "fsdp1" and (not spec.plan.use_orig_params or (c.fsdp1_no_sync and c.fsdp1_no_sync[0])):
            raise SpecError("comm: FSDP1 flips requires_grad with use_orig_params=True only, after a synced first iteration")


# ---- FSDP2's schedule APIs, per microbatch (MB-*) ------------------------------


@dataclass(frozen=True)
class MicrobatchStep:
    """One microbatch of one optimizer step (FSDP2): the settings made on the
    root (recurse) before it, set_requires_gradient_sync(``sync``),
    set_requires_all_reduce(``all_reduce``),
    set_reshard_after_backward(``reshard_after_backward``),
    set_is_last_backward(``is_last_backward``) and, unless None,
    set_reshard_after_forward(``reshard_after_forward``); then ``unshard``
    (a module given to fully_shard, None: none) has its unshard() called
    (``unshard_async``: unshard(async_op=True) and wait() on the handle) and
    with ``reshard`` its reshard(); set_separate_reduce_scatter_group
    (``separate_reduce_scatter``, on the root, recurse) unless None; then
    forward and backward, in which
    rank 0's model passes over the modules ``unused_on_rank0`` (their parent
    runs its other children; the other ranks run them all: conditional
    control flow, as a mixture of experts routes)."""

    sync: bool = True
    all_reduce: bool = True
    reshard_after_backward: bool = True
    is_last_backward: bool = True
    reshard_after_forward: bool | None = None
    unshard: str | None = None
    unshard_async: bool = False
    reshard: bool = False
    unused_on_rank0: tuple[str, ...] = ()
    separate_reduce_scatter: bool | None = None


ABORT_PHASES = ("forward", "backward")


@dataclass(frozen=True)
class MicrobatchAbort:
    """An iteration aborted by an exception, then recovered (FSDP2's
    reset_iter_state): after microbatches 0..``before``-1 ran as drawn, one
    more forward with microbatch ``before``'s settings and data raises (``phase``
    "forward": when the module at ``at`` returns, before FSDP's own
    post-forward; "backward": the module's output carries a node whose
    backward raises, so the modules after it have run their backward);
    every rank catches it, calls reset_iter_state() on the root, sets every
    gradient to None and restarts the microbatch sequence from 0 (the
    docstring's recovery: the failed iteration's gradients are lost, no_sync
    accumulation included, and the sequence is to be restarted)."""

    before: int = 0
    at: str = ""
    phase: str = "forward"


@dataclass(frozen=True)
class MicrobatchPlan:
    """Microbatches accumulating one step's gradients (data differs by rank and
    microbatch; loss (model(x) ** 2).sum()). ``shard_dim1``: groups whose
    fully_shard gets shard_placement_fn = Shard(1) for matrices;
    ``cpu_offload``: every group gets CPUOffloadPolicy(); ``abort``: an
    aborted iteration and its recovery before the sequence (MicrobatchAbort);
    ``no_unshard_in_backward``: groups (a module given to fully_shard) told
    set_unshard_in_backward(False), each one whose parameters backward does
    not read (no Linear's or LayerNorm's: an Embedding's weight, a module's
    own parameters through the generic forward's tanh, whose backward reads
    its output); ``all_reduce_hook``: (group, scale) pairs, each group (a
    module given to fully_shard) given set_all_reduce_hook with a hook that
    multiplies the reduce-scatter output in place by its scale (a power of
    two, different for each group); ``custom_comms``: groups given
    set_custom_all_gather and set_custom_reduce_scatter with the suite's
    own comms (the same collectives, issued through them);
    ``reduce_scatter_unused_params``: the root's
    set_reduce_scatter_unused_params(True) (recurse), which a microbatch
    whose modules are unused on rank 0 needs (without it the ranks'
    reduce-scatters differ); ``mesh``: (replicate, shard), every group
    given a 2-D DeviceMesh of that shape (HSDP: set_requires_all_reduce
    then governs the replicate all-reduce), None: a 1-D mesh over every
    rank; ``grad_hooks``: every trainable sharded parameter given
    register_post_accumulate_grad_hook (an optimizer step in backward's
    hook), which records its calls and the gradient it sees."""

    microbatches: tuple[MicrobatchStep, ...] = (MicrobatchStep(),)
    shard_dim1: tuple[str, ...] = ()
    cpu_offload: bool = False
    abort: MicrobatchAbort | None = None
    no_unshard_in_backward: tuple[str, ...] = ()
    all_reduce_hook: tuple[tuple[str, float], ...] = ()
    custom_comms: tuple[str, ...] = ()
    reduce_scatter_unused_params: bool = False
    mesh: tuple[int, int] | None = None
    grad_hooks: bool = False


def validate_microbatch(spec: "CaseSpec") -> None:
    mb = spec.microbatch
    if mb is None:
        return
    if spec.plan.api != "fsdp2" or not mb.microbatches:
        raise SpecError("microbatch: FSDP2 only, at least one microbatch")
    last = mb.microbatches[-1]
    if not (last.sync and last.reshard_after_backward and last.is_last_backward):
        raise SpecError("microbatch: the last microbatch syncs gradients, reshards after backward and is the last backward")
    group_modules = {m for g in spec.plan.groups for m in g.modules} | {""}
    for step in mb.microbatches:
        if step.unshard is not None and step.unshard not in group_modules:
            raise SpecError(f"microbatch: unshard names {step.unshard!r}, not a module given to fully_shard")
        if step.reshard and step.unshard is None:
            raise SpecError("microbatch: reshard follows an explicit unshard")
    if mb.microbatches[0].unshard is not None:
        raise SpecError("microbatch: an explicit unshard comes after the first forward (lazy init runs in it)")
    if not isinstance(mb.grad_hooks, bool):
        raise SpecError("microbatch: grad_hooks is a bool")
    if not set(mb.shard_dim1) <= group_modules:
        raise SpecError("microbatch: shard_dim1 names modules given to fully_shard")
    for path in mb.no_unshard_in_backward:
        if path not in group_modules:
            raise SpecError(f"microbatch: no_unshard_in_backward names {path!r}, not a module given to fully_shard")
        if not backward_free_group(spec, path):
            raise SpecError(f"microbatch: no_unshard_in_backward: {path or '<root>'}'s group holds a parameter backward reads (a Linear's or LayerNorm's)")
    firsts = {g.modules[0] for g in spec.plan.groups} | {""}  # what names a group: the first module given to fully_shard
    hooked = [path for path, _ in mb.all_reduce_hook]
    scales = [scale for _, scale in mb.all_reduce_hook]
    for path, scale in mb.all_reduce_hook:
        if path not in firsts:
            raise SpecError(f"microbatch: all_reduce_hook names {path!r}, not the first module given to a fully_shard call")
        if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0 and math.frexp(scale)[0] == 0.5 and scale != 1.0):
            raise SpecError(f"microbatch: all_reduce_hook scale {scale!r} is not a power of two other than 1 (exact in float32)")
    if len(set(hooked)) != len(hooked) or len(set(scales)) != len(scales):
        raise SpecError("microbatch: all_reduce_hook names each group once, each with a scale of its own")
    if mb.mesh is not None:
        if tuple(mb.mesh) not in HSDP_MESHES:
            raise SpecError(f"microbatch: mesh {mb.mesh!r} is not one of {HSDP_MESHES}")
        if not mb.microbatches[-1].all_reduce:
            raise SpecError("microbatch: on a 2-D mesh the last microbatch all-reduces (set_requires_all_reduce(True))")
        for g in spec.plan.groups:
            r = g.reshard_after_forward
            if isinstance(r, int) and not isinstance(r, bool) and mb.mesh[1] % r:
                raise SpecError(f"microbatch: reshard_after_forward={r} is no factor of the shard dim's {mb.mesh[1]} ranks (fully_shard raises)")
    if hooked and mb.mesh is None and not all(s.all_reduce for s in mb.microbatches):
        # on a 1-D mesh the hook is the user's all-reduce: whether
        # set_requires_all_reduce(False) skips it the docstrings leave open
        raise SpecError("microbatch: all_reduce_hook with set_requires_all_reduce(False) in a microbatch (the docstrings leave the hook's call open)")
    if not set(mb.custom_comms) <= firsts or len(set(mb.custom_comms)) != len(mb.custom_comms):
        raise SpecError("microbatch: custom_comms names the first modules given to fully_shard calls, each once")
    paths = {p for p, _ in walk(spec.tree)}
    for step in mb.microbatches:
        for path in step.unused_on_rank0:
            if path not in paths or path == "":
                raise SpecError(f"microbatch: unused_on_rank0 names {path!r}, not a module of the tree below the root")
            if any(m == path or m.startswith(path + ".") for m in group_modules if m):
                # its forward would skip a group's all-gather on one rank only
                raise SpecError(f"microbatch: unused_on_rank0: {path} is or holds a module given to fully_shard")
    if any(s.unused_on_rank0 for s in mb.microbatches):
        if not mb.reduce_scatter_unused_params:
            raise SpecError("microbatch: modules unused on rank 0 need reduce_scatter_unused_params (the ranks' reduce-scatters differ without it)")
        if mb.abort is not None:
            raise SpecError("microbatch: modules unused on rank 0 with an aborted iteration (not drawn together)")
    a = mb.abort
    if a is not None:
        if not 0 <= a.before < len(mb.microbatches) or a.phase not in ABORT_PHASES:
            raise SpecError(f"microbatch: abort {a!r}: before indexes a microbatch, phase one of {ABORT_PHASES}")
        if a.at not in {p for p, _ in walk(spec.tree)}:
            raise SpecError(f"microbatch: abort at {a.at!r}, not a module of the tree")
        if module_at(spec.tree, a.at).cls in CONTAINER_BASES:
            # the generic forward runs a torch container's children itself: no hook of its fires
            raise SpecError(f"microbatch: abort at {a.at!r}, a torch container whose forward the case never calls")
        if any(s.reshard_after_forward is not None for s in mb.microbatches[: a.before + 1]):
            # reset_iter_state restores no setting: the restarted sequence
            # would start from the one made before the abort (the aborted
            # microbatch makes its own too)
            raise SpecError("microbatch: a microbatch up to the aborted one sets reshard_after_forward")


def backward_free_group(spec: "CaseSpec", path: str) -> bool:
    """Whether the group given ``path`` (a module given to fully_shard)
    holds no parameter the backward reads: none of a Linear or LayerNorm
    (their input's gradient reads the weight); the rest are an Embedding's
    weight (its gradient is a scatter of the output's) or a module's own,
    which the generic forward reads through tanh, whose backward reads the
    output. The group's modules are ``path``'s subtree less those of the
    other groups below it (a list group: each of its modules')."""
    mine = next((g.modules for g in spec.plan.groups if path in g.modules), (path,))
    others = {m for g in spec.plan.groups for m in g.modules if path not in g.modules} | ({""} - set(mine))
    stack = [(module_at(spec.tree, p), p) for p in mine]
    while stack:
        m, p = stack.pop()
        if m.params and m.cls in ("Linear", "LayerNorm"):
            return False
        stack += [(c, join(p, c.name)) for c in m.children if join(p, c.name) not in others]
    return True


# ---- tree queries (pure) ---------------------------------------------------


def module_at(tree: ModuleSpec, path: str) -> ModuleSpec:
    node = tree
    if path == "":
        return node
    for part in path.split("."):
        for child in node.children:
            if child.name == part:
                node = child
                break
        else:
            raise SpecError(f"no module at path {path!r}")
    return node


def effective_calls(spec: "CaseSpec") -> tuple["MethodCall", ...]:
    """The calls a case makes: its own, or one root forward."""
    return spec.calls or (MethodCall(-1),)


def param_fqns(tree: ModuleSpec) -> list[str]:
    return [join(path, p.name) for path, m in walk(tree) for p in m.params]


# ---- validation ------------------------------------------------------------

_IDENT_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def _check_name(name: str, what: str) -> None:
    if not name or not set(name) <= _IDENT_OK or name[0].isdigit() and what != "child":
        raise SpecError(f"invalid {what} name {name!r}")


def validate(spec: CaseSpec) -> None:
    """Raise SpecError unless ``spec`` describes a buildable case."""
    if not isinstance(spec.tree, ModuleSpec):
        raise SpecError("CaseSpec.tree must be a ModuleSpec")
    class_names = {c.name for c in spec.classes}
    if len(class_names) != len(spec.classes):
        raise SpecError("duplicate class names")
    for c in spec.classes:
        _check_name(c.name, "class")
        if c.name in CONTAINER_BASES or c.name in LEAF_TYPES:
            raise SpecError(f"class {c.name!r} shadows a torch class")
        if c.base not in CONTAINER_BASES and c.base not in class_names:
            raise SpecError(f"class {c.name!r} has unknown base {c.base!r}")
    # bases must not form a cycle
    bases = {c.name: c.base for c in spec.classes}
    for c in spec.classes:
        seen, b = {c.name}, c.base
        while b in bases:
            if b in seen:
                raise SpecError(f"class {c.name!r} has a cyclic base chain")
            seen.add(b)
            b = bases[b]
    known = class_names | set(CONTAINER_BASES) | set(LEAF_TYPES)
    paths = set()
    for path, m in walk(spec.tree):
        if m.cls not in known:
            raise SpecError(f"module {path or '<root>'} has unknown class {m.cls!r}")
        paths.add(path)
        names = [p.name for p in m.params] + [b.name for b in m.buffers] + [c.name for c in m.children]
        if len(set(names)) != len(names):
            raise SpecError(f"module {path or '<root>'} has duplicate attribute names")
        for p in m.params:
            _check_name(p.name, "parameter")
            if not p.shape or any(not isinstance(d, int) or d <= 0 for d in p.shape):
                raise SpecError(f"parameter {join(path, p.name)} has invalid shape {p.shape!r}")
        for c in m.children:
            _check_name(c.name, "child")
        _check_leaf(path, m)
        if container_kind(spec, m.cls) in ("ModuleList", "Sequential") and m.params:
            raise SpecError(f"container {path or '<root>'} ({m.cls}) cannot hold parameters")
        if container_kind(spec, m.cls) == "ModuleList":
            if [c.name for c in m.children] != [str(i) for i in range(len(m.children))]:
                raise SpecError(f"ModuleList {path or '<root>'} children must be named 0..n-1")
    if spec.tree.name != "":
        raise SpecError("the root module's name must be ''")
    fqns = set(param_fqns(spec.tree))
    added: set[tuple[str, str]] = set()  # (module path, attribute) a shared module or tie adds
    for s in spec.shared:
        if s.parent not in paths or s.source not in paths:
            raise SpecError(f"shared module {s!r} names an unknown path")
        if s.source == "" or s.source == s.parent or s.parent.startswith(s.source + "."):
            raise SpecError(f"shared module {s!r} would make a cycle")
        _check_name(s.name, "child")
        parent = module_at(spec.tree, s.parent)
        if any(x.name == s.name for x in parent.params + parent.buffers + parent.children):
            raise SpecError(f"shared module {s!r} collides with an attribute of {s.parent or '<root>'}")
        if container_kind(spec, parent.cls) in ("ModuleList", "Sequential"):
            raise SpecError(f"shared module {s!r}: parent must not be a ModuleList/Sequential")
        if parent.cls in LEAF_TYPES:
            raise SpecError(f"shared module {s!r}: a torch leaf module cannot have children")
        if (s.parent, s.name) in added:
            raise SpecError(f"shared module {s!r} reuses a name another shared module adds")
        added.add((s.parent, s.name))
    _check_shared_acyclic(spec)
    tie_targets = {join(t.module, t.name) for t in spec.ties}
    for t in spec.ties:
        if t.module not in paths or t.source not in fqns:
            raise SpecError(f"tie {t!r} names an unknown module or parameter")
        m = module_at(spec.tree, t.module)
        if m.cls in LEAF_TYPES and t.name not in {p.name for p in m.params}:
            raise SpecError(f"tie {t!r}: a torch leaf module only ties its own parameters")
        if container_kind(spec, m.cls) in ("ModuleList", "Sequential"):
            raise SpecError(f"tie {t!r}: containers cannot hold parameters")
        if join(t.module, t.name) == t.source:
            raise SpecError(f"tie {t!r} ties a parameter to itself")
        if any(x.name == t.name for x in m.buffers + m.children):
            raise SpecError(f"tie {t!r} collides with an attribute of {t.module or '<root>'}")
        if (t.module, t.name) in added:
            raise SpecError(f"tie {t!r} reuses a name a shared module or another tie adds")
        added.add((t.module, t.name))
        # build() ties to the Parameter the tree put at t.source, so a source
        # that another tie replaces would not mean what the spec says.
        if t.source in tie_targets:
            raise SpecError(f"tie {t!r}: its source is itself replaced by a tie (a chain)")
        own = {p.name: p for p in m.params}
        if t.name in own and own[t.name].shape != _param_spec(spec.tree, t.source).shape:
            raise SpecError(f"tie {t!r} joins parameters of different shapes")
    _validate_plan(spec, paths, fqns)
    _validate_methods(spec, paths)
    validate_schedule(spec)
    validate_clip(spec)
    validate_comm(spec)
    validate_microbatch(spec)
    validate_activation_checkpoint(spec)
    validate_init(spec)
    validate_hsdp(spec)
    validate_tp(spec)


def _check_shared_acyclic(spec: CaseSpec) -> None:
    """Shared modules together must not put a module below itself (each alone
    is checked against the tree; two can still make a cycle)."""
    if len(spec.shared) < 2:
        return
    below: dict[str, list[str]] = {}
    for path, m in walk(spec.tree):
        below[path] = [join(path, c.name) for c in m.children]
    for s in spec.shared:
        below[s.parent].append(s.source)
    for s in spec.shared:
        stack, seen = [s.source], set()
        while stack:
            p = stack.pop()
            if p == s.parent:
                raise SpecError(f"shared module {s!r} makes a cycle with the other shared modules")
            if p not in seen:
                seen.add(p)
                stack.extend(below[p])


def _param_spec(tree: ModuleSpec, fqn: str) -> ParamSpec:
    path, _, name = fqn.rpartition(".")
    for p in module_at(tree, path).params:
        if p.name == name:
            return p
    raise SpecError(f"no parameter {fqn!r}")


def _check_leaf(path: str, m: ModuleSpec) -> None:
    if m.cls not in LEAF_TYPES:
        return
    where = path or "<root>"
    if m.children or m.buffers:
        raise SpecError(f"{m.cls} at {where} cannot have children or buffers")
    ps = {p.name: p.shape for p in m.params}
    ok = False
    if m.cls == "Linear":
        w = ps.get("weight")
        ok = w is not None and len(w) == 2 and set(ps) <= {"weight", "bias"} and ps.get("bias", (w[0],)) == (w[0],)
    elif m.cls == "Embedding":
        ok = set(ps) == {"weight"} and len(ps["weight"]) == 2
    elif m.cls == "LayerNorm":
        w = ps.get("weight")
        ok = set(ps) == {"weight", "bias"} and len(w) == 1 and ps["bias"] == w
    if not ok or [p.name for p in m.params] != sorted(ps, key=["weight", "bias"].index):
        raise SpecError(f"{m.cls} at {where} has parameters {ps!r} that torch's {m.cls} does not")


def container_kind(spec: CaseSpec, cls: str) -> str:
    """The torch base a class ends at: Module / Sequential / ModuleList /
    ModuleDict, or the leaf type's own name."""
    bases = {c.name: c.base for c in spec.classes}
    while cls in bases:
        cls = bases[cls]
    return cls


def _validate_plan(spec: CaseSpec, paths: set[str], fqns: set[str]) -> None:
    plan = spec.plan
    if plan.api not in ("fsdp1", "fsdp2"):
        raise SpecError(f"unknown API {plan.api!r}")
    known_classes = {c.name for c in spec.classes} | set(CONTAINER_BASES) | set(LEAF_TYPES)
    pol = plan.policy
    if pol is not None and not isinstance(pol, POLICY_TYPES):
        raise SpecError(f"unknown policy {pol!r}")
    if isinstance(pol, (ModuleWrap, TransformerWrap)):
        for c in pol.classes:
            if c not in known_classes:
                raise SpecError(f"policy names unknown class {c!r}")
    if isinstance(pol, (CustomWrap, LambdaWrap)):
        for t in pol.targets:
            if t not in paths:
                raise SpecError(f"policy names unknown module path {t!r}")
    if isinstance(pol, CustomWrap):
        for t, kw in pol.kwargs:
            if t not in pol.targets:
                raise SpecError(f"CustomWrap kwargs for {t!r}, which is not a target")
            for k, v in kw:
                if k not in CUSTOM_KWARGS or v not in CUSTOM_KWARGS[k]:
                    raise SpecError(f"CustomWrap kwarg {k}={v!r} is not supported")
    if isinstance(pol, SizeBasedWrap) and pol.min_num_params < 0:
        raise SpecError("min_num_params must be >= 0")
    for p in plan.ignored_modules:
        if p not in paths or p == "":
            raise SpecError(f"ignored module {p!r} is not a non-root module path")
    for f in plan.ignored_params:
        if f not in fqns:
            raise SpecError(f"ignored parameter {f!r} is not a parameter FQN")
    if plan.groups and plan.api != "fsdp2":
        raise SpecError("shard groups are for api='fsdp2'")
    seen: set[str] = set()
    for g in plan.groups:
        if not g.modules or any(p not in paths for p in g.modules):
            raise SpecError(f"shard group {g!r} names no module or an unknown path")
        if seen & set(g.modules) or len(set(g.modules)) != len(g.modules):
            raise SpecError(f"shard group {g!r}: a module is in two groups")
        if len(g.modules) > 1 and "" in g.modules:
            raise SpecError(f"shard group {g!r}: the root is sharded on its own")
        raf = g.reshard_after_forward
        if not (raf is None or isinstance(raf, bool) or (isinstance(raf, int) and raf >= 2)):
            raise SpecError(f"shard group {g!r}: reshard_after_forward must be None, True, False or an int >= 2")
        seen.update(g.modules)


def _resolve_path(spec: CaseSpec, path: str) -> tuple[ModuleSpec, str] | None:
    """(module, its spec path) at attribute path ``path`` of the built model,
    following shared-module registrations; None if there is none."""
    node, where = spec.tree, ""
    for part in path.split(".") if path else ():
        child = next((c for c in node.children if c.name == part), None)
        if child is not None:
            node, where = child, join(where, part)
            continue
        s = next((s for s in spec.shared if s.parent == where and s.name == part), None)
        if s is None:
            return None
        node, where = module_at(spec.tree, s.source), s.source
    return node, where


def _attr_param(spec: CaseSpec, module_path: str, rel: str) -> bool:
    """Whether attribute path ``rel`` from the module at ``module_path`` is a
    parameter of the built model (ties included)."""
    owner, _, name = join(module_path, rel).rpartition(".")
    got = _resolve_path(spec, owner)
    if got is None:
        return False
    node, where = got
    return any(p.name == name for p in node.params) or any(
        t.module == where and t.name == name for t in spec.ties
    )


def _validate_methods(spec: CaseSpec, paths: set[str]) -> None:
    names: set[tuple[str, str]] = set()
    for m in spec.methods:
        if m.module not in paths:
            raise SpecError(f"method {m.name!r} on unknown module {m.module!r}")
        node = module_at(spec.tree, m.module)
        if node.cls in LEAF_TYPES or node.cls in CONTAINER_BASES:
            raise SpecError(f"method {m.name!r}: {m.module or '<root>'} is a torch class; methods go on drawn classes")
        if m.name not in METHOD_NAMES:
            raise SpecError(f"method name {m.name!r} is not one of {METHOD_NAMES}")
        if (m.module, m.name) in names:
            raise SpecError(f"method {m.name!r} defined twice on {m.module or '<root>'}")
        names.add((m.module, m.name))
        taken = {x.name for x in node.params + node.buffers + node.children}
        taken |= {s.name for s in spec.shared if s.parent == m.module} | {t.name for t in spec.ties if t.module == m.module}
        if m.name in taken:
            raise SpecError(f"method {m.name!r} collides with an attribute of {m.module or '<root>'}")
        for st in m.steps:
            if st.op not in METHOD_OPS:
                raise SpecError(f"method {m.name!r}: unknown step {st.op!r}")
            if st.op == "param" and not _attr_param(spec, m.module, st.target):
                raise SpecError(f"method {m.name!r} reads {st.target!r}, not a parameter of {m.module or '<root>'}")
            if st.op == "child" and (not st.target or _resolve_path(spec, join(m.module, st.target)) is None):
                raise SpecError(f"method {m.name!r} calls {st.target!r}, not a submodule of {m.module or '<root>'}")
            if st.op in ("forward", "call") and st.target:
                raise SpecError(f"method {m.name!r}: step {st.op!r} takes no target")
    for c in spec.calls:
        if not -1 <= c.method < len(spec.methods) or c.times < 1:
            raise SpecError(f"call {c!r} names no method or a non-positive count")
    if spec.ckpt is not None:
        _validate_ckpt(spec, set(param_fqns(spec.tree)))
    t = spec.train
    if t is not None and (t.optimizer not in OPTIMIZERS or t.steps < 1 or not t.lr > 0):
        raise SpecError(f"train plan {t!r}: optimizer one of {OPTIMIZERS}, steps >= 1, lr > 0")
    if t is not None and (t.force_sum or t.divide_factor is not None):
        if spec.plan.api != "fsdp2":
            raise SpecError(f"train plan {t!r}: force_sum and divide_factor are FSDP2 settings")
        if t.divide_factor is not None and not t.divide_factor > 0:
            raise SpecError(f"train plan {t!r}: divide_factor must be > 0")


def validate_ckpt_plan(c: "CheckpointPlan", plan: "WrapPlan") -> None:
    """What a CheckpointPlan must be whatever its model (the FQNs it names
    and its load plan are checked against the model)."""
    if not all(isinstance(w, int) and 1 <= w <= MAX_WORLD for w in (c.save_world, c.load_world)):
        raise SpecError(f"checkpoint world sizes must be 1..{MAX_WORLD}")
    if c.optimizer not in CKPT_OPTIMIZERS or c.steps < 1 or c.steps_after < 0:
        raise SpecError(f"checkpoint plan {c!r}: optimizer one of {CKPT_OPTIMIZERS}, steps >= 1, steps_after >= 0")
    if c.full_sd not in FULL_SD_WAYS or c.load_path not in LOAD_PATHS:
        raise SpecError(f"checkpoint plan {c!r}: full_sd one of {FULL_SD_WAYS}, load_path one of {LOAD_PATHS}")
    if c.precision is not None and c.precision not in CKPT_PRECISIONS:
        raise SpecError(f"checkpoint plan: precision must be one of CKPT_PRECISIONS, not {c.precision!r}")
    if c.precision is not None and c.precision.buffer_dtype and plan.api != "fsdp1":
        raise SpecError("checkpoint plan: buffer_dtype is FSDP1's (MixedPrecision)")
    if c.param_groups not in (1, 2):
        raise SpecError(f"checkpoint plan: param_groups must be 1 or 2, not {c.param_groups!r}")
    if c.param_groups == 2 and not all(p.api == "fsdp2" or p.use_orig_params for p in (plan, c.load_plan or plan)):
        raise SpecError("checkpoint plan: param_groups=2 needs per-parameter optimizers at the save and the load "
                        "(FSDP2, or FSDP1 with use_orig_params=True)")


def _validate_ckpt(spec: CaseSpec, fqns: set[str]) -> None:
    c = spec.ckpt
    validate_ckpt_plan(c, spec.plan)
    for f in c.refreeze + (c.load_frozen or ()):
        if f not in fqns:
            raise SpecError(f"checkpoint plan names unknown parameter {f!r}")
    if c.load_plan is not None:
        if c.load_plan.ignored_modules or c.load_plan.ignored_params:
            raise SpecError("a checkpoint's load plan ignores nothing")
        # the load plan must fit the same tree
        dataclasses.replace(spec, plan=c.load_plan, ckpt=None)


# ---- JSON (de)serialisation -------------------------------------------------

_TYPES = {
    t.__name__: t
    for t in (
        ParamSpec, BufferSpec, ModuleSpec, ClassSpec, SharedModule, TiedParam,
        WrapPlan, CaseSpec, *POLICY_TYPES, ShardGroup, MethodStep, ForwardMethod, MethodCall, TrainPlan,
        CheckpointPlan,
        Precision, Microbatch, ScheduleStep, Schedule, ClipPlan, CommPlan, MicrobatchStep, MicrobatchAbort, MicrobatchPlan, ActivationCheckpointPlan,
        InitPlan,
        HsdpPlan,
        TpPlan,
    )
}


def encode(obj: Any) -> Any:
    """A spec dataclass (nested ones too) as JSON-able data, each object with its "type"."""
    if dataclasses.is_dataclass(obj):
        d = {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        d["type"] = type(obj).__name__
        return d
    if isinstance(obj, tuple):
        return [encode(x) for x in obj]
    return obj


def _tuplify(x: Any, types: dict) -> Any:
    if isinstance(x, list):
        return tuple(_tuplify(v, types) for v in x)
    if isinstance(x, dict):
        return _decode(None, x, types)
    return x


def decode(expected: type | None, data: Any, *, types: tuple[type, ...] = ()) -> Any:
    """The inverse of encode: ``data`` as the dataclass its "type" names (a
    SpecError unless it is ``expected``); ``types``: further dataclasses the
    data may name (ModelCase)."""
    return _decode(expected, data, {**_TYPES, **{t.__name__: t for t in types}})


def _decode(expected: type | None, data: Any, types: dict) -> Any:
    if not isinstance(data, dict) or "type" not in data:
        raise SpecError(f"expected an object with a 'type', got {type(data).__name__}")
    t = types.get(data["type"])
    if t is None or (expected is not None and t is not expected):
        raise SpecError(f"unexpected type {data['type']!r}")
    names = {f.name for f in dataclasses.fields(t)}
    extra = set(data) - names - {"type"}
    if extra:
        raise SpecError(f"{t.__name__} has unknown fields {sorted(extra)}")
    return t(**{k: _tuplify(v, types) for k, v in data.items() if k != "type"})
