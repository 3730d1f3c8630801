"""GPT-2 with its input embedding tied to the LM head (transformer.wte.weight
is lm_head.weight); generate() greedy-decodes a few tokens."""

from __future__ import annotations

from conformance.case.target import MethodCall, Target
from conformance.models.zoo._common import GENERATE_KWARGS, VOCAB, causal_lm_inputs, prompt, require_transformers, seeded

transformers = require_transformers()


def config():
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
        attn_implementation="eager",
        loss_type="ForCausalLM",
    )


def build(seed: int):
    return seeded(seed, lambda: transformers.GPT2LMHeadModel(config()))


target = Target(
    name="gpt2",
    factory=build,
    inputs=causal_lm_inputs,
    methods=(MethodCall("generate", kwargs=dict(GENERATE_KWARGS, pad_token_id=0), inputs=prompt),),
    wrap_classes=("GPT2Block",),
    trainable_patterns=(("bias",), ("ln_",)),  # BitFit; layer norms only
)
