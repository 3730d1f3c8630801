"""WRAP-*: FSDP1 auto-wrapping puts every parameter in the unit the policy says.

Spec: spec-sources/000 (post-order wrapping; ezyang's invariant that the
pre-wrap simulation agrees with the wrapped model) and the
FullyShardedDataParallel docstring (auto_wrap_policy, ignored_modules).
"""

import pytest
from hypothesis import given

from conformance.run import corpus
from strategies import case_specs


@pytest.mark.parametrize("invariant_id", ["WRAP-UNITS", "WRAP-FQNS", "WRAP-EXACTLY-ONCE", "WRAP-STATE-DICT", "WRAP-KWARGS"])
@corpus.examples("WRAP-UNITS", "WRAP-FQNS", "WRAP-EXACTLY-ONCE", "WRAP-STATE-DICT", "WRAP-KWARGS")
@given(spec=case_specs())
def test_invariant(invariant_id, spec, engine, conformance):
    conformance.check(invariant_id, spec, engine, engine.tier)
