"""Shared pieces of the zoo's targets: seeded construction and token inputs."""

from __future__ import annotations

import torch

VOCAB = 128
BATCH, SEQ = 2, 8  # one example's forward costs a few milliseconds


def seeded(seed: int, build):
    """Build under torch's global RNG seeded with ``seed``, leaving the
    caller's RNG state as it was (HF initialises weights from the global RNG)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.eval()  # dropout is configured off too; eval() makes it certain


def tokens(seed: int, shape=(BATCH, SEQ), low: int = 3, high: int = VOCAB) -> torch.Tensor:
    """Token ids in [low, high): the ids below 3 are kept for pad/bos/eos so
    that generate() never stops early on an id the inputs happen to contain."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g)


def require_transformers():
    """Import transformers, or say how to get it (the zoo is an optional extra)."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f'the zoo needs transformers (pip install -e ".[zoo]"): {e}') from None
    return transformers


def causal_lm_inputs(seed: int) -> dict:
    """forward kwargs of a causal LM: the labels are the inputs (HF shifts them)."""
    ids = tokens(seed)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def prompt(seed: int) -> dict:
    """generate kwargs: a prompt without labels."""
    ids = tokens(seed, (BATCH, SEQ // 2))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


# Greedy decoding of a few tokens: deterministic, so the sharded model's tokens
# must equal the unsharded model's exactly. A random tied-embedding model
# greedily repeats its last token (its logits favour the input embedding);
# no_repeat_ngram_size=1 makes every step depend on the logits' ranking below
# the top, so a wrong value anywhere in the model changes the tokens.
GENERATE_KWARGS = {"max_new_tokens": 4, "do_sample": False, "num_beams": 1, "no_repeat_ngram_size": 1}
