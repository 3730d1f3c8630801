"""The standalone repro script of a case: its area's generator (torch-only
where the area has one, else a replay through this suite), or, for a real
model's case, the model repro that imports the target."""

from __future__ import annotations

from conformance.areas import AREAS, CATALOG, area_of
from conformance.case.model_case import ModelCase
from conformance.models.repro import model_script


def repro_script(case, violations: list | None = None, title: str = "") -> str:
    """``title``: the invariant the script is for (its area's generator),
    or a name; without an invariant, the most specific area the case is
    one of (a checkpoint case: checkpoint's)."""
    if isinstance(case, ModelCase):
        if case.ckpt is not None or case.schedule is not None:
            return model_lifecycle_script(case, violations, title)
        return model_script(case, violations, title)
    if title in CATALOG:
        area = area_of(title)
    else:
        area = next(a for a in reversed(AREAS) if a.applies(case))
    return area.repro(case, violations, title)


def model_lifecycle_script(case: ModelCase, violations: list | None = None, title: str = "") -> str:
    """A real model's checkpoint or schedule case: the model repro rebuilds
    wrapping, calls and training only, so this script replays the case
    through fsdp-conformance's `check` on real ranks (gloo by default: the
    lifecycle compares values and world sizes), run from where the
    target's package imports."""
    head = [f"# fsdp-conformance reproduction{': ' + title if title else ''} ({case.target}, {case.plan.api}, "
            + ("checkpoint" if case.ckpt is not None else "training schedule") + ")"]
    head += [f"# {v}" for v in violations or ()]
    head.append("# run: python THIS.py from where the target imports (BACKEND=nccl WORLD_SIZE=2 for GPUs)")
    inv = title if title in CATALOG else ""
    body = f'''
import os
import sys
import tempfile

sys.path.insert(0, os.getcwd())  # the target is the user's code, importable from here
from conformance.cli import main

CASE = {case.to_json()!r}
INVARIANT = {inv!r}

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:  # the case file goes with it
        path = os.path.join(tmp, "case.json")
        with open(path, "w") as f:
            f.write(CASE)
        args = ["check", path, "--backend", os.environ.get("BACKEND", "gloo"), "--world-size", os.environ.get("WORLD_SIZE", "2")]
        rc = main(args + (["--invariant", INVARIANT] if INVARIANT else []))
    sys.exit(rc)
'''
    return "\n".join(head) + "\n" + body
