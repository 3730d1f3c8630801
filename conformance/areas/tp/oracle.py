"""What tensor parallelism + FSDP2 promises of a case (from the spec alone, no
torch.distributed): whether training is promised, each parameter's layout
over the (dp, tp) mesh (its mesh, placements and every rank's local shard),
and which parameters a clip takes.

The promises, and where they are stated:

- parallelize_module / ColwiseParallel / RowwiseParallel / SequenceParallel
  docstrings (torch.distributed.tensor.parallel.style): Colwise shards a
  Linear's weight and bias on dim 0 (an Embedding's weight on dim 1),
  Rowwise a Linear's weight on dim 1 (its bias replicated; an Embedding's
  weight on dim 0), SequenceParallel replicates a LayerNorm's parameters;
  with the layouts given the module's inputs and outputs are the
  unparallelized module's (test_tp_style.py, test_parallelize_api.py).
- fully_shard docstring (mesh: "This data parallel mesh defines the
  sharding"; sharded parameters "DTensor s sharded on dim-0") and upstream
  test_fully_shard_training.py TestFullyShard2DTraining /
  test_fully_shard_init.py (2-D): fully_shard(mesh=mesh["dp"]) over a
  TP-sharded DTensor shards its TP-local tensor's dim 0 over dp, as
  torch.chunk does; the parameter becomes a DTensor on the 2-D (dp, tp)
  mesh with placements (dp placement, the TP placement), the dp placement
  _StridedShard(0, split_factor=tp) where TP also shards dim 0 over more
  than one rank (the dp chunks are taken inside the tp chunks), else
  Shard(0). A parameter no style touched stays on the 1-D dp mesh,
  (Shard(0),). full_tensor() of either is the unsharded parameter.
- DTensor.full_tensor docstring, torch.distributed.checkpoint.state_dict
  docstrings (full and sharded state dicts of a 2-D model; upstream
  test_fully_shard_state_dict.py 2D), clip_grad_norm_ docstring (the norm
  over all gradients as one vector)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from conformance.areas.common.comm_oracle import param_shapes
from conformance.areas.common.training_oracle import TrainingPrediction, predict_training
from conformance.case.spec import CaseSpec
from conformance.case.tree import join, walk

# the TP placement a style gives each parameter of its leaf (None: the
# parameter is not the style's), by (leaf class, style, parameter name)
TP_PLACEMENT = {
    ("Linear", "colwise", "weight"): "Shard(dim=0)",
    ("Linear", "colwise", "bias"): "Shard(dim=0)",
    ("Linear", "rowwise", "weight"): "Shard(dim=1)",
    ("Linear", "rowwise", "bias"): "Replicate()",
    ("Embedding", "colwise", "weight"): "Shard(dim=1)",
    ("Embedding", "rowwise", "weight"): "Shard(dim=0)",
    ("LayerNorm", "sequence", "weight"): "Replicate()",
    ("LayerNorm", "sequence", "bias"): "Replicate()",
}


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's promised layout: ``tp`` its TP placement ("" for a
    parameter no style touched: the dp mesh only), ``placements`` the
    DTensor's placements as str(tuple(...)) shows them, ``mesh`` the DTensor
    mesh's shape."""

    fqn: str
    shape: tuple[int, ...]
    requires_grad: bool
    tp: str
    placements: str
    mesh: tuple[int, ...]


@dataclass(frozen=True)
class TpPrediction:
    mesh: tuple[int, int]
    training: TrainingPrediction
    params: tuple[ParamLayout, ...]
    clipped: tuple[str, ...]  # canonical FQNs the clip takes (trainable ones)

    @property
    def dp(self) -> int:
        return self.mesh[0]

    @property
    def tp(self) -> int:
        return self.mesh[1]

    @property
    def applicable(self) -> str:
        return self.training.applicable

    def coords(self, rank: int) -> tuple[int, int]:
        """init_device_mesh lays ranks out row-major: rank = dp index * tp + tp index."""
        return rank // self.tp, rank % self.tp

    def local_shape(self, p: ParamLayout, rank: int) -> tuple[int, ...]:
        d, t = self.coords(rank)
        return local_shape(p.shape, p.tp, self.dp, self.tp, d, t)

    def mesh_tag(self) -> str:
        dp, tp = self.mesh
        return "mesh:2d" if dp > 1 and tp > 1 else "mesh:dp1" if dp == 1 else "mesh:tp1"

    def by_fqn(self) -> dict[str, ParamLayout]:
        return {p.fqn: p for p in self.params}

    @property
    def tp_empty(self) -> bool:
        """Some parameter's TP-sharded dim is smaller than tp: a tp rank holds an empty piece."""
        tp = self.mesh[1]
        return any(p.tp.startswith("Shard(dim=") and p.shape and p.shape[int(p.tp[len("Shard(dim="):-1])] < tp for p in self.params)

    @property
    def strided_uneven(self) -> bool:
        """Some parameter is _StridedShard on dp (TP shards its dim 0) and a
        tp rank's rows do not split evenly over dp."""
        dp, tp = self.mesh
        if dp == 1 or tp == 1:
            return False
        return any(p.tp == "Shard(dim=0)" and p.shape and any(chunk(p.shape[0], tp, t) % dp for t in range(tp)) for p in self.params)

    @property
    def strided_empty(self) -> bool:
        """Some parameter is _StridedShard on dp (TP shards its dim 0) and a
        tp rank has fewer rows than dp: a (dp, tp) rank holds an empty piece."""
        dp, tp = self.mesh
        if dp == 1 or tp == 1:
            return False
        return any(p.tp == "Shard(dim=0)" and p.shape and any(0 < chunk(p.shape[0], tp, t) < dp for t in range(tp)) for p in self.params)

    @property
    def mixed_meshes(self) -> bool:
        """Some clipped parameter is on the 2-D mesh and another on the dp mesh only."""
        meshes = {len(p.mesh) for p in self.params if p.fqn in self.clipped}
        return len(meshes) > 1


def chunk(n: int, parts: int, index: int) -> int:
    """The size of torch.chunk's piece ``index`` of ``n`` over ``parts`` (0 past the end)."""
    size = math.ceil(n / parts) if n else 0
    return max(0, min(size, n - index * size))


def local_shape(shape: tuple[int, ...], tp_placement: str, dp: int, tp: int, d: int, t: int) -> tuple[int, ...]:
    """The local shard of rank (d, t): the TP chunk (of the dim its Shard
    names; all of a Replicate or untouched parameter), then dp's chunk of its dim 0."""
    if not shape:
        return shape
    s = list(shape)
    if tp_placement.startswith("Shard(dim="):
        dim = int(tp_placement[len("Shard(dim="):-1])
        s[dim] = chunk(s[dim], tp, t)
    s[0] = chunk(s[0], dp, d)
    return tuple(s)


def placements(tp_placement: str, tp: int) -> tuple[str, tuple[int, ...]]:
    """(str of the placements tuple, the mesh's shape) fully_shard gives a
    parameter whose TP placement is ``tp_placement`` ("" for none), on a
    (dp, tp) mesh of ``tp`` tp ranks (the dp size is not in the string)."""
    if not tp_placement:
        return "(Shard(dim=0),)", ()
    dp_placement = f"_StridedShard(dim=0, sf={tp})" if tp_placement == "Shard(dim=0)" and tp > 1 else "Shard(dim=0)"
    return f"({dp_placement}, {tp_placement})", ()


@functools.lru_cache(maxsize=512)
def predict_tp(spec: CaseSpec) -> TpPrediction:
    t = spec.tp
    dp, tp = t.mesh
    training = predict_training(spec)
    shapes = param_shapes(spec)
    styles = dict(t.styles)
    mods = dict(walk(spec.tree))
    tp_of: dict[str, str] = {}
    for path, style in styles.items():
        m = mods[path]
        for q in m.params:
            tp_of[join(path, q.name)] = TP_PLACEMENT[(m.cls, style, q.name)]
    params = []
    for fqn in training.trainable + training.frozen:
        shape, rg = shapes[fqn]
        tpp = tp_of.get(fqn, "")
        pl, _ = placements(tpp, tp)
        params.append(ParamLayout(fqn, tuple(shape), rg, tpp, pl, (dp, tp) if tpp else (dp,)))
    clipped = tuple(p.fqn for p in params if p.requires_grad and (t.clip_all or p.tp))
    return TpPrediction(mesh=(dp, tp), training=training, params=tuple(sorted(params, key=lambda p: p.fqn)), clipped=clipped)
