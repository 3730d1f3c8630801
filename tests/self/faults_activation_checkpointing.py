"""Faults injected into activation checkpointing and its composition with
FSDP (torch.utils.checkpoint, checkpoint_wrapper, FSDP2's and FSDP1's
forward hooks in the recomputed forward), as context managers, and
test-only scenarios that apply one inside a rank of the pool (a monkeypatch
in the driver does not reach rank processes)."""

from __future__ import annotations

import contextlib
from unittest import mock

from conformance.case.spec import CaseSpec
from conformance.engine.scenarios import scenario

FAULTS = {}


def fault(name):
    def add(fn):
        FAULTS[name] = fn
        return fn

    return add


@contextlib.contextmanager
def _all(*patches):
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


@fault("checkpoint-detaches-region")
def checkpoint_detaches_region():
    """torch.utils.checkpoint (and checkpoint_wrapper's use of it) runs the
    region without building its graph and hands back a fresh leaf: the
    region's parameters, and everything before it, get no gradient."""
    import torch
    import torch.utils.checkpoint as tuc
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    def detached(function, *args, use_reentrant=None, context_fn=None, **kwargs):
        with torch.no_grad():
            out = function(*args, **kwargs)
        return out.detach().requires_grad_(True)

    return _all(mock.patch.object(tuc, "checkpoint", detached), mock.patch.object(cw, "torch_utils_checkpoint", detached))


@fault("checkpoint-keeps-activations")
def checkpoint_keeps_activations():
    """torch.utils.checkpoint (and checkpoint_wrapper's use of it) runs the
    region as a plain call: the same values and gradients, but its
    activations are kept and nothing is recomputed in backward."""
    import torch.utils.checkpoint as tuc
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    def plain(function, *args, use_reentrant=None, context_fn=None, **kwargs):
        return function(*args, **kwargs)

    return _all(mock.patch.object(tuc, "checkpoint", plain), mock.patch.object(cw, "torch_utils_checkpoint", plain))


@fault("checkpoint-recomputes-twice")
def checkpoint_recomputes_twice():
    """torch.utils.checkpoint (and checkpoint_wrapper's use of it) runs the
    region's forward twice whenever it recomputes: the same values and
    gradients, twice the recompute (seen on the reentrant variant, which
    re-runs the whole region; the non-reentrant one stops early)."""
    import torch.utils.checkpoint as tuc
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    orig = tuc.checkpoint

    def twice(function, *args, **kwargs):
        calls = [0]

        def region(*a, **k):
            calls[0] += 1
            if calls[0] > 1:  # a recompute: once more than asked
                function(*a, **k)
            return function(*a, **k)

        return orig(region, *args, **kwargs)

    return _all(mock.patch.object(tuc, "checkpoint", twice), mock.patch.object(cw, "torch_utils_checkpoint", twice))


@fault("checkpoint-probes-region-in-forward")
def checkpoint_probes_region_in_forward():
    """torch.utils.checkpoint (and checkpoint_wrapper's use of it) runs the
    region once without grad before the checkpointed call (a probe of its
    outputs): the same values and gradients, one forward more per step."""
    import torch
    import torch.utils.checkpoint as tuc
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    orig = tuc.checkpoint

    def probed(function, *args, **kwargs):
        with torch.no_grad():
            function(*args, **{k: v for k, v in kwargs.items() if k not in ("use_reentrant", "context_fn", "preserve_rng_state",
                                                                              "determinism_check", "debug")})
        return orig(function, *args, **kwargs)

    return _all(mock.patch.object(tuc, "checkpoint", probed), mock.patch.object(cw, "torch_utils_checkpoint", probed))


@fault("wrapper-keeps-prefix")
def wrapper_keeps_prefix():
    """checkpoint_wrapper's state_dict post-hook leaves its
    _checkpoint_wrapped_module. prefix in the keys."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    return mock.patch.object(cw.ActivationWrapper, "_post_state_dict_hook", staticmethod(lambda module, state_dict, prefix, *a: state_dict))


@fault("fsdp2-reshard-after-recompute")
def fsdp2_reshard_after_recompute():
    """FSDP2's post-forward reshards after a forward recomputed in backward
    (the is_bw() check dropped): the group's pre-backward then all-gathers
    it again."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def post_forward(self, module, input, output):
        self.reshard()
        self._record_post_forward()
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        self._training_state = TrainingState.IDLE
        return output

    return mock.patch.object(FSDPParamGroup, "post_forward", post_forward)


@fault("fsdp1-regather-in-backward")
def fsdp1_regather_in_backward():
    """FSDP1's handle all-gathers again when an unshard in backward finds
    its parameters already unsharded (the root after forward, a prefetched
    unit, a recomputed forward): the already-unsharded check lost in
    backward. The values are the same; only the count shows it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._flat_param import FlatParamHandle, HandleTrainingState

    orig = FlatParamHandle.unshard

    def unshard(self):
        again = (self.uses_sharded_strategy and not self.needs_unshard()
                 and self._training_state == HandleTrainingState.BACKWARD_PRE)
        orig(self)
        if again:  # the same all-gather, into a scratch buffer (the parameters stay as they are)
            scratch = torch.empty_like(self._get_padded_unsharded_flat_param())
            dist.all_gather(list(torch.chunk(scratch, self.world_size)), self.flat_param._local_shard, group=self.process_group)

    return mock.patch.object(FlatParamHandle, "unshard", unshard)


@fault("fsdp2-recompute-gathers-twice")
def fsdp2_recompute_gathers_twice():
    """FSDP2's pre-forward of a forward recomputed in backward all-gathers
    the group twice (it reshards what it just gathered and gathers again):
    the values are the same; only the count shows it."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    orig = FSDPParamGroup.pre_forward

    def pre_forward(self, module, args, kwargs):
        out = orig(self, module, args, kwargs)
        if torch._C._current_graph_task_id() != -1:  # inside a backward: the recompute
            self.reshard()
            self.unshard()
            self.wait_for_unshard()
        return out

    return mock.patch.object(FSDPParamGroup, "pre_forward", pre_forward)


def _faulty(name: str):
    def run(spec: CaseSpec) -> dict:
        from conformance.areas.activation_checkpointing import adapter

        with FAULTS[name]():
            return adapter.observe(spec).to_dict()

    run.__name__ = run.__qualname__ = f"faulty_ac_{name}".replace("-", "_")
    return run


def _borrowed():
    from tests.self.faults_training import FAULTS as TRAINING_FAULTS

    FAULTS["fsdp2-frozen-get-zero-grads"] = TRAINING_FAULTS["fsdp2-frozen-get-zero-grads"]
    from tests.self.faults_init_order import FAULTS as INIT_FAULTS

    FAULTS["fsdp1-summon-raises"] = INIT_FAULTS["fsdp1-summon-raises"]


_borrowed()

for _name in FAULTS:
    scenario(f"fault:ac:{_name}", test_only=True)(_faulty(_name))
