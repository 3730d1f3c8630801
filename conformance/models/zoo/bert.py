"""BERT masked LM: the decoder of the MLM head (cls.predictions.decoder.weight)
is tied to the input embedding (bert.embeddings.word_embeddings.weight), and
its bias is cls.predictions.bias. No generate()."""

from __future__ import annotations

import torch

from conformance.case.target import Target
from conformance.models.zoo._common import VOCAB, require_transformers, seeded, tokens

transformers = require_transformers()


def config():
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )


def build(seed: int):
    return seeded(seed, lambda: transformers.BertForMaskedLM(config()))


MASK_ID = 2


def inputs(seed: int) -> dict:
    ids = tokens(seed)
    g = torch.Generator().manual_seed(seed + 1)
    masked = torch.rand(ids.shape, generator=g) < 0.3
    masked[:, 0] = True  # at least one masked position per row: the loss is never empty
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return {
        "input_ids": torch.where(masked, torch.full_like(ids, MASK_ID), ids),
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "labels": labels,
    }


target = Target(
    name="bert",
    factory=build,
    inputs=inputs,
    wrap_classes=("BertLayer",),
    trainable_patterns=(("bias",), ("cls.",)),
)
