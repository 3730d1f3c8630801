"""Finding: dcp-empty-param-group-before-last-loses-hyperparameters

torch.distributed.checkpoint.state_dict's set_state_dict (and
set_optimizer_state_dict) on an optimizer with a parameter group that has no
parameters, where that group is not the last one: the loaded optimizer's empty
group gets no hyperparameters back (lr, momentum, dampening, weight_decay are
gone), and the next optimizer.step() raises KeyError: 'weight_decay' (AdamW:
'betas'). Training scripts build such groups: the "decay" group of matrices
listed first and empty where none trains (BitFit, a norm-only fine-tune, or a
model whose matrices are frozen). The same optimizer with the empty group last
resumes, and torch.optim's own load_state_dict restores it either way. It
happens with or without FSDP (MODES below: a plain module, FSDP1 with
use_orig_params=True, FSDP2).

Run: python dcp-empty-param-group-before-last-loses-hyperparameters.py
Run: torchrun --nproc-per-node 2 dcp-empty-param-group-before-last-loses-hyperparameters.py
"""

import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

MODES = ("plain", "fsdp1", "fsdp2")


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


def make(mode, empty_first):
    """A LayerNorm (parameters of one dimension only) and SGD with two groups:
    the matrices (none here, so empty) at lr 0.05, the rest at 0.025 without
    weight decay; the empty group first or last."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(4))
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    elif mode == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        fully_shard(model)
    params = list(model.parameters())
    decay = {"params": [p for p in params if p.dim() >= 2]}  # empty
    rest = {"params": [p for p in params if p.dim() < 2], "lr": 0.025, "weight_decay": 0.0}
    return model, torch.optim.SGD([decay, rest] if empty_first else [rest, decay], lr=0.05, momentum=0.9)


def step(model, opt):
    opt.zero_grad()
    (model(torch.linspace(-1.0, 1.0, 8).reshape(2, 4)) ** 2).sum().backward()
    opt.step()


def hyper(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def main():
    init()
    warnings.simplefilter("ignore")
    wrong = []
    for mode in MODES:
        for empty_first in (True, False):
            try:
                model, opt = make(mode, empty_first)
                step(model, opt)
            except Exception as e:  # noqa: BLE001 - FSDP2 on CPU needs torch >= 2.7
                if dist.get_rank() == 0:
                    print(f"note: {mode} does not train on this torch ({type(e).__name__}: {str(e)[:120]}); not checked", flush=True)
                break
            for g in opt.param_groups:
                g["lr"] *= 0.8  # a learning-rate schedule's step: the load must restore it
            msd, osd = get_state_dict(model, opt)
            want = hyper(opt)
            model2, opt2 = make(mode, empty_first)
            where = f"{mode}, the empty group {'first' if empty_first else 'last'}"
            try:
                set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd)
                got = hyper(opt2)
                if got != want:
                    lost = [f"group {i}: {sorted(set(w) - set(g))} missing" + (
                        f", {sorted(k for k in set(w) & set(g) if w[k] != g[k])} changed" if any(w[k] != g[k] for k in set(w) & set(g)) else "")
                        for i, (g, w) in enumerate(zip(got, want)) if g != w]
                    wrong.append(f"{where}: after set_state_dict the param_groups differ from the saved ({'; '.join(lost)})")
                step(model2, opt2)
            except Exception as e:  # noqa: BLE001 - the deviation is what raised
                wrong.append(f"{where}: the step after set_state_dict raised {type(e).__name__}: {e}")
    finish(wrong and "; ".join(wrong), "every param group, the empty one included, has its saved hyperparameters after set_state_dict")


if __name__ == "__main__":
    main()
