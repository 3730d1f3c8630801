"""Llama with PEFT LoRA adapters on q_proj and v_proj: the base model is
frozen by PEFT, only the lora_A/lora_B weights train; generate() (PeftModel's,
which calls the base model's) greedy-decodes a few tokens. Untied embeddings
(Llama's default)."""

from __future__ import annotations

from conformance.case.target import MethodCall, Target
from conformance.models.zoo._common import GENERATE_KWARGS, VOCAB, causal_lm_inputs, prompt, require_transformers, seeded

transformers = require_transformers()
try:
    import peft
except ImportError as e:
    raise ImportError(f'the zoo needs peft (pip install -e ".[zoo]"): {e}') from None


def config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        attn_implementation="eager",
        loss_type="ForCausalLM",
    )


def lora_config():
    return peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        # PEFT's default makes lora_B zero, so the adapters would change
        # nothing and lora_A would get zero gradients: random B keeps every
        # parameter visible in the outputs the checks compare
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )


def build(seed: int):
    return seeded(seed, lambda: peft.get_peft_model(transformers.LlamaForCausalLM(config()), lora_config()))


target = Target(
    name="llama_lora",
    factory=build,
    inputs=causal_lm_inputs,
    methods=(MethodCall("generate", kwargs=dict(GENERATE_KWARGS, pad_token_id=0), inputs=prompt),),
    wrap_classes=("LlamaDecoderLayer",),
    trainable_patterns=(("lora_",), ("lora_", "norm")),
)
