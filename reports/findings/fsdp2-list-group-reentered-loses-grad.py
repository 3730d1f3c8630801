"""Finding: fsdp2-list-group-reentered-loses-grad

A module of a fully_shard([a, b]) group run again after the group completed
its forward (a, b, a), where the module that completed it (b, a frozen
Embedding) gives an output that needs no gradient, loses the gradient of its
earlier run: the trainable bias of `a` ends with grad None (Linear), or
backward raises "The tensor has a non-zero number of elements, but its data is
not allocated yet" (LayerNorm, whose backward reads the resharded weight). A
trainable b (control) trains as the unsharded model does. Mechanism: the
group's pre-backward hook goes only on the output of the forward that
completes the group (b's, which needs no gradient) or, for the re-run left
incomplete, on the root's output; the re-run registers a second post-backward
hook, which fires once a's second run is through backward, before the shared
parameter's AccumulateGrad has the first run's gradient; finalize_backward
then drops the unsharded gradient.

Run: python fsdp2-list-group-reentered-loses-grad.py
Run: torchrun --nproc-per-node 2 fsdp2-list-group-reentered-loses-grad.py
"""

import copy
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


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


class Model(nn.Module):
    def __init__(self, layer, b_trains):
        super().__init__()
        self.a = nn.Sequential(layer)
        layer.weight.requires_grad_(False)  # only a's bias trains
        self.b = nn.Embedding(1, 2)
        self.b.weight.requires_grad_(b_trains)

    def forward(self, x):
        x = self.a(x)  # a runs: group [a, b] not complete yet
        x = x + self.b(torch.zeros(x.shape[0], dtype=torch.long))  # b completes the group
        return self.a(x)  # a runs again, later in the same iteration


def run(make_layer, b_trains):
    torch.manual_seed(0)  # the same model on every rank
    model = Model(make_layer(), b_trains)
    ref = copy.deepcopy(model)
    fully_shard([model.a, model.b])
    fully_shard(model)
    x = torch.linspace(-1.0, 1.0, 8).reshape(4, 2)  # the same on every rank
    try:
        model(x).pow(2).sum().backward()
    except RuntimeError as e:
        return f"backward raised RuntimeError: {str(e).splitlines()[0]}"
    ref(x).pow(2).sum().backward()
    g, want = model.a[0].bias.grad, ref.a[0].bias.grad
    if g is None or not torch.allclose(g.full_tensor(), want, atol=1e-5):
        return f"a's bias grad is {None if g is None else g.full_tensor().tolist()}, the unsharded model's {want.tolist()}"
    return None


def main():
    init()
    wrong = [f"{name}: {r}" for name, make, b_trains in (("Linear, frozen b", lambda: nn.Linear(2, 2), False),
                                                          ("LayerNorm, frozen b", lambda: nn.LayerNorm(2), False),
                                                          ("Linear, trainable b (control)", lambda: nn.Linear(2, 2), True))
             if (r := run(make, b_trains))]
    finish(wrong and f"a [a, b] group with a run again after b completed it: {'; '.join(wrong)}",
           "a's gradient equals the unsharded model's in every case")


if __name__ == "__main__":
    main()
