"""FSDP from a source tree: an import hook that loads FSDP's Python packages
(FSDP1 and FSDP2) from a PyTorch checkout over the installed torch binary.

FSDP is pure Python, so a change to it can be tested without building torch:
``FSDP_CONFORMANCE_FSDP_SOURCE=PATH`` makes every process that imports
``conformance`` (the driver, the pool's fork server and so every rank, the
torchrun entry) put a meta-path finder first, which answers for the packages
below with PATH's files. Nothing in site-packages changes. Child processes
inherit the variable, so the overlay follows them.

    python -m conformance.selfcheck.fsdp_source check PATH            # can this torch import it? (JSON, or one line + exit 2)
    python -m conformance.selfcheck.fsdp_source run PATH SCRIPT [ARG ...]   # a (repro) script with the overlay
    torchrun --nproc-per-node 2 -m conformance.selfcheck.fsdp_source run PATH SCRIPT
"""

from __future__ import annotations

import ast
import hashlib
import importlib.abc
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ENV_VAR = "FSDP_CONFORMANCE_FSDP_SOURCE"
# Every package the suite imports FSDP from: FSDP1 and FSDP2 (fully_shard,
# register_fsdp_forward_method: torch/distributed/fsdp/_fully_shard since 2.6)
# and the older home of FSDP2, which newer releases keep as a re-export.
PACKAGES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
REQUIRED = PACKAGES[0]
# Single modules outside those packages that the areas composed with FSDP
# exercise (gradient clipping, activation checkpointing, tensor parallelism's
# styles, the distributed state-dict API and its gather / broadcast /
# distribute helpers): overlaid file by file where the source holds them.
# torch imports some of them while it starts, so the overlay must be in
# effect before torch is imported.
MODULES = ("torch.nn.utils.clip_grad", "torch.utils.checkpoint", "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
           "torch.distributed.tensor.parallel.style", "torch.distributed.checkpoint.state_dict",
           "torch.distributed._state_dict_utils")


class SourceError(Exception):
    """An FSDP source that cannot be used (one-line message)."""


def _rel(pkg: str) -> Path:
    return Path(*pkg.split("."))


def source_root(path: str | os.PathLike) -> Path:
    """The directory holding ``torch/distributed/fsdp/`` (a PyTorch checkout,
    or a copy of just that), resolved; SourceError otherwise."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise SourceError(f"FSDP source {path}: not a directory")
    root = root.resolve()
    if not (root / _rel(REQUIRED) / "__init__.py").is_file():
        raise SourceError(f"FSDP source {path}: no torch/distributed/fsdp/__init__.py in it (give a PyTorch checkout or a directory holding torch/distributed/fsdp/)")
    return root


def overlaid_packages(root: Path) -> list[str]:
    """The packages of PACKAGES that ``root`` holds (it must hold the first)."""
    return [p for p in PACKAGES if (root / _rel(p) / "__init__.py").is_file()]


def overlaid_modules(root: Path) -> list[str]:
    """The single modules of MODULES that ``root`` holds."""
    return [m for m in MODULES if (root / _rel(m).with_suffix(".py")).is_file()]


def python_files(root: Path) -> list[Path]:
    """Every .py file of the overlaid packages and modules, sorted, relative
    to ``root``. A nested package is part of its parent's overlay: it is
    found on the parent's __path__, which is ``root``'s directory."""
    out = []
    for pkg in overlaid_packages(root):
        base = root / _rel(pkg)
        out += [p.relative_to(root) for p in base.rglob("*.py") if "__pycache__" not in p.parts]
    out += [_rel(m).with_suffix(".py") for m in overlaid_modules(root)]
    return sorted(set(out))


class _Finder(importlib.abc.MetaPathFinder):
    """Answers for the overlaid packages themselves; their submodules are then
    found by the ordinary path finder on the package's __path__ (the source
    tree), so every module of the package comes from ``root``."""

    def __init__(self, root: Path, packages: list[str], modules: list[str] = ()) -> None:
        self.root = root
        self.packages = packages
        self.modules = list(modules)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.modules:
            return importlib.util.spec_from_file_location(fullname, self.root / _rel(fullname).with_suffix(".py"))
        if fullname not in self.packages:
            return None
        pkg_dir = self.root / _rel(fullname)
        return importlib.util.spec_from_file_location(
            fullname, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
        )

    def __repr__(self) -> str:
        return f"<fsdp-conformance FSDP source {self.root}>"


_installed: _Finder | None = None


def install(path: str | os.PathLike) -> Path:
    """Put the finder first on sys.meta_path (idempotent for the same root).
    Must run before anything imports torch.distributed.fsdp."""
    global _installed
    root = source_root(path)
    if _installed is not None:
        if _installed.root == root:
            return root
        raise SourceError(f"FSDP source {_installed.root} is already in effect in this process; cannot switch to {root}")
    loaded = [p for p in (*PACKAGES, *overlaid_modules(root)) if p in sys.modules]
    if loaded:
        raise SourceError(f"{loaded[0]} was imported before the FSDP source {root} could be put in effect")
    _installed = _Finder(root, overlaid_packages(root), overlaid_modules(root))
    sys.meta_path.insert(0, _installed)
    return root


def install_from_env() -> Path | None:
    """Called when ``conformance`` is imported: the overlay follows the
    environment into every process of a run."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    return install(path)


def active_root() -> Path | None:
    return _installed.root if _installed is not None else None


def loaded_from() -> dict[str, str | None]:
    """Where the FSDP packages this process imported came from (their
    ``__file__``): the evidence that the overlay is in effect."""
    out = {}
    for p in PACKAGES:
        m = sys.modules.get(p)
        out[p] = getattr(m, "__file__", None) if m is not None else None
    return out


# ---- what the report records -------------------------------------------------


def _git(root: Path, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def files_hash(root: Path, files: list[Path] | None = None) -> str:
    h = hashlib.sha256()
    for rel in files if files is not None else python_files(root):
        h.update(str(rel).encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def installed_root() -> Path | None:
    """The directory above the installed torch package (site-packages),
    found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def differs_from_installed(root: Path) -> list[str] | None:
    """The overlay's files that differ from (or are missing in, or are new
    against) the installed torch's, relative to ``root``."""
    inst = installed_root()
    if inst is None:
        return None
    mine = set(python_files(root))
    theirs = {p for p in python_files_of(inst, overlaid_packages(root), overlaid_modules(root))}
    out = []
    for rel in sorted(mine | theirs):
        a, b = root / rel, inst / rel
        if not a.is_file() or not b.is_file() or a.read_bytes() != b.read_bytes():
            out.append(str(rel))
    return out


def copy_installed(dest: str | os.PathLike) -> Path:
    """A copy of the installed torch's FSDP packages under ``dest`` (the
    start of a mutant, or of a deliberate change to try)."""

    inst = installed_root()
    if inst is None or not (inst / _rel(REQUIRED) / "__init__.py").is_file():
        raise SourceError("no installed torch with torch/distributed/fsdp/ in this Python")
    dest = Path(dest)
    copy_tree(inst, dest)
    return dest


def copy_tree(inst: Path, dest: Path) -> None:
    """The overlaid packages and modules of the torch at ``inst`` (the
    directory above it) copied under ``dest``."""
    import shutil

    for pkg in PACKAGES:
        if (inst / _rel(pkg)).is_dir():
            shutil.copytree(inst / _rel(pkg), dest / _rel(pkg), ignore=shutil.ignore_patterns("__pycache__"))
    for mod in MODULES:
        src = inst / _rel(mod).with_suffix(".py")
        if src.is_file():
            (dest / src.relative_to(inst)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / src.relative_to(inst))


def python_files_of(root: Path, packages: list[str], modules: list[str] = ()) -> list[Path]:
    out = []
    for pkg in packages:
        base = root / _rel(pkg)
        if base.is_dir():
            out += [p.relative_to(root) for p in base.rglob("*.py") if "__pycache__" not in p.parts]
    out += [_rel(m).with_suffix(".py") for m in modules if (root / _rel(m).with_suffix(".py")).is_file()]
    return out


def describe(path: str | os.PathLike) -> dict:
    """The overlay as the report header records it: path, packages, git
    commit and a hash of uncommitted changes (when PATH is a git checkout),
    a hash of the overlaid files, and which files differ from the installed
    torch's."""
    root = source_root(path)
    files = python_files(root)
    info = {
        "path": str(root),
        "packages": overlaid_packages(root),
        "files": len(files),
        "files_sha256": files_hash(root, files),
        "git_commit": None,
        "git_dirty": None,
        "git_diff_sha256": None,
        "differs_from_installed": differs_from_installed(root),
    }
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is not None:
        head = _git(root, "rev-parse", "HEAD")
        info["git_commit"] = head.strip() if head else None
        dirs = [str(root / _rel(p)) for p in info["packages"]]
        diff = _git(root, "diff", "HEAD", "--", *dirs) or ""
        untracked = _git(root, "ls-files", "--others", "--exclude-standard", "--", *dirs) or ""
        extra = b"".join((Path(top.strip()) / u).read_bytes() for u in untracked.split() if (Path(top.strip()) / u).is_file())
        info["git_dirty"] = bool(diff or untracked)
        if info["git_dirty"]:
            info["git_diff_sha256"] = hashlib.sha256(diff.encode() + b"\0" + untracked.encode() + b"\0" + extra).hexdigest()
    return info


def report_info() -> dict | None:
    """The overlay of this run (from the environment), for the report header."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    try:
        return describe(path)
    except SourceError as e:
        return {"path": path, "error": str(e)}


# ---- can the installed torch import it? ------------------------------------------


def check_parses(root: Path) -> None:
    for rel in python_files(root):
        try:
            ast.parse((root / rel).read_bytes(), filename=str(rel))
        except SyntaxError as e:
            raise SourceError(f"FSDP source {root}: {rel}:{e.lineno}: does not parse ({e.msg})") from None
        except ValueError as e:  # null bytes
            raise SourceError(f"FSDP source {root}: {rel}: does not parse ({e})") from None


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _torch_chains(tree: ast.AST) -> list[tuple[int, str]]:
    """``torch.ops.NS.OP`` and ``torch._C.NAME`` attribute chains in a module:
    names the binary must have (a call-time use escapes the import check)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, cur = [], node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if not isinstance(cur, ast.Name) or cur.id != "torch":
            continue
        chain = ["torch", *reversed(chain)]
        if chain[1:2] == ["ops"] and len(chain) >= 4:
            out.append((node.lineno, ".".join(chain[:4])))
        elif chain[1:2] == ["_C"] and len(chain) >= 3:
            out.append((node.lineno, ".".join(chain[:3])))
    return out


def check_imports(root: Path) -> None:
    """In a process where the overlay is in effect: import every module of
    the overlay, then resolve the C++ names (torch.ops.*, torch._C.*) its
    code uses. SourceError names the first thing this torch lacks."""
    import importlib
    import traceback

    import torch

    where = f"FSDP source {root}"
    for rel in python_files(root):
        name = _module_name(rel)
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any import failure is the answer
            frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith(str(root))]
            at = f"{Path(frames[-1].filename).relative_to(root)}:{frames[-1].lineno}" if frames else str(rel)
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise SourceError(f"{where}: {at}: cannot be imported against the installed torch {torch.__version__}: {type(e).__name__}: {msg}") from None
    mod = sys.modules.get(REQUIRED)
    if mod is None or not str(getattr(mod, "__file__", "")).startswith(str(root)):
        raise SourceError(f"{where}: {REQUIRED} was not loaded from it (loaded from {getattr(mod, '__file__', None)})")
    for rel in python_files(root):
        tree = ast.parse((root / rel).read_bytes())
        for line, chain in _torch_chains(tree):
            obj = torch
            try:
                for part in chain.split(".")[1:]:
                    obj = getattr(obj, part)
            except (AttributeError, RuntimeError):
                raise SourceError(f"{where}: {rel}:{line}: the installed torch {torch.__version__} lacks {chain}") from None


def validate(path: str | os.PathLike, python: str | None = None) -> dict:
    """Layout, parse and import checks (the import check in a fresh process,
    so that the caller's own imports are not touched); the description for
    the report. SourceError (one line) when the source cannot be used."""
    import json

    root = source_root(path)
    check_parses(root)
    env = {**os.environ, ENV_VAR: str(root)}
    r = subprocess.run(
        [python or sys.executable, "-m", "conformance.selfcheck.fsdp_source", "check", str(root)],
        capture_output=True, text=True, env=env, cwd=str(Path(__file__).resolve().parents[2]),
    )
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        raise SourceError(lines[-1].removeprefix("error: ") if lines else f"FSDP source {root}: the import check failed (exit {r.returncode})")
    return json.loads(r.stdout)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import runpy

    p = argparse.ArgumentParser(prog="python -m conformance.selfcheck.fsdp_source", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="can the installed torch import this FSDP source? prints its description")
    c.add_argument("path")
    r = sub.add_parser("run", help="run a Python script with this FSDP source in effect")
    r.add_argument("path")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    # run as __main__, this file is a second copy of the module: use the one
    # that `conformance` imported (and that may hold the finder already)
    from conformance.selfcheck import fsdp_source as this

    try:
        root = this.install(a.path)
        if a.cmd == "check":
            this.check_parses(root)
            this.check_imports(root)
            print(json.dumps(this.describe(root)))
            return 0
    except this.SourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.argv = [a.script, *a.args]
    runpy.run_path(a.script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
