"""The zoo: tiny random-weight Hugging Face models as Targets.

Each model is built in-process from a config (no hub download, no network),
deterministic from the seed, dropout off, eager attention, vocabulary 128,
hidden size 32, two layers: one FSDP example costs milliseconds. They need the
optional extra (``pip install -e ".[zoo]"``: transformers 4.57.6, peft).
Load one by name: ``conformance.case.target.load_target("conformance.models.zoo.gpt2:target")``.

What each holds, and what real FSDP (torch 2.13.0 and 2.14.1, gloo, 2 ranks)
did with it when checked by hand:

gpt2 (GPT2LMHeadModel, 30,592 parameters; wrap class GPT2Block x2)
    Tie: transformer.wte.weight is lm_head.weight. generate(): greedy, 4 new
    tokens; it calls self() for every token.
    FSDP1 ModuleWrapPolicy({GPT2Block}), either use_orig_params: units root +
    2 blocks, the tie stays in the root unit, loss and state_dict keys equal
    the unwrapped model's, generate() under summon_full_params(recurse=False)
    gives the reference's tokens. BitFit (train "bias"): the blocks get the
    promised ValueError / one UserWarning each (12,704 numel instead of 352);
    the root unit (wte, wpe, ln_f) is mixed too and is not checked
    (fsdp1-root-unit-frozen-not-validated).
    FSDP2 fully_shard per block + root: tokens equal the reference's; with
    generate registered on the root (reshard_after_forward False) every
    parameter is sharded after generate() (fsdp2-forward-method-calls-self);
    unregistered, the root stays unsharded as promised.

llama_lora (PeftModelForCausalLM over LlamaForCausalLM, 27,680 parameters, 896
    trainable; wrap class LlamaDecoderLayer x2)
    LoRA r=4 on q_proj and v_proj with random lora_B; PEFT freezes the rest.
    No ties (Llama's default). generate(): PeftModel.generate calls the
    inner LlamaForCausalLM, not the root's forward.
    FSDP1 ModuleWrapPolicy({LlamaDecoderLayer}): use_orig_params=False raises
    the promised ValueError naming base_model.model.model.layers.0 with its 4
    trainable and 9 frozen FQNs; True warns once per layer (9,728 numel
    instead of 448), then trains and matches the reference. PEFT's own
    fsdp_auto_wrap_policy (LoRA leaves as units) with use_orig_params=True on
    one rank (NO_SHARD): state_dict() raises after one backward
    (fsdp1-no-shard-frozen-unit-params-unregistered).
    FSDP2 per layer + root, generate registered: tokens equal, root stays
    unsharded afterwards as promised (the method does not re-enter the root).

t5 (T5ForConditionalGeneration, 45,504 parameters; wrap class T5Block x4;
    T5Stack x2 as a coarser choice)
    One module `shared`, also registered as encoder.embed_tokens and
    decoder.embed_tokens; lm_head.weight is shared.weight. generate(): the
    encoder once, then the decoder greedily (calls self()).
    FSDP1 ModuleWrapPolicy({T5Block}): the shared embedding stays in the root
    unit; loss, state_dict and generate tokens equal the reference's.
    ModuleWrapPolicy({T5Stack}): the shared parameter goes to the encoder
    unit, below its users' common ancestor, silently
    (fsdp1-tie-below-lca-not-rejected); forward then fails in the decoder
    ("setStorage ... storage of size 0" / "'weight' must be 2-D"); with
    use_orig_params=False lm_head.weight is flattened again into the root
    (fsdp1-tied-param-flattened-twice) and state_dict() lacks shared.weight
    and decoder.embed_tokens.weight (fsdp1-shared-module-state-dict-drops-aliases).
    FSDP2 per T5Block + root: tokens equal; registered generate leaves the
    root sharded (fsdp2-forward-method-calls-self). Per T5Stack: fully_shard
    fails with "TypeError: Invariant encountered: value was None"
    (fsdp2-shared-module-across-groups).

bert (BertForMaskedLM, 23,584 parameters; wrap class BertLayer x2)
    Ties: cls.predictions.decoder.weight is bert.embeddings.word_embeddings.weight;
    cls.predictions.decoder.bias is cls.predictions.bias. No generate().
    FSDP1 ModuleWrapPolicy({BertLayer}), either use_orig_params: both ties in
    the root unit, loss and state_dict keys equal; BitFit warns per layer
    (8,544 numel instead of 288), the mixed root unit unchecked
    (fsdp1-root-unit-frozen-not-validated). FSDP2 per layer + root: loss and
    gradients equal the reference's, with or without BitFit.
"""
