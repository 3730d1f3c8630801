"""The zoo's targets (conformance/zoo/): deterministic factories, the ties and
shared modules each target promises, inputs that train, generate() that runs
unsharded and repeats itself."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers", reason='the zoo needs the optional extra: pip install -e ".[zoo]"')
torch = pytest.importorskip("torch")

from conformance.case.target import Target, default_loss, load_target  # noqa: E402

pytestmark = pytest.mark.selfcheck

NAMES = ("gpt2", "llama_lora", "t5", "bert")


def _needs(name: str) -> None:
    if name == "llama_lora":
        pytest.importorskip("peft", reason='the LoRA target needs peft: pip install -e ".[zoo]"')


@pytest.fixture(params=NAMES)
def target(request) -> Target:
    _needs(request.param)
    return load_target(f"conformance.models.zoo.{request.param}:target")


def _values(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_factory_is_deterministic(target):
    a, b, c = _values(target.factory(0)), _values(target.factory(0)), _values(target.factory(1))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "same seed, different values"
    # every randomly initialised tensor depends on the seed (norm weights, biases
    # and the like start constant)
    random = [k for k in a if a[k].numel() > 1 and a[k].float().std() > 0 and a[k].is_floating_point()]
    assert random, "no randomly initialised tensor"
    same = [k for k in random if torch.equal(a[k], c[k])]
    assert not same, f"seeds 0 and 1 give equal {same}"


def test_factory_leaves_global_rng_alone(target):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    target.factory(0)
    assert torch.equal(before, torch.get_rng_state())


def _tied_names(model) -> list[set[str]]:
    by_id: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), set()).add(name)
    return sorted((n for n in by_id.values() if len(n) > 1), key=sorted)


def _shared_modules(model) -> list[set[str]]:
    by_id: dict[int, set[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        by_id.setdefault(id(m), set()).add(name)
    return sorted((n for n in by_id.values() if len(n) > 1), key=sorted)


# What each target promises about its structure (its module docstring says so).
TIES = {
    "gpt2": [{"transformer.wte.weight", "lm_head.weight"}],
    "llama_lora": [],
    "t5": [{"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}],
    "bert": [
        {"bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"},
        {"cls.predictions.bias", "cls.predictions.decoder.bias"},
    ],
}
SHARED_MODULES = {"gpt2": [], "llama_lora": [], "t5": [{"shared", "encoder.embed_tokens", "decoder.embed_tokens"}], "bert": []}


def test_ties_and_shared_modules(target):
    model = target.factory(0)
    assert _tied_names(model) == sorted(TIES[target.name], key=sorted)
    assert _shared_modules(model) == sorted(SHARED_MODULES[target.name], key=sorted)
    if target.name == "gpt2":
        assert model.transformer.wte.weight is model.lm_head.weight
    if target.name == "t5":
        assert model.shared is model.encoder.embed_tokens is model.decoder.embed_tokens
        assert model.lm_head.weight is model.shared.weight
    if target.name == "bert":
        assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


def test_wrap_classes_are_in_the_model(target):
    model = target.factory(0)
    classes = {type(m).__name__ for m in model.modules()}
    assert target.wrap_classes and set(target.wrap_classes) <= classes
    counts = {c: sum(type(m).__name__ == c for m in model.modules()) for c in target.wrap_classes}
    assert all(n >= 2 for n in counts.values()), counts  # several units, not one


def test_trainable_patterns_match(target):
    model = target.factory(0)
    names = [n for n, _ in model.named_parameters()]
    for patterns in target.trainable_patterns:
        hit = [n for n in names if any(p in n for p in patterns)]
        assert 0 < len(hit) < len(names), f"{patterns} matches {len(hit)} of {len(names)} parameters"


def test_lora_freezes_the_base_model():
    _needs("llama_lora")
    model = load_target("conformance.models.zoo.llama_lora:target").factory(0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if "lora_" in n}
    assert {n.split(".")[-3] for n in trainable} == {"lora_A", "lora_B"}
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
    # random lora_B: the adapters change the output (PEFT's default zero B would not)
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


def test_inputs_train(target):
    model = target.factory(0)
    assert target.inputs(0).keys() == target.inputs(0).keys()
    assert all(torch.equal(v, target.inputs(0)[k]) for k, v in target.inputs(0).items())
    loss = (target.loss or default_loss)(model(**target.inputs(0)))
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable
    missing = [n for n, p in trainable if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    assert all(torch.isfinite(p.grad).all() for _, p in trainable)
    assert any(p.grad.abs().sum() > 0 for _, p in trainable)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_generate_is_deterministic(target):
    if target.name == "bert":
        assert target.methods == ()  # a masked LM: nothing to generate
        return
    (call,) = target.methods
    assert call.name == "generate" and call.kwargs["do_sample"] is False
    runs = []
    for _ in range(2):
        model = target.factory(0)
        with torch.no_grad():
            runs.append(getattr(model, call.name)(**call.kwargs, **call.inputs(0)))
    assert torch.equal(runs[0], runs[1])
    prompt = call.inputs(0)["input_ids"]
    assert runs[0].shape[0] == prompt.shape[0]
    new = runs[0] if target.name == "t5" else runs[0][:, prompt.shape[1] :]
    if target.name != "t5":
        assert torch.equal(runs[0][:, : prompt.shape[1]], prompt)
    assert new.shape[1] >= 2  # it decoded tokens (T5: the start token, then new ones)
    # greedy decoding on another model's weights gives other tokens: the
    # tokens show the weights, so a sharded model that is off shows too
    with torch.no_grad():
        other = getattr(target.factory(1), call.name)(**call.kwargs, **call.inputs(0))
    assert not torch.equal(runs[0], other)
