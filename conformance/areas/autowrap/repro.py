"""Standalone, torch-only reproduction scripts for FSDP1 cases: build the case,
wrap it with FullyShardedDataParallel, compare what FSDP did with what the
spec says it must do (the oracle's prediction, embedded), and print the
verdict (the convention: conformance/run/repros.py). Only the checks and
imports the case needs are emitted."""

from __future__ import annotations

import textwrap

from conformance.areas.common.fsdp1_oracle import predict_fsdp1
from conformance.areas.common.repro import (
    DEFAULT_MODES,
    HARNESS,
    assemble,
    class_code,
    from_import,
    header,
    model_lines,
    policy_code,
    policy_imports,
)
from conformance.case.spec import CaseSpec, CustomWrap, ModuleWrap

_FIRST_NAMES = '''
def first_names(model):
    """id(module or parameter) -> its first name in the unwrapped model, and
    each of its names -> the first (FSDP and torch's messages may use any)."""
    first, alias = {}, {}
    for name, obj in [*model.named_modules(remove_duplicate=False), *model.named_parameters(remove_duplicate=False)]:
        alias[name] = first.setdefault(id(obj), name)
    return first, alias
'''

_FROZEN_MESSAGE = '''
def frozen_message(text, alias):
    """torch's frozen-parameter error or warning, parsed: (module, trainable,
    frozen, total numel, trainable numel), first names; None for another text."""
    m = re.match(r"(.*?) has both parameters with requires_grad=True and False\\.(.*)requires_grad=True:\\n(\\[.*?\\])\\n"
                 r".*requires_grad=False:\\n(\\[.*?\\])\\s*$", text, re.S)
    if m is None:
        return None
    n = re.search(r"\\((\\d+) numel instead of (\\d+) numel", m[2])
    trainable, frozen = (sorted(alias.get(f, f) for f in ast.literal_eval(s)) for s in (m[3], m[4]))
    return (alias.get(m[1], m[1]), trainable, frozen, *(map(int, n.groups()) if n else (None, None)))
'''

_SIMULATE = '''
def simulate(model, policy, first):
    """What torch's pre-wrap check (_validate_frozen_params) takes each unit to manage."""
    from torch.distributed.fsdp._wrap_utils import _get_managed_param_to_fqn, _get_post_order_named_modules

    targets = set(policy._run_policy(model, set(), {})) | {model}
    visited, out = set(), {}
    for name, module in _get_post_order_named_modules(model):
        if module in targets:
            out[first[id(module)]] = sorted(first[id(p)] for p in _get_managed_param_to_fqn(module, set(), visited, name))
    return out
'''

_ATTR = '''
def attr(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)  # FSDP1 forwards attribute access to the wrapped module
    return obj
'''

_UNITS = '''
def units(fsdp, first, alias):
    """(unit path, the first names of the parameters it manages), in creation order."""
    out = []
    for unit in FSDP.fsdp_modules(fsdp):
        path = first[id(unit.module)]
        fqns = unit._handle.flat_param._fqns if unit._handle else ()
        out.append((path, sorted(alias[f"{path}.{f}" if path else f] for f in fqns)))
    return out
'''


def _where(path: str) -> str:
    return path or "<root>"


def build_code(spec: CaseSpec) -> tuple[str, str]:
    """Source of `build()` returning (model, policy), torch-only, and the
    FSDP keyword arguments the case adds (its ignored modules / states)."""
    lines, var = model_lines(spec)
    lines.append(policy_code(spec, var))
    lines.append("return m0, policy")
    kw = ""
    if spec.plan.ignored_modules:
        kw += ", ignored_modules=[" + ", ".join(f"model.get_submodule({p!r})" for p in spec.plan.ignored_modules) + "]"
    if spec.plan.ignored_params:
        kw += ", ignored_states=[" + ", ".join(f"model.get_parameter({f!r})" for f in spec.plan.ignored_params) + "]"
    return "def build():\n" + textwrap.indent("\n".join(lines), "    ") + "\n", kw


def expected_text(spec: CaseSpec) -> str:
    pred = predict_fsdp1(spec)
    lines = ["Expected (the oracle, from the FSDP spec):"]
    if pred.error is not None:
        u = pred.error
        lines.append(f"  ValueError naming {_where(u.path)}: trainable {list(u.trainable)}, frozen {list(u.frozen)}")
    else:
        for u in pred.units:
            lines.append(f"  FSDP unit {_where(u.path)!r} manages {list(u.managed)}")
        for u in pred.warnings:
            lines.append(f"  UserWarning for {_where(u.path)}: {u.total_numel} numel instead of {u.trainable_numel}")
        for t in pred.ties:
            if t.below_lca:
                lines.append(f"  an error: tied {t.fqn} would live in unit {_where(t.unit)}, below the common ancestor {_where(t.lca)}")
    return "\n".join(lines)


def _checks(spec: CaseSpec, sim: bool, checks) -> tuple[str, list[str], str]:
    """(the expectation constants, the checks of main() that compare, the
    AS SPECIFIED sentence): only what this case's prediction needs, of the
    invariants in ``checks``."""
    pred = predict_fsdp1(spec)
    want = set(checks)
    uop = spec.plan.use_orig_params
    if pred.error is not None:
        u = pred.error
        want = (u.path, sorted(u.trainable), sorted(u.frozen))
        consts = f"EXPECTED_ERROR = {want!r}  # the ValueError's (module, trainable, frozen): the first mixed unit in post-order\n"
        body = [
            "got = None if error is None else frozen_message(str(error), alias)",
            "if not isinstance(error, ValueError) or got is None or got[:3] != EXPECTED_ERROR:",
            "    what = 'no error' if error is None else f\"{type(error).__name__}: {str(error).splitlines()[0]}\"",
            "    got_text = '' if got is None else f\" (naming {got[0] or '<root>'}: trainable {got[1]}, frozen {got[2]})\"",
            "    wrong.append(f\"FSDP gave {what}{got_text}, expected a ValueError naming {EXPECTED_ERROR[0] or '<root>'} \"",
            "                 f\"with trainable {EXPECTED_ERROR[1]} and frozen {EXPECTED_ERROR[2]}\")",
        ]
        return consts, body, f"FSDP raised the ValueError naming {_where(u.path)} and its trainable and frozen parameters"
    below = [(t.fqn, t.unit, t.lca) for t in pred.ties if t.below_lca]
    consts = ""
    if want & {"WRAP-UNITS", "WRAP-FQNS"}:
        consts += f"EXPECTED_UNITS = {dict((u.path, sorted(u.managed)) for u in pred.units)!r}  # unit path: the parameters it manages\n"
    if "WRAP-STATE-DICT" in want:
        consts += f"EXPECTED_KEYS = {sorted(pred.state_dict_keys)!r}  # the unwrapped model's state-dict keys\n"
        if uop:
            consts += f"EXPECTED_NAMES = {sorted(pred.named_parameters)!r}  # named_parameters (use_orig_params=True)\n"
    if uop and want & {"FROZEN-WARN", "FROZEN-CLEAN"}:
        consts += (f"EXPECTED_WARNINGS = {[(u.path, sorted(u.trainable), sorted(u.frozen), u.total_numel, u.trainable_numel) for u in pred.warnings]!r}"
                   "  # (unit, trainable, frozen, numel, trainable numel) per mixed unit, in post-order\n")
    if below:
        consts += f"TIES_BELOW_LCA = {below!r}  # (tied parameter, its unit, its users' common ancestor): FSDP must reject these\n"
    body = []
    if below:  # a rejection that names the tie is what the spec asks for
        body += ["if error is not None and any(w in str(error).lower() for w in ('shared', 'tied', 'tying')):",
                 "    return finish(None, f\"FSDP rejected the tie below its users' common ancestor: {str(error).splitlines()[0]}\")"]
    body += [
        "if error is not None:",
        "    return finish(f\"FSDP raised {type(error).__name__}: {str(error).splitlines()[0]} (expected it to wrap)\", None)",
    ]
    if uop and want & {"FROZEN-WARN", "FROZEN-CLEAN"}:
        body += [
            "got = [frozen_message(str(w.message), alias) for w in caught]",
            "got = [g for g in got if g is not None]",
            "if got != EXPECTED_WARNINGS:",
            "    wrong.append(f\"frozen-parameter warnings {got}, expected {EXPECTED_WARNINGS}\")",
        ]
    body += [
        "mine = units(fsdp, first, alias)",
        "everyone = [None] * dist.get_world_size()",
        "dist.all_gather_object(everyone, mine)",
        "if any(u != mine for u in everyone):  # (then state_dict's collectives would not match: stop here)",
        "    return finish(f\"the ranks built different FSDP units: {everyone}\", None)",
        "got = {}",
        "for path, managed in mine:",
        "    got.setdefault(path, []).append(managed)",
    ]
    if want & {"WRAP-UNITS", "WRAP-FQNS"}:
        body += [
            "for path in sorted(EXPECTED_UNITS.keys() | got.keys()):",
            "    if path not in got or path not in EXPECTED_UNITS or len(got[path]) > 1:",
            "        n = len(got.get(path, ()))",
            "        wrong.append(f\"module {path or '<root>'} is wrapped by {n} FSDP unit(s), expected {int(path in EXPECTED_UNITS)}\")",
            "    elif got[path][0] != EXPECTED_UNITS[path]:",
            "        wrong.append(f\"unit {path or '<root>'} manages {got[path][0]}, expected {EXPECTED_UNITS[path]}\")",
        ]
    if want & {"WRAP-EXACTLY-ONCE", "TIES"}:
        body += [
            "managed = [f for _, fqns in mine for f in fqns]",
            "for f in sorted({f for f in managed if managed.count(f) > 1}):",
            "    wrong.append(f\"parameter {f} is managed by {managed.count(f)} units, expected 1\")",
        ]
    if sim:
        body += [
            "for path, fqns in sorted(sim.items()):",
            "    if path in got and fqns != got[path][0]:",
            "        wrong.append(f\"torch's pre-wrap simulation gives unit {path or '<root>'} {fqns}, the wrap {got[path][0]}\")",
        ]
    if "WRAP-STATE-DICT" in want:
        body += [
            "try:",
            "    keys = sorted(k.replace('_fsdp_wrapped_module.', '') for k in fsdp.state_dict())",
            "except Exception as e:",
            "    keys = f\"{type(e).__name__}: {str(e).splitlines()[0]}\"",
            "if keys != EXPECTED_KEYS:",
            "    wrong.append(f\"state_dict() gave {keys}, expected {EXPECTED_KEYS}\")",
        ]
    if uop and "WRAP-STATE-DICT" in want:
        body += [
            "names = sorted(n.replace('_fsdp_wrapped_module.', '') for n, _ in fsdp.named_parameters())",
            "if names != EXPECTED_NAMES:",
            "    wrong.append(f\"named_parameters() gives {names}, expected {EXPECTED_NAMES}\")",
        ]
    if uop and pred.ties and "TIES" in want:
        body += [
            "for aliases in tied.values():",
            "    if len(aliases) > 1 and len({id(attr(fsdp, a)) for a in aliases}) > 1:",
            "        wrong.append(f\"the tied names {aliases} no longer share one Parameter\")",
        ]
    if below and "TIES" in want:
        body += [
            "for fqn, unit, lca in TIES_BELOW_LCA:",
            "    wrong.append(f\"tied {fqn} lives in unit {unit or '<root>'}, below its users' common ancestor {lca or '<root>'}, \"",
            "                 \"and FSDP accepted it (expected an error)\")",
        ]
    what = {"WRAP-UNITS": "the expected units", "WRAP-FQNS": "each unit managing the expected parameters",
            "WRAP-EXACTLY-ONCE": "each parameter managed once", "WRAP-STATE-DICT": "the unwrapped model's state-dict keys",
            "TIES": "ties managed once and kept", "FROZEN-WARN": "a warning for each mixed unit", "FROZEN-CLEAN": "no spurious frozen warning",
            "RANKS-AGREE": "the same units on every rank"}
    return consts, body, "FSDP wrapped the model with " + ", ".join(v for k, v in what.items() if k in want or k == "RANKS-AGREE")


# the invariants a script checks unless told otherwise: all of this area's
CHECKS = ("FROZEN-ERROR", "FROZEN-WARN", "FROZEN-CLEAN", "WRAP-UNITS", "WRAP-FQNS", "WRAP-EXACTLY-ONCE", "WRAP-STATE-DICT", "TIES", "RANKS-AGREE")


def fsdp1_script(spec: CaseSpec, violations: list | None = None, title: str = "", *, modes=DEFAULT_MODES, finding: str = "",
                 name: str = "repro.py", checks=CHECKS) -> str:
    """A torch-only script that builds the case, wraps it with FSDP1,
    compares what FSDP did with the oracle's prediction and prints the
    verdict. ``modes``, ``finding``, ``name``: its header's Run / Not shown
    by lines, the finding it reproduces, its file name."""
    pred = predict_fsdp1(spec)
    uop = spec.plan.use_orig_params
    errs = pred.error is not None
    ignored = bool(spec.plan.ignored_modules or spec.plan.ignored_params)
    # torch's pre-wrap simulation: for policy objects (callables are not simulated), where a tie or a shared module can fool it
    sim = (not errs and not ignored and isinstance(spec.plan.policy, (ModuleWrap, CustomWrap)) and (bool(pred.ties) or pred.shared_modules)
           and "WRAP-FQNS" in checks)
    consts, body, as_specified = _checks(spec, sim, checks)
    warn = uop and not errs and bool(set(checks) & {"FROZEN-WARN", "FROZEN-CLEAN"})
    plain = {"import os", "import socket"}
    if errs or warn:
        plain |= {"import ast", "import re"}
    if warn:
        plain.add("import warnings")
    extra_imports, fsdp_names = policy_imports(spec)
    plain |= {i for i in extra_imports if not i.startswith("from")}
    imports = [*sorted(plain), "", "import torch", "import torch.distributed as dist", "import torch.nn as nn",
                *from_import("torch.distributed.fsdp", ["FullyShardedDataParallel as FSDP", *fsdp_names])]
    imports += [i for i in extra_imports if i.startswith("from")]
    helpers = [_FIRST_NAMES]
    if errs or warn:
        helpers.append(_FROZEN_MESSAGE)
    if sim:
        helpers.append(_SIMULATE)
    if not errs:
        helpers.append(_UNITS)
    ties_check = uop and bool(pred.ties) and not errs and "TIES" in checks
    if ties_check:
        helpers.append(_ATTR)
    build, kw = build_code(spec)
    wrap = ("" if errs else "fsdp = ") + f"FSDP(model, auto_wrap_policy=policy, device_id=DEVICE, use_orig_params={uop}{kw})"
    main = ["init()", "model, policy = build()", "first, alias = first_names(model)"]
    if ties_check:
        main += ["tied = {}  # a parameter's first name: all its names",
                 "for name, _ in model.named_parameters(remove_duplicate=False):",
                 "    tied.setdefault(alias[name], []).append(name)"]
    if sim:
        main.append("sim = simulate(model, policy, first)")
    wrap_block = ["try:", f"    {wrap}", "    error = None", "except Exception as e:", "    error = e" if errs else "    fsdp, error = None, e"]
    if warn:
        main += ["with warnings.catch_warnings(record=True) as caught:", "    warnings.simplefilter('always')"]
        main += ["    " + ln for ln in wrap_block]
    else:
        main += wrap_block
    main.append("wrong = []")
    main += body
    main.append(f"finish('; '.join(wrong) or None, {as_specified!r})")
    main_code = "def main():\n" + textwrap.indent("\n".join(main), "    ") + "\n\n\nif __name__ == \"__main__\":\n    main()\n"
    doc = header(title, violations, expected_text(spec), modes, finding, name)
    return assemble(doc, "\n".join(imports), [HARNESS, class_code(spec), build, *helpers, consts, main_code])
