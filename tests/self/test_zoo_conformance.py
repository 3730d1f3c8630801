"""CI's zoo budget: every applicable invariant on each zoo model (fake tier,
two drawn plans each, a fixed seed), green on the installed torch with the
recorded findings KNOWN. `fsdp-conformance model TARGET` runs the same with
any budget and on the gloo pool."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the zoo needs the zoo extra (pip install -e '.[zoo]')")
pytest.importorskip("peft", reason="the zoo needs the zoo extra (pip install -e '.[zoo]')")

from conformance import check_model  # noqa: E402

pytestmark = [pytest.mark.selfcheck, pytest.mark.fake]

ZOO = [
    "gpt2",
    "llama_lora",  # PEFT's lora.Linear shares torch's class name: classes go by qualified name
    "t5",
    "bert",
]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_holds_every_applicable_invariant(name):
    run = check_model(f"conformance.models.zoo.{name}:target", tiers=("fake",), examples=2, seed=0)
    assert run.checked, f"no invariant ran on {name}"
    assert run.ok, run.summary() + "\n" + "\n".join(f["message"] for f in run.failures)
