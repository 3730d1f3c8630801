# fsdp2-list-group-reentered-loses-grad: a module of a fully_shard([a, b]) group
# run again after the group completed its forward (a, b, a), where the module
# that completed it (b, a frozen Embedding) gives an output that needs no
# gradient, loses the gradient of its earlier run: the trainable bias of `a`
# ends with grad None (Linear), or backward raises "The tensor has a non-zero
# number of elements, but its data is not allocated yet" (LayerNorm, whose
# backward reads the resharded weight). A trainable b (control) trains as the
# unsharded model does.
# Mechanism: the group's pre-backward hook goes only on the output of the
# forward that completes the group (b's, which needs no gradient) or, for the
# re-run left incomplete, on the root's output; the re-run registers a second
# post-backward hook, which fires once a's second run is through backward,
# before the shared parameter's AccumulateGrad has the first run's gradient.
# The group stays POST_BACKWARD, so the root's final callback does not reduce
# again and finalize_backward drops the unsharded gradient.
# checked: torch 2.13.0+cpu, 2.14.1+cu130 (python repro.py; torchrun --nproc-per-node 2 repro.py),
# 2.12.1 (python: both forms), 2.8.0 (python: the LayerNorm form raises, the Linear form trains)
# run: python repro.py   or   torchrun --nproc-per-node 2 repro.py

import copy, os, socket, sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard

class A(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.layer.weight.requires_grad_(False)  # only the bias trains
    def forward(self, x):
        return self.layer(x)

class Model(nn.Module):
    def __init__(self, layer, b_trains):
        super().__init__()
        self.a = A(layer)
        self.b = nn.Embedding(1, 2)
        self.b.weight.requires_grad_(b_trains)
    def forward(self, x):
        x = self.a(x)                      # a runs: group [a, b] not complete yet
        x = x + self.b(torch.zeros(x.shape[0], dtype=torch.long))  # b completes the group
        return self.a(x)                   # a runs again, later in the same iteration

def run(name, make_layer, b_trains=False):
    torch.manual_seed(0)  # the same model on every rank
    model = Model(make_layer(), b_trains)
    ref = copy.deepcopy(model)
    fully_shard([model.a, model.b])
    fully_shard(model)
    x = torch.linspace(-1.0, 1.0, 8).reshape(4, 2)  # the same on every rank
    try:
        model(x).pow(2).sum().backward()
    except RuntimeError as e:
        print(f"{name}: backward raised RuntimeError: {str(e).splitlines()[0]}")
        return
    ref(x).pow(2).sum().backward()
    g = model.a.layer.bias.grad
    print(f"{name}: a.layer.bias.grad = {None if g is None else g.full_tensor().tolist()}, "
          f"unsharded reference {ref.a.layer.bias.grad.tolist()}")

if __name__ == "__main__":
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    run("Linear, frozen b", lambda: nn.Linear(2, 2))
    run("LayerNorm, frozen b", lambda: nn.LayerNorm(2))
    run("Linear, trainable b (control)", lambda: nn.Linear(2, 2), b_trains=True)
    dist.destroy_process_group()
