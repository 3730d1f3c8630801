"""T5 (encoder-decoder): one embedding module, `shared`, registered also as
encoder.embed_tokens and decoder.embed_tokens, and tied to lm_head.weight;
generate() runs the encoder once and greedy-decodes a few tokens."""

from __future__ import annotations

import torch

from conformance.case.target import MethodCall, Target
from conformance.models.zoo._common import BATCH, GENERATE_KWARGS, SEQ, VOCAB, prompt, require_transformers, seeded, tokens

transformers = require_transformers()


def config():
    return transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        feed_forward_proj="relu",
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        attn_implementation="eager",
    )


def build(seed: int):
    return seeded(seed, lambda: transformers.T5ForConditionalGeneration(config()))


def inputs(seed: int) -> dict:
    ids = tokens(seed)
    # labels: the decoder's targets (T5 shifts them right into decoder_input_ids)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": tokens(seed + 1, (BATCH, SEQ // 2))}


target = Target(
    name="t5",
    factory=build,
    inputs=inputs,
    methods=(MethodCall("generate", kwargs=dict(GENERATE_KWARGS), inputs=prompt),),
    wrap_classes=("T5Block",),
    trainable_patterns=(("decoder.",), ("layer_norm",)),
)
