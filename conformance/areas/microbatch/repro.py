"""The microbatch area's reproduction: the suite's own scenario on the spec
(a torch-only script per finding lives in reports/findings/)."""

from __future__ import annotations

from conformance.areas.common.repro import suite_script


def microbatch_script(spec, violations: list | None = None, title: str = "") -> str:
    return suite_script(spec, violations, title)
