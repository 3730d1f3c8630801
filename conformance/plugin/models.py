"""The fsdp_model fixture and marker of the pytest plugin (conformance.plugin,
entry point pytest11): run the conformance invariants on a project's own
model from its own test suite.

    @pytest.mark.fsdp_model("mypkg.model:target", invariants=["wrap", "FWD-PARITY"], examples=5)
    def test_fsdp(fsdp_model):
        fsdp_model.check()            # raises AssertionError naming every failing invariant

The marker sets the defaults (target, invariants, tiers, examples, seed);
``fsdp_model.check(...)`` takes the same keyword arguments to override them
and returns the conformance.run.models.ModelRun. A target that cannot be used
fails the test with one line (conformance.case.target.TargetError)."""

from __future__ import annotations

import pytest

MARKER = "fsdp_model"
_KEYS = ("target", "invariants", "tiers", "examples", "seed", "world_size", "fake_world_size", "deadline")


# the gloo pool: real collectives, so that the value invariants compare values
# ("fake", the in-process tier, checks structure only)
DEFAULT_TIERS = ("gloo",)
MARKER_DOC = (
    f"{MARKER}(target, invariants=None, tiers={DEFAULT_TIERS!r}, examples=5, seed=None): "
    "the real model (a conformance.Target, 'package.module:attr') the fsdp_model fixture checks"
)


class ModelChecker:
    """The fsdp_model fixture's value."""

    def __init__(self, defaults: dict, tmp_path) -> None:
        self.defaults = defaults
        self.tmp_path = tmp_path
        self.runs: list = []

    def check(self, target: str | None = None, **kwargs):
        from conformance.run.models import check_model

        opts = {"tiers": DEFAULT_TIERS, "examples": 5, **self.defaults, **kwargs}
        if target is not None:
            opts["target"] = target
        bad = sorted(set(opts) - set(_KEYS))
        if bad:
            raise TypeError(f"fsdp_model.check() got unknown options {bad}; known: {', '.join(_KEYS)}")
        if not opts.get("target"):
            raise pytest.UsageError(f"fsdp_model: no target; give @pytest.mark.{MARKER}('pkg.module:attr') or check(target=...)")
        from conformance.areas import UnknownInvariant
        from conformance.case.target import TargetError

        tgt = opts.pop("target")
        try:
            run = check_model(tgt, repro_dir=self.tmp_path / "repros", **opts)
        except (TargetError, UnknownInvariant) as e:  # bad input: one line, no traceback
            pytest.fail(f"fsdp_model: {e}" if isinstance(e, UnknownInvariant) else str(e), pytrace=False)
        except ValueError as e:  # an unknown tier
            pytest.fail(f"fsdp_model: {e}", pytrace=False)
        self.runs.append(run)
        if not run.ok:
            raise AssertionError(run.summary())
        return run


@pytest.fixture
def fsdp_model(request, tmp_path):
    marker = request.node.get_closest_marker(MARKER)
    defaults: dict = {}
    if marker is not None:
        if marker.args:
            defaults["target"] = marker.args[0]
        defaults.update(marker.kwargs)
    return ModelChecker(defaults, tmp_path)
