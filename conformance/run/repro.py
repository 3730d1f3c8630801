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
        return model_script(case, violations, title)
    if title in CATALOG:
        area = area_of(title)
    else:
        area = next(a for a in reversed(AREAS) if a.applies(case))
    return area.repro(case, violations, title)
