"""Spec source 000's LoraModel, by hand: the traversal orders it lists, and the
error (use_orig_params=False) and warnings (use_orig_params=True) it promises.
Exact texts are expecttest snapshots: update with EXPECTTEST_ACCEPT=1."""

import expecttest
import pytest

from conformance.areas.autowrap.adapter import post_order_names
from conformance.case.build import build
from conformance.case.examples import lora_model
from conformance.case.graph import ModelGraph
from conformance.engine.fake import FakeEngine
from conformance.run.runner import evaluate, observations

pytestmark = pytest.mark.fake


def _layer(i, reverse=False):
    p = f"layers.{i}"
    names = [f"{p}.attn.{n}" for n in ("q_proj", "lora_A", "lora_B", "k_proj", "v_proj", "o_proj")] + [f"{p}.attn"]
    names += [f"{p}.mlp.proj1", f"{p}.mlp.proj2", f"{p}.mlp", f"{p}.inp_layernorm", f"{p}.post_attn_layernorm", p]
    if not reverse:
        return names
    mlp = [f"{p}.mlp.proj2", f"{p}.mlp.proj1", f"{p}.mlp"]
    attn = [f"{p}.attn.{n}" for n in ("o_proj", "v_proj", "k_proj", "lora_B", "lora_A", "q_proj")] + [f"{p}.attn"]
    return [f"{p}.post_attn_layernorm", f"{p}.inp_layernorm"] + mlp + attn + [p]


# Spec source 000: "Reverse topological order with stack-based DFS via named_children()"
DFS_ORDER = ["embed_tokens"] + sum((_layer(i) for i in range(4)), []) + ["layers", "norm", ""]
# Spec source 000: "Reverse topological order with named_modules()"
NAMED_MODULES_ORDER = ["norm"] + sum((_layer(i, True) for i in (3, 2, 1, 0)), []) + ["layers", "embed_tokens", ""]


def test_oracle_post_order_is_spec_source_000s():
    g = ModelGraph(lora_model())
    assert [g.module_path[n] for n in g.post_order()] == DFS_ORDER


def test_torch_post_order_is_spec_source_000s():
    assert post_order_names(build(lora_model()).model) == DFS_ORDER


def test_reverse_named_modules_is_the_order_spec_source_000_rejects():
    assert [n for n, _ in build(lora_model()).model.named_modules()][::-1] == NAMED_MODULES_ORDER


class TestLoraMessages(expecttest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.engine = FakeEngine(world_size=4)

    def observe(self, use_orig_params):
        spec = lora_model(use_orig_params=use_orig_params)
        return spec, observations(self.engine, spec)

    def test_error_use_orig_params_false(self):
        spec, obs = self.observe(False)
        err = obs[0].error
        self.assertEqual(err.category, "ValueError")
        self.assertEqual(err.module, "layers.0.attn")
        self.assertEqual(err.trainable, ("layers.0.attn.lora_A.weight", "layers.0.attn.lora_B.weight"))
        self.assertEqual(evaluate("FROZEN-ERROR", spec, obs).verdict, "PASS")
        self.assertExpectedInline(err.text, """\
layers.0.attn has both parameters with requires_grad=True and False. FSDP does not support wrapping such modules when use_orig_params=False. If possible, wrap the frozen parameters with FSDP separately.
The following parameters have requires_grad=True:
['layers.0.attn.lora_A.weight', 'layers.0.attn.lora_B.weight']
The following parameters have requires_grad=False:
['layers.0.attn.q_proj.weight', 'layers.0.attn.k_proj.weight', 'layers.0.attn.v_proj.weight', 'layers.0.attn.o_proj.weight']""")

    def test_warnings_use_orig_params_true(self):
        spec, obs = self.observe(True)
        warnings = obs[0].warnings
        self.assertEqual([w.module for w in warnings], [f"layers.{i}.attn" for i in range(4)])
        self.assertEqual({(w.total_numel, w.trainable_numel) for w in warnings}, {(4 * 32 * 32 + 2 * 32 * 8, 2 * 32 * 8)})  # q,k,v,o frozen; lora_A, lora_B trainable
        self.assertEqual(evaluate("FROZEN-WARN", spec, obs).verdict, "PASS")
        self.assertExpectedInline(warnings[0].text, """\
layers.0.attn has both parameters with requires_grad=True and False. We do not recommend wrapping such modules since the gradient memory usage will be higher than expected (4608 numel instead of 512 numel before sharding via reduce-scatter). If possible, wrap the frozen parameters with FSDP separately.
The following parameters have requires_grad=True:
['layers.0.attn.lora_A.weight', 'layers.0.attn.lora_B.weight']
The following parameters have requires_grad=False:
['layers.0.attn.q_proj.weight', 'layers.0.attn.k_proj.weight', 'layers.0.attn.v_proj.weight', 'layers.0.attn.o_proj.weight']""")
