"""Hand-written CaseSpecs from the spec sources (the LoraModel of source 000)."""

from __future__ import annotations

from conformance.case.spec import CaseSpec, ClassSpec, ModuleSpec, ModuleWrap, ParamSpec, WrapPlan


def _linear(name: str, n_in: int, n_out: int, trainable: bool = True) -> ModuleSpec:
    return ModuleSpec(name, "Linear", (ParamSpec("weight", (n_out, n_in), trainable),))


def _layernorm(name: str, dim: int, trainable: bool = True) -> ModuleSpec:
    return ModuleSpec(name, "LayerNorm", (ParamSpec("weight", (dim,), trainable), ParamSpec("bias", (dim,), trainable)))


def lora_model(
    *,
    num_layers: int = 4,
    dim: int = 32,
    rank: int = 8,
    use_orig_params: bool = False,
    wrap_classes: tuple[str, ...] = ("LoraAttention", "LoraMLP", "LoraDecoder"),
    seed: int = 0,
) -> CaseSpec:
    """Spec source 000's LoraModel: only lora_A / lora_B trainable, so every
    LoraAttention unit mixes frozen and trainable parameters."""

    def layer(i: int) -> ModuleSpec:
        attn = ModuleSpec(
            "attn",
            "LoraAttention",
            children=(
                _linear("q_proj", dim, dim, False),
                _linear("lora_A", dim, rank, True),
                _linear("lora_B", rank, dim, True),
                _linear("k_proj", dim, dim, False),
                _linear("v_proj", dim, dim, False),
                _linear("o_proj", dim, dim, False),
            ),
        )
        mlp = ModuleSpec("mlp", "LoraMLP", children=(_linear("proj1", dim, 4 * dim, False), _linear("proj2", 4 * dim, dim, False)))
        return ModuleSpec(
            str(i), "LoraDecoder",
            children=(attn, mlp, _layernorm("inp_layernorm", dim, False), _layernorm("post_attn_layernorm", dim, False)),
        )

    tree = ModuleSpec(
        "",
        "LoraModel",
        children=(
            ModuleSpec("embed_tokens", "Embedding", (ParamSpec("weight", (100, dim), False),)),
            ModuleSpec("layers", "ModuleList", children=tuple(layer(i) for i in range(num_layers))),
            _layernorm("norm", dim, False),
        ),
    )
    classes = tuple(ClassSpec(n) for n in ("LoraModel", "LoraDecoder", "LoraAttention", "LoraMLP"))
    return CaseSpec(
        tree=tree,
        classes=classes,
        plan=WrapPlan(policy=ModuleWrap(wrap_classes), use_orig_params=use_orig_params),
        seed=seed,
    )
