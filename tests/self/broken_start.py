"""Preloaded by a test's fork server: every rank forked from it fails to
join its process group (test_engine: a failed start names its cause)."""

import torch.distributed as dist


def _refuse(*args, **kwargs):
    raise RuntimeError("injected: this rank cannot join its group")


dist.init_process_group = _refuse
