"""Test-only scenarios: a fault of tests/self/faults_fsdp2.py applied inside
each rank while a ModelCase runs (a monkeypatch in the driver does not reach
the pool's rank processes)."""

from __future__ import annotations

from conformance.engine.scenarios import scenario
from tests.self.faults_fsdp2 import FAULTS


def _faulty(name: str, kind: str):
    def run(case) -> dict:
        from conformance.areas.fully_shard.adapter import observe_fsdp2
        from conformance.areas.parity.adapter import observe_train

        observe = {"fsdp2": observe_fsdp2, "train": observe_train}[kind]
        with FAULTS[name]():
            return observe(case).to_dict()

    run.__name__ = run.__qualname__ = f"model_faulty_{kind}_{name}".replace("-", "_")
    return run


for _kind in ("fsdp2", "train"):
    _fn = _faulty("gradients-doubled", _kind)
    globals()[_fn.__name__] = _fn
    scenario(f"model-fault:{_kind}:gradients-doubled", test_only=True)(_fn)
