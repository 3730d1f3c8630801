"""Finding: fsdp1-no-shard-unused-unit-params-unregistered

FSDP1 with use_orig_params=True: a NO_SHARD unit (a CustomPolicy kwarg here;
every unit on one rank) whose forward runs in a backward that gives none of
its parameters a gradient (a microbatch that passes over the submodule holding
them), while its output needs a gradient (a trainable layer before it). The
pre-backward hook unshards the unit, swapping its original parameters for
plain tensor views; no post-backward hook runs for it, and _catch_all_reshard
takes NO_SHARD's flat parameter for "already resharded", so the views stay:
named_parameters() lacks the unit's parameters, and the gradient of the next
microbatch that reads them lands on those views, not on the parameters the
optimizer holds. After one step of two synchronized microbatches (the first
passes over the unit's Linear, the second reads it) the model's output
differs from single-process training's; with the unit FULL_SHARD, or the Linear read in
both microbatches, it does not. The frozen form of the same check is
fsdp1-no-shard-frozen-unit-params-unregistered. Expected
(FullyShardedDataParallel docstring, use_orig_params: the original
parameters are exposed through named_parameters(); no_sync docstring:
accumulation without no_sync is supported): the step equals single-process
training.

Run: torchrun --nproc-per-node 2 fsdp1-no-shard-unused-unit-params-unregistered.py
Run: python fsdp1-no-shard-unused-unit-params-unregistered.py (one rank: FSDP1 runs FULL_SHARD as NO_SHARD there, so the control deviates too)
"""

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import CustomPolicy


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


class Block(nn.Module):  # its own NO_SHARD unit; holds no parameter itself
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        self.skip = False

    def forward(self, x):
        return x if self.skip else self.lin(x)


def main():
    init()
    warnings.simplefilter("ignore")  # FSDP's notes about NO_SHARD
    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = []
    for strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.FULL_SHARD):  # FULL_SHARD: the control
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(4, 4, bias=False), Block())  # [0]: trainable, so the block's output needs a gradient
        model = nn.Sequential(nn.Linear(4, 4, bias=False), Block())
        model.load_state_dict(ref.state_dict())
        block = model[1]  # model[1] becomes its FSDP wrapper
        policy = CustomPolicy(lambda m: {"sharding_strategy": strategy} if isinstance(m, Block) else False)
        fsdp = FSDP(model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))
        opt, ref_opt = torch.optim.SGD(fsdp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        missing = []
        for k in range(2):  # two microbatches, synchronized each: the first passes over block.lin
            block.skip = ref[1].skip = k == 0
            xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * k + r)) for r in range(world)]
            fsdp(xs[rank]).pow(2).sum().backward()
            (sum(ref(x).pow(2).sum() for x in xs) / world).backward()
            names = {n.replace("_fsdp_wrapped_module.", "") for n, _ in fsdp.named_parameters()}
            missing += [f"after microbatch {k + 1}: named_parameters() lacks 1.lin.weight"] if "1.lin.weight" not in names else []
        opt.step()
        ref_opt.step()
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(99))
        with torch.no_grad():  # the model after the step, as a forward sees it
            err = float((fsdp(x) - ref(x)).abs().max())
        if err > 1e-5 or missing:
            wrong.append(f"{strategy.name}: {'; '.join(missing)}{'; ' if missing else ''}"
                         f"the output after the step differs from single-process training's by {err:.3g}")
    finish(wrong and "; ".join(wrong),
           "the NO_SHARD unit's parameters stay registered and the step equals single-process training")


if __name__ == "__main__":
    main()
