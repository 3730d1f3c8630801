# fsdp-conformance reproduction (FSDP2): frozenlist
# found with torch 2.13.0+cpu
# run: python repro.py   or   torchrun --nproc-per-node 2 repro.py
# (rerun(): the same backward with reshard_after_forward=False when the group runs twice, seed 31337)

import copy
import os
import socket
import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
except ImportError:  # torch 2.4 - 2.5
    from torch.distributed._composable.fsdp import fully_shard, register_fsdp_forward_method

def read_attr(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def is_sharded(t):
    return hasattr(t, "device_mesh")  # a DTensor: FSDP2's sharded parameter


def use_param(x, t):
    if t.dim() == 2:  # a head reusing a weight through F.linear (HF generate()'s tied head)
        return F.linear(x[:, None].expand(x.shape[0], t.shape[1]), t).mean(-1) + x
    return x + 0.5 * torch.tanh(t).mean()


def call_child(child, x):
    if isinstance(child, nn.Linear):
        return child(x[:, None].expand(x.shape[0], child.in_features)).mean(-1) + x
    if isinstance(child, nn.Embedding):
        return child(torch.arange(x.shape[0]) % child.num_embeddings).mean(-1) + x
    if isinstance(child, nn.LayerNorm):
        n = child.normalized_shape[0]
        return child(x[:, None] + torch.arange(n, dtype=x.dtype)).mean(-1) + x
    if type(child) in (nn.ModuleList, nn.ModuleDict, nn.Sequential):
        for c in child._modules.values():
            x = call_child(c, x)
        return x
    return child(x)


def generic_forward(self, x):
    for name in self.case_params:
        x = x + 0.5 * torch.tanh(getattr(self, name)).mean()
    for name in self.case_buffers:
        x = x + getattr(self, name).mean()
    for child in self._modules.values():
        x = call_child(child, x)
    return x

class ModelSeq(nn.Sequential):
    forward = generic_forward


class Block(nn.Module):
    forward = generic_forward

def build():
    torch.manual_seed(0)
    m0 = ModelSeq()  # <root>
    m1 = nn.Linear(1, 1, bias=True)  # 0
    m0.add_module('0', m1)
    m1.weight.requires_grad_(False)
    m2 = nn.Linear(1, 1, bias=False)  # 1
    m0.add_module('1', m2)
    m2.weight.requires_grad_(False)
    m3 = Block()  # 2
    m0.add_module('2', m3)
    m4 = nn.Embedding(1, 1)  # 2.embed1
    m3.add_module('embed1', m4)
    m4.weight.requires_grad_(False)
    m0.case_params = []
    m0.case_buffers = []
    m3.case_params = []
    m3.case_buffers = []
    mods = {'': m0, '0': m1, '1': m2, '2': m3, '2.embed1': m4}
    return m0, mods

def shard(mods):
    # bottom-up: each group after every group below it, the root last
    fully_shard([mods['2.embed1'], mods['1']])
    fully_shard(mods[''])

def register(mods):
    pass

SHIFT, SCALE = 0.25, 1.5
CALLS = [('', '', False)]  # (module path, method name or '' for forward, keyword arguments?)
GROUP_ROOTS = ['2.embed1', '']

def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main():
    if "RANK" not in os.environ:  # plain `python`: a one-process gloo group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, mods = build()
    ref = copy.deepcopy(model)  # the unsharded reference (ties and methods copied along)
    ref_mods = {p: ref.get_submodule(p) for p in mods}
    shard(mods)
    register(mods)
    x = torch.linspace(-1.0, 1.0, 2)
    outs, ref_outs = [], []
    for i, (path, name, keyword) in enumerate(CALLS):
        args, kwargs = ((x, SHIFT), {"scale": SCALE}) if keyword else ((x,), {})
        fn = getattr(mods[path], name) if name else mods[path]
        ref_fn = getattr(ref_mods[path], name) if name else ref_mods[path]
        try:
            out = fn(*args, **kwargs)
        except Exception as e:
            print(f"[rank {rank}] call {i} {name or 'forward'} on {path or '<root>'!r} raised {type(e).__name__}: {e}")
            continue
        ref_out = ref_fn(*args, **kwargs)
        outs.append(out)
        ref_outs.append(ref_out)
        sharded = {p or "<root>": is_sharded(next(mods[p].parameters())) for p in GROUP_ROOTS if any(True for _ in mods[p].parameters())}
        print(f"[rank {rank}] call {i} {name or 'forward'} on {path or '<root>'!r}: max |out - reference| = "
              f"{(full(out) - ref_out).abs().max().item():.3g}; sharded after: {sharded}")
    if outs:
        try:
            sum((o ** 2).sum() for o in outs).backward()
            sum((o ** 2).sum() for o in ref_outs).backward()
            ref_params = dict(ref.named_parameters())
            for fqn, p in model.named_parameters():
                r = ref_params[fqn]
                if (p.grad is None) != (r.grad is None):
                    print(f"[rank {rank}] {fqn}: grad None is {p.grad is None}, the reference's {r.grad is None}")
                elif p.grad is not None:
                    d = (full(p.grad) - r.grad).abs().max().item()
                    if d > 1e-5:
                        print(f"[rank {rank}] gradient of {fqn} differs from the reference's by {d:.3g}")
        except Exception as e:
            print(f"[rank {rank}] backward raised {type(e).__name__}: {e}")
    rerun(rank)
    dist.barrier()
    dist.destroy_process_group()


class Rerun(nn.Module):
    forward = generic_forward


def rerun(rank):
    """reshard_after_forward=False, which trains the model above: the same
    group (a frozen Linear, then a frozen Embedding) run twice in one forward,
    its ModuleList registered under two names (seed 31337)."""
    torch.manual_seed(0)
    m0 = Rerun()
    m0.register_parameter("weight", nn.Parameter(torch.randn(1, 1)))
    outer, inner = nn.ModuleList(), nn.ModuleList()
    m0.add_module("layers0", outer)
    outer.add_module("0", inner)
    lin, emb = nn.Linear(1, 1, bias=False), nn.Embedding(1, 1)
    inner.add_module("0", lin)
    inner.add_module("1", emb)
    lin.weight.requires_grad_(False)
    emb.weight.requires_grad_(False)
    m0.add_module("shared0", outer)  # the forward runs layers0 and shared0: the group twice
    m0.case_params, m0.case_buffers = ["weight"], []
    ref = copy.deepcopy(m0)
    fully_shard([lin, emb], reshard_after_forward=False)
    fully_shard(m0)
    x = torch.linspace(-1.0, 1.0, 2)
    (ref(x) ** 2).sum().backward()
    try:
        (m0(x) ** 2).sum().backward()
        d = (full(m0.weight.grad) - ref.weight.grad).abs().max().item()
        print(f"[rank {rank}] group run twice, reshard_after_forward=False: backward ran; |grad - reference| = {d:.3g}")
    except Exception as e:
        print(f"[rank {rank}] group run twice, reshard_after_forward=False: backward raised {type(e).__name__}: {str(e).splitlines()[0]}")
    if rank == 0:
        print("expected: backward runs, the root weight's gradient as the reference's")


if __name__ == "__main__":
    main()
