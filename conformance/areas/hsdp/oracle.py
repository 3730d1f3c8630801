"""What HSDP promises of a case (from the spec alone, no torch.distributed):
whether training is promised, the (replicate, shard) layout, which rank
holds which shard, each parameter's local shard, and each step's gradient
reductions.

The promises, and where they are stated:

- fully_shard docstring (mesh): "a 2D mesh ... for HSDP": parameters are
  sharded across the shard dim (dim 1) and replicated across the replicate
  dim (dim 0); each parameter a DTensor with placements (Replicate(),
  Shard(0)) of which a rank holds torch.chunk's piece for its shard index.
- ShardingStrategy docstring: HYBRID_SHARD "Apply FULL_SHARD within a node,
  and replicate parameters across nodes"; _HYBRID_SHARD_ZERO2 the same with
  SHARD_GRAD_OP. FullyShardedDataParallel docstring: process_group may be a
  tuple (shard group, replicate group), device_mesh a 2-D mesh.
- upstream tests: test_fully_shard_training.py TestFullyShardHSDPTraining
  (HSDP training equals DDP / single process), test_fsdp_hybrid_shard.py
  (the inter-node all-reduce after the intra-node reduce-scatter; the
  reduced gradients identical across the replicate group).
- What FSDP communicates: per step, each parameter group or unit with a
  trainable parameter reduce-scatters its gradient over the shard dim (none
  on a one-rank shard dim) and all-reduces the shard over the replicate dim
  (its ranks); every all-gather spans the shard dim only."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from conformance.areas.common.comm_oracle import padded_numel, param_shapes
from conformance.areas.common.training_oracle import TrainingPrediction, predict_training
from conformance.case.spec import CaseSpec

PLACEMENTS_2D = "(Replicate(), Shard(dim=0))"


@dataclass(frozen=True)
class Reduction:
    """One gradient reduction promised per step: ``op`` over ``ranks`` ranks
    of ``numel`` elements (the reduce-scatter's input, the all-reduce's shard)."""

    op: str  # reduce_scatter | all_reduce
    ranks: int
    numel: int
    owner: str  # the group's modules or the unit's path


@dataclass(frozen=True)
class HsdpPrediction:
    api: str
    mesh: tuple[int, int]
    training: TrainingPrediction
    # canonical FQN -> (full shape, requires grad)
    shapes: tuple[tuple[str, tuple[int, ...], bool], ...]
    reductions: tuple[Reduction, ...]  # per step
    exact_numel: bool  # False: FSDP1 with use_orig_params=True aligns each parameter (undocumented padding)
    # FSDP1, use_orig_params=False: unit path -> its flat parameter's numel (unpadded)
    unit_numel: tuple[tuple[str, int], ...] = ()

    @property
    def replicate(self) -> int:
        return self.mesh[0]

    @property
    def shard(self) -> int:
        return self.mesh[1]

    @property
    def applicable(self) -> str:
        return self.training.applicable

    def shard_index(self, rank: int) -> int:
        """init_device_mesh lays ranks out row-major: rank = replica * shard + index."""
        return rank % self.shard

    def replica_index(self, rank: int) -> int:
        return rank // self.shard

    def mesh_tag(self) -> str:
        r, s = self.mesh
        return "mesh:2d" if r > 1 and s > 1 else "mesh:n-by-1" if s == 1 else "mesh:1-by-n"


def local_shape(shape: tuple[int, ...], shard: int, index: int) -> tuple[int, ...]:
    """torch.chunk's piece ``index`` of dim 0 over ``shard`` ranks (empty past the end)."""
    if not shape:
        return shape
    size = math.ceil(shape[0] / shard) if shape[0] else 0
    rows = max(0, min(size, shape[0] - index * size))
    return (rows, *shape[1:])


@functools.lru_cache(maxsize=512)
def predict_hsdp(spec: CaseSpec) -> HsdpPrediction:
    h = spec.hsdp
    r, s = h.mesh
    training = predict_training(spec)
    shapes = param_shapes(spec)
    canon = training.trainable + training.frozen
    out: list[Reduction] = []
    unit_numel: list[tuple[str, int]] = []
    if spec.plan.api == "fsdp2":
        for g in training.fsdp2.groups if training.fsdp2 is not None else ():
            if not g.trainable:
                continue
            label = ", ".join(g.modules)
            rs = sum(padded_numel(shapes[f][0], s) for f in g.trainable)
            if s > 1:
                out.append(Reduction("reduce_scatter", s, rs, label))
            if r > 1:
                out.append(Reduction("all_reduce", r, rs // s, label))
    elif training.fsdp1 is not None and training.fsdp1.error is None:
        for u in training.fsdp1.units:
            n = sum(math.prod(shapes[f][0]) for f in u.managed)
            if u.managed:
                unit_numel.append((u.path, n))
            if not u.trainable:
                continue
            full = math.ceil(n / s) * s
            if s > 1:
                out.append(Reduction("reduce_scatter", s, full, u.path))
            if r > 1:
                out.append(Reduction("all_reduce", r, full // s, u.path))
    return HsdpPrediction(
        api=spec.plan.api, mesh=(r, s), training=training,
        shapes=tuple((f, shapes[f][0], shapes[f][1]) for f in canon),
        reductions=tuple(out), exact_numel=not (spec.plan.api == "fsdp1" and spec.plan.use_orig_params),
        unit_numel=tuple(unit_numel),
    )
