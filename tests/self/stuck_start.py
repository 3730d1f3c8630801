"""Preloaded by a test's fork server: rank 0 forked from it hangs in
init_process_group while the file named by $FSDP_CONFORMANCE_STUCK_ONCE does
not exist yet (it creates it, then sleeps), or always where that variable
says "always"; the other ranks wait for it in the real one (test_engine: a
start that times out is tried once more, and its error says where the rank
was)."""

import os
import time

import torch.distributed as dist

_real = dist.init_process_group


def _stuck_in_init(*args, **kwargs):
    marker = os.environ.get("FSDP_CONFORMANCE_STUCK_ONCE", "always")
    if os.environ.get("RANK") == "0" and (marker == "always" or not os.path.exists(marker)):
        if marker != "always":
            open(marker, "w").close()
        while True:
            time.sleep(0.05)
    return _real(*args, **kwargs)


dist.init_process_group = _stuck_in_init
