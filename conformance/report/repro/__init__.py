"""Standalone reproduction scripts for a case and its violations: torch-only,
one generator module per FSDP API (fsdp1, fsdp2; shared model-building code in
common), or a replay through this suite where no generator fits."""

from __future__ import annotations

from conformance.report.repro.fsdp1 import fsdp1_script
from conformance.report.repro.fsdp2 import fsdp2_script
from conformance.case.spec import CaseSpec

# API -> fn(spec, violations, title) -> script: the torch-only generator for
# cases of that API, one module per API.
GENERATORS: dict = {"fsdp1": fsdp1_script, "fsdp2": fsdp2_script}


def repro_script(spec: CaseSpec, violations: list | None = None, title: str = "") -> str:
    """The standalone repro script of a case: torch-only where a generator
    exists for its API, else one that replays the case through this suite.
    A real model's case (ModelCase) has its own generator, training included."""
    from conformance.case.model_case import ModelCase

    if isinstance(spec, ModelCase):
        from conformance.report.repro.models import model_script

        return model_script(spec, violations, title)
    api = getattr(spec.plan, "api", "fsdp1")
    if getattr(spec, "ckpt", None) is not None:  # lifecycle (checkpoint) cases
        from conformance.report.repro.checkpoint import ckpt_script

        return ckpt_script(spec, violations, title)
    if getattr(spec, "schedule", None) is not None:  # --- training schedules (MP-DTYPES, ACCUM) ---
        from conformance.report.repro.schedule import schedule_script

        return schedule_script(spec, violations, title)
    gen = GENERATORS.get(api)
    # the torch-only generators build, wrap and call; they do not train: a
    # PARITY case replays through the suite
    if gen is not None and getattr(spec, "train", None) is None:
        return gen(spec, violations, title)
    return suite_script(spec, violations, title)


def suite_script(spec: CaseSpec, violations: list | None = None, title: str = "") -> str:
    """A script that replays the case with fsdp-conformance installed (for an
    API that has no torch-only generator yet): checks ``title``'s invariant,
    or every invariant of the case's API, on the fake tier or $BACKEND."""
    import torch

    head = [
        f"# fsdp-conformance reproduction{': ' + title if title else ''} ({spec.plan.api})",
        f"# found with torch {torch.__version__}",
        f"# no torch-only generator for API {spec.plan.api!r} yet: this script replays the case through fsdp-conformance",
    ]
    head += [f"# {v}" for v in violations or ()]
    head.append("# run: python repro.py   (BACKEND=gloo WORLD_SIZE=2 python repro.py for a rank pool)")
    inv = title if title and title.upper() == title and " " not in title else ""
    body = f'''
import os
import sys
import tempfile

from conformance.cli import main

CASE = {spec.to_json()!r}
INVARIANT = {inv!r}

if __name__ == "__main__":
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(CASE)
    args = ["check", f.name, "--backend", os.environ.get("BACKEND", "fake"), "--world-size", os.environ.get("WORLD_SIZE", "4")]
    sys.exit(main(args + (["--invariant", INVARIANT] if INVARIANT else [])))
'''
    return "\n".join(head) + "\n" + body
