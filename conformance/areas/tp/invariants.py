"""TP-FULL-TENSOR, TP-LAYOUT, TP-PARITY, TP-STATE-DICT, TP-MP-DTYPE, TP-CLIP:
tensor parallelism (parallelize_module over a (dp, tp) mesh's "tp" dim) composed
with FSDP2 (fully_shard(mesh=mesh["dp"])), against the oracle
(conformance.areas.tp.oracle), single-process training and flat FSDP."""

from __future__ import annotations

import re

from conformance.areas.common.catalog import VALUES_UNCHECKED, Catalog, NotChecked
from conformance.areas.common.fsdp2_oracle import container_given_to_fully_shard, fsdp2_case_tags
from conformance.areas.common.violations import backend_tag, tie_within_one_module, violation
from conformance.areas.tp.observation import TpObservation
from conformance.areas.tp.oracle import TpPrediction
from conformance.case.spec import CaseSpec
from conformance.case.target import graph_of
from conformance.case.violation import Violation

catalog = Catalog()

DOC_TP = ("torch.distributed.tensor.parallel docstrings (parallelize_module; ColwiseParallel: weight and bias sharded on dim 0, an "
          "Embedding's weight on dim 1; RowwiseParallel: weight on dim 1, an Embedding's on dim 0; SequenceParallel: parameters "
          "replicated, input sharded on the sequence dim); upstream test/distributed/tensor/parallel/test_tp_style.py, "
          "test_parallelize_api.py")
DOC_FULLY_SHARD = ("fully_shard docstring (mesh: the data parallel mesh defines the sharding; sharded parameters are DTensors "
                   "sharded on dim-0); upstream test_fully_shard_training.py TestFullyShard2DTraining (2-D training equals "
                   "single-process), test_fully_shard_init.py (2-D: _StridedShard on dp where TP shards dim 0)")
DOC_FULL_TENSOR = "DTensor.full_tensor docstring (the full tensor of this DTensor)"
DOC_SD = ("torch.distributed.checkpoint.state_dict docstrings (get_model_state_dict / set_model_state_dict, "
          "StateDictOptions(full_state_dict=...)); torch.distributed.checkpoint.save / load; upstream "
          "test_fully_shard_state_dict.py (2D)")
DOC_MP = ("MixedPrecisionPolicy docstring (param_dtype: the dtype of the unsharded parameter, for forward and backward; "
          "reduce_dtype: the gradient reduction's; the sharded parameters and gradients stay in the original dtype)")
DOC_CLIP = ("torch.nn.utils.clip_grad_norm_ / get_total_norm / clip_grads_with_norm_ docstrings (the norm over the gradients of all parameters as if concatenated into one "
            "vector; gradients modified in place; norm_type 'inf' too)")


def style_path_subsequence_resolves(spec: CaseSpec) -> bool:
    """Some style's FQN with atoms left out (a proper subsequence of its
    atoms that keeps the last, read from the root) names a module too: "0.0"
    where the root has a child "0", "a.b" where it has a child "b"."""
    g = graph_of(spec)
    for path, _ in spec.tp.styles:
        atoms = path.split(".")
        head, last = atoms[:-1], atoms[-1]
        for mask in range(2 ** len(head) - 1):  # every subset of the head but the whole
            sub = [a for i, a in enumerate(head) if mask >> i & 1] + [last]
            try:
                g.resolve_module(".".join(sub))
            except KeyError:
                continue
            return True
    return False


def case_tags(spec: CaseSpec, pred: TpPrediction, obs: TpObservation) -> set[str]:
    t = spec.tp
    tags = {"api:fsdp2", pred.mesh_tag(), backend_tag(obs), f"optim:{t.optimizer}", f"precision:{t.precision}", f"norm:{t.norm_type}", f"clip:{t.clip_way}"}
    tags |= {f"style:{s}" for _, s in t.styles}
    if t.pairs:
        tags.add("style:pair")  # a colwise -> rowwise pair with its activation sharded between them
    if container_given_to_fully_shard(spec):
        tags.add("container-subclass")  # a ModuleList/ModuleDict subclass with a forward, given to fully_shard
    if style_path_subsequence_resolves(spec):
        tags.add("path:subsequence-resolves")  # see that function
    if obs.requires_grad_changed:
        tags.add("requires-grad:changed")  # wrapping made a frozen parameter trainable (or the reverse)
    if pred.strided_uneven:
        tags.add("shard:strided-uneven")  # a _StridedShard parameter whose TP-local rows split unevenly over dp
    if pred.training.frozen:
        tags.add("frozen")
    if pred.training.fsdp2 is not None:
        # a list group completed by a frozen Embedding (fsdp2-frozen-list-group-freed-in-backward)
        tags |= {t for t in fsdp2_case_tags(spec, pred.training.fsdp2) if t.startswith("group:multi-frozen-embedding")}
    if spec.ties:
        tags.add("tie")
        if tie_within_one_module(spec):
            tags.add("tie:same-module")  # one module holds a Parameter under two of its names
    return tags


def failure_tags(spec: CaseSpec, pred: TpPrediction, world_size: int) -> set[str]:
    """The facts of a HANG or CRASH (no observation): what the spec alone says."""
    tags = {"api:fsdp2", pred.mesh_tag(), f"precision:{spec.tp.precision}"} | {f"style:{s}" for _, s in spec.tp.styles}
    if spec.tp.pairs:
        tags.add("style:pair")
    if pred.tp_empty:
        tags.add("shard:tp-empty")
    if pred.strided_uneven:
        tags.add("shard:strided-uneven")  # a _StridedShard parameter whose TP-local rows split unevenly over dp
    if pred.strided_empty:
        tags.add("shard:strided-empty")  # ... and fewer of them than dp: a rank's piece is empty
    return tags


def _empty_tags(obs_list: list[TpObservation], pred: TpPrediction | None = None) -> set[str]:
    """shard:tp-empty: some rank's TP-local piece of a parameter is empty;
    shard:empty: some rank's local shard of a clipped parameter is."""
    tags = {"shard:tp-empty"} if any(o.tp_empty for o in obs_list) else set()
    if pred is not None:
        full = {p.fqn: p.shape for p in pred.params if p.fqn in pred.clipped}
        if any(p.fqn in full and 0 in p.local_shape and 0 not in full[p.fqn] for o in obs_list for p in o.layout):
            tags.add("shard:empty")
    return tags


def _trained(spec, pred, obs_list) -> NotChecked | None:
    """NotChecked where training is not promised or FSDP raised (TP-PARITY reports the raise)."""
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    first = obs_list[0]
    if first.wrap_error:
        return NotChecked(f"wrapping raised (TP-LAYOUT reports it): {first.wrap_error}")
    if any(o.step_error for o in obs_list):
        return NotChecked("training raised (TP-PARITY reports it)")
    return None


@catalog.invariant(
    "TP-LAYOUT",
    group="tp",
    api="fsdp2",
    scenario="tp",
    all_ranks=True,
    statement="After parallelize_module over the mesh's tp dim and fully_shard(mesh=mesh['dp']), every parameter a style shards or replicates is a DTensor on the 2-D (dp, tp) mesh with placements (the dp placement, the style's TP placement): on dp _StridedShard(0, split_factor=tp) where the TP placement is Shard(0) over more than one rank, else Shard(0); every other parameter a DTensor on the dp mesh with (Shard(0),); every parameter keeps its requires_grad; each rank (d, t) holds torch.chunk's piece d (over dp, of dim 0) of piece t (over tp, of the style's dim) of the unsharded parameter: that shape (uneven and empty pieces included) and, on real ranks, those values.",
    source=f"{DOC_TP}; {DOC_FULLY_SHARD}",
)
def check_layout(spec: CaseSpec, pred: TpPrediction, obs: list[TpObservation]) -> list[Violation] | NotChecked:
    first = obs[0]
    tags = case_tags(spec, pred, first) | _empty_tags(obs)
    if first.wrap_error:
        return [violation("TP-LAYOUT", f"parallelize_module / fully_shard raised {first.wrap_error}", tags, "kind:raised",
                          _error_tag(first.wrap_error))]
    want = pred.by_fqn()
    out = []
    for f in first.requires_grad_changed:
        out.append(violation("TP-LAYOUT", f"{f}'s requires_grad is {not want[f].requires_grad if f in want else '?'} after "
                             "parallelize_module and fully_shard, the unsharded model's the opposite", tags, "kind:requires-grad"))
    for o in obs:
        seen = {p.fqn: p for p in o.layout}
        if set(seen) != set(want):
            out.append(violation("TP-LAYOUT", f"rank {o.rank}: parameters {sorted(set(seen) ^ set(want))} differ from the oracle's",
                                 tags, "kind:names"))
            continue
        for fqn, p in sorted(seen.items()):
            w = want[fqn]
            if p.placements != w.placements:
                out.append(violation("TP-LAYOUT", f"rank {o.rank}: {fqn} has placements {p.placements or 'none (a plain tensor)'}, "
                                     f"promised {w.placements}", tags, "kind:placements"))
            elif p.mesh != w.mesh:
                out.append(violation("TP-LAYOUT", f"rank {o.rank}: {fqn} is on a mesh of shape {p.mesh}, promised {w.mesh}", tags, "kind:mesh"))
            elif p.local_shape != pred.local_shape(w, o.rank):
                out.append(violation("TP-LAYOUT", f"rank {o.rank}: {fqn}'s local shard has shape {p.local_shape}, promised "
                                     f"{pred.local_shape(w, o.rank)}", tags, "kind:local-shape"))
            elif p.local_equal is False:
                out.append(violation("TP-LAYOUT", f"rank {o.rank}: {fqn}'s local shard holds other values than its promised slice",
                                     tags, "kind:local-values"))
    return out


@catalog.invariant(
    "TP-FULL-TENSOR",
    group="tp",
    api="fsdp2",
    scenario="tp",
    statement="Right after parallelize_module and fully_shard, full_tensor() of every parameter equals, bitwise, the unsharded model's parameter built from the same seed in one process (uneven and smaller-than-mesh dims included).",
    source=f"{DOC_FULL_TENSOR}; {DOC_TP}; {DOC_FULLY_SHARD}",
)
def check_full_tensor(spec: CaseSpec, pred: TpPrediction, obs: TpObservation) -> list[Violation] | NotChecked:
    tags = case_tags(spec, pred, obs)
    if obs.wrap_error:
        return NotChecked(f"wrapping raised (TP-LAYOUT reports it): {obs.wrap_error}")
    if not obs.values_meaningful:
        return VALUES_UNCHECKED
    if not obs.full_equal:
        return NotChecked("the case has no parameters")
    return [violation("TP-FULL-TENSOR", f"full_tensor() of {f} differs from the unsharded parameter", tags, "kind:value")
            for f, eq in obs.full_equal if not eq]


@catalog.invariant(
    "TP-PARITY",
    group="tp",
    api="fsdp2",
    scenario="tp",
    all_ranks=True,
    statement="A few optimizer steps (SGD, Adam) of the TP + FSDP2 model, on data that differs by dp rank (the same on a dp rank's tp ranks), match single-process training on the mean loss over the dp ranks' batches: every rank's losses and every parameter's final full_tensor(), within the training tolerance; the forward and backward raise on no rank (an empty TP shard included; a colwise -> rowwise pair, as in a transformer's MLP, passing its hidden activation Shard(-1) between them). Values are compared without mixed precision.",
    source=f"{DOC_FULLY_SHARD}; {DOC_TP}",
)
def check_parity(spec: CaseSpec, pred: TpPrediction, obs: list[TpObservation]) -> list[Violation] | NotChecked:
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    first = obs[0]
    tags = case_tags(spec, pred, first) | _empty_tags(obs)
    if first.wrap_error:
        return NotChecked(f"wrapping raised (TP-LAYOUT reports it): {first.wrap_error}")
    raised = [o for o in obs if o.step_error and not o.step_error.startswith("another rank")]
    if raised:
        return [violation("TP-PARITY", f"rank {o.rank}: training raised {o.step_error}", tags, "kind:raised", _error_tag(o.step_error))
                for o in raised]
    if any(o.step_error for o in obs):
        return [violation("TP-PARITY", f"training raised: {first.step_error}", tags, "kind:raised")]
    if not first.values_meaningful:
        return VALUES_UNCHECKED
    if spec.tp.precision != "none":
        return NotChecked("mixed precision: values against the fp32 reference are not compared (TP-MP-DTYPE checks the casts)")
    if not first.ref_stable:
        return NotChecked("the single-process reference diverged: its values are not comparable")
    out = []
    for o in obs:
        if o.losses_close is False:
            out.append(violation("TP-PARITY", f"rank {o.rank}: losses {list(o.losses)} differ from single-process {list(o.ref_losses)}",
                                 tags, "kind:loss"))
    for p in first.vs_reference:
        if not p.close:
            out.append(violation("TP-PARITY", f"{p.fqn} after training differs from single-process by {p.max_diff:.3g}", tags, "kind:param"))
    return out


def _stack_over_meshes(text: str) -> bool:
    """2.9's form of the mixed-mesh refusal: sharding propagation of
    aten.stack fails on operands whose specs name different meshes (2.8 and
    2.10 on say "must have the same mesh")."""
    if "Sharding propagation failed for Op(op=aten.stack" not in text:
        return False
    return len(set(re.findall(r"mesh=DeviceMesh\(\(([^)]*)\)", text))) > 1


def _error_tag(text: str) -> str:
    """The mechanism of an error, for findings to match on."""
    if "_chunk_cat expects non-empty tensor" in text:
        return "error:chunk-cat-empty"
    if "norm on an empty tensor" in text:
        return "error:inf-norm-empty"
    if "got mixed torch.Tensor and DTensor" in text:
        return "error:mixed-tensor-dtensor"
    if "placement changes are not supported" in text:
        return "error:placement-change"  # the same copy into a one-element parameter
    if "out of bounds for storage of size 0" in text:
        return "error:freed-storage"  # a parameter read over its freed unsharded storage
    if "must have the same mesh" in text or _stack_over_meshes(text):
        return "error:mixed-meshes"
    if "would remove or reshape sharded dimension" in text:
        return "error:view-sharded-dim"
    if "distribute_module should only be called once" in text:
        return "error:distributed-twice"
    if text.startswith("AssertionError") and text.rstrip(": ") == "AssertionError":
        return "error:bare-assertion"
    return "error:other"


@catalog.invariant(
    "TP-STATE-DICT",
    group="tp",
    api="fsdp2",
    scenario="tp",
    statement="The trained TP + FSDP2 model's full state dict (get_model_state_dict, StateDictOptions(full_state_dict=True)) has the unsharded model's keys and each parameter's full_tensor() as value; it loads (set_model_state_dict) into flat FSDP2 over the whole world (no TP) and a fresh TP + FSDP2 model takes flat FSDP's back, values equal bitwise; a torch.distributed.checkpoint save of its sharded state dict loads into flat FSDP, values equal.",
    source=f"{DOC_SD}; {DOC_FULL_TENSOR}",
)
def check_state_dict(spec: CaseSpec, pred: TpPrediction, obs: TpObservation) -> list[Violation] | NotChecked:
    skip = _trained(spec, pred, [obs])
    if skip is not None:
        return skip
    if obs.clip_failed and obs.clip_error and obs.clip_error.startswith("another rank's backward"):
        return NotChecked("the backward before clipping raised: the state dicts were not taken")
    if not obs.values_meaningful:
        return VALUES_UNCHECKED
    tags = case_tags(spec, pred, obs)
    if not obs.unsharded_keys:
        return NotChecked("the model has no state (DCP rejects an empty state dict)")
    out = [violation("TP-STATE-DICT", f"the {name} round trip raised {err}", tags, "kind:raised", f"at:{name}", _error_tag(err))
           for name, err in obs.sd_errors]
    if obs.sd_keys and set(obs.sd_keys) != set(obs.unsharded_keys):
        out.append(violation("TP-STATE-DICT", f"full state dict keys {sorted(set(obs.sd_keys) ^ set(obs.unsharded_keys))} differ from the "
                             "unsharded model's", tags, "kind:keys"))
    for what, keys, kind in (("differs from the parameter's full_tensor()", obs.sd_vs_params, "kind:vs-params"),
                             ("does not come back from flat FSDP", obs.sd_to_flat_differs, "kind:to-flat"),
                             ("does not come back into TP + FSDP from flat FSDP", obs.sd_from_flat_differs, "kind:from-flat"),
                             ("differs after a DCP save loaded into flat FSDP", obs.dcp_to_flat_differs, "kind:dcp-to-flat")):
        if keys:
            out.append(violation("TP-STATE-DICT", f"the full state dict's {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} {what}",
                                 tags, kind))
    return out


@catalog.invariant(
    "TP-MP-DTYPE",
    group="tp",
    api="fsdp2",
    scenario="tp",
    statement="Under MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=None or float32) on every fully_shard call, each module's forward pre-hook sees its parameters' local (unsharded) tensors in bfloat16, TP-sharded ones included; after the steps the sharded parameters and their gradients are float32 (the original dtype).",
    source=f"{DOC_MP}; {DOC_FULLY_SHARD}",
)
def check_mp(spec: CaseSpec, pred: TpPrediction, obs: TpObservation) -> list[Violation] | NotChecked:
    if spec.tp.precision == "none":
        return NotChecked("no mixed precision policy")
    if pred.applicable:
        return NotChecked(f"training is not promised for this case: {pred.applicable}")
    if obs.wrap_error:
        return NotChecked(f"wrapping raised (TP-LAYOUT reports it): {obs.wrap_error}")
    tags = case_tags(spec, pred, obs)
    out = []
    seen = dict(obs.forward_dtypes)  # recorded where training then raised too (TP-PARITY reports the raise)
    trainable = set(pred.training.trainable) | set(pred.training.frozen)
    if not seen:
        return NotChecked("no module with parameters ran a forward")
    for f, dt in sorted(seen.items()):
        if f in trainable and dt != "torch.bfloat16":
            out.append(violation("TP-MP-DTYPE", f"{f}'s local tensor is {dt} in forward, param_dtype is bfloat16", tags, "kind:forward-dtype"))
    for f, dt in obs.sharded_dtypes:
        if dt != "torch.float32":
            out.append(violation("TP-MP-DTYPE", f"sharded parameter {f} is {dt}, its original dtype float32", tags, "kind:sharded-dtype"))
    for f, dt in obs.grad_dtypes:
        if dt != "torch.float32":
            out.append(violation("TP-MP-DTYPE", f"sharded gradient of {f} is {dt}, its parameter's dtype float32", tags, "kind:grad-dtype"))
    return out


@catalog.invariant(
    "TP-CLIP",
    group="tp",
    api="fsdp2",
    scenario="tp",
    all_ranks=True,
    statement="torch.nn.utils.clip_grad_norm_, or get_total_norm then clip_grads_with_norm_ (norm types 1, 2, 3, inf; foreach True or False), over the TP + FSDP2 gradients (every parameter's: those on the 2-D mesh and those on the dp mesh only together; or the 2-D ones alone) returns on every rank the single-process total norm of the same gradients, and leaves each full gradient equal to the single-process gradient scaled by max_norm / total norm; it raises on no rank (mixed meshes and empty local shards included).",
    source=f"{DOC_CLIP}; {DOC_FULLY_SHARD}",
)
def check_clip(spec: CaseSpec, pred: TpPrediction, obs: list[TpObservation]) -> list[Violation] | NotChecked:
    skip = _trained(spec, pred, obs)
    if skip is not None:
        return skip
    first = obs[0]
    tags = case_tags(spec, pred, first) | _empty_tags(obs, pred)
    if pred.mixed_meshes or len(first.clip_meshes) > 1:
        tags.add("mesh:mixed")  # clipped gradients on the 2-D mesh and on the dp mesh
    if any(o.norm is None and o.ref_norm is None and o.clip_error for o in obs):
        return NotChecked(f"the backward before clipping raised (TP-PARITY): {first.clip_error}")
    if not pred.clipped:
        return NotChecked("no trainable parameter to clip")
    out = []
    for o in obs:
        if o.clip_error:
            out.append(violation("TP-CLIP", f"rank {o.rank}: {spec.tp.clip_way} raised {o.clip_error}", tags, "kind:raised", _error_tag(o.clip_error)))
    if out:
        skipped = [o.rank for o in obs if o.clip_peer_failed]
        if skipped:
            out[0] = violation("TP-CLIP", out[0].message + f" (ranks {skipped} did not call it: they would wait in its reduction)",
                               set(out[0].tags))
        return out
    if not first.values_meaningful:
        return VALUES_UNCHECKED
    if spec.tp.precision != "none":
        return NotChecked("mixed precision: gradients against the fp32 reference are not compared")
    if not first.ref_stable:
        return NotChecked("the single-process reference diverged: its values are not comparable")
    for o in obs:
        if o.norm_close is False:
            out.append(violation("TP-CLIP", f"rank {o.rank}: total norm {o.norm:.6g}, single-process {o.ref_norm:.6g} "
                                 f"(norm_type {spec.tp.norm_type})", tags, "kind:norm"))
    if not first.scale_finite:
        return out or NotChecked(f"the single-process total norm is {first.ref_norm} (norm_type {spec.tp.norm_type} overflows float32), "
                                 "and so is every rank's: the clipped gradients, scaled by max_norm / that norm, are not compared")
    for p in first.clipped_grads:
        if not p.close:
            out.append(violation("TP-CLIP", f"{p.fqn}'s clipped gradient differs from single-process by {p.max_diff:.3g}", tags, "kind:grad"))
    return out


INVARIANTS = tuple(catalog.invariants)
