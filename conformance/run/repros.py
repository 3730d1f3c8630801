"""Running a finding's repro script (reports/findings/<id>.py, or a generated
one) in the modes its header offers, and reading the verdict it computes.

The convention every repro follows (README: "Repro scripts"):

- its module docstring has one line per mode it offers, ``Run: <command>``
  (``Run: python x.py`` or ``Run: torchrun --nproc-per-node N x.py``, with
  arguments after the script where it takes some), and for a mode that cannot
  show the deviation ``Not shown by: <command>: <why>``; committed repros also
  name their finding, ``Finding: <id>``;
- rank 0 prints, as its last line, one verdict the script computed itself:
  ``DEVIATION: <what torch did against what was promised>`` or
  ``AS SPECIFIED: <what torch did, as promised>``, and it exits 0 either way.

Torch-free: this module only reads the header and runs subprocesses.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

VERDICTS = ("DEVIATION", "AS SPECIFIED")
_VERDICT_RE = re.compile(r"^(DEVIATION|AS SPECIFIED): (\S.*)$")
_RUN_RE = re.compile(r"^Run: (\S.*)$")
_NOT_SHOWN_RE = re.compile(r"^Not shown by: (.+?\.py(?: [^:]*)?): (\S.*)$")
_FINDING_RE = re.compile(r"^Finding: (\S+)$")


class ReproHeaderError(ValueError):
    pass


@dataclass(frozen=True)
class Mode:
    command: str  # as the header writes it: "python x.py" | "torchrun --nproc-per-node 2 x.py [args]"
    shown: bool  # False: a "Not shown by" line (the mode runs but cannot show the deviation)
    why: str = ""  # why it cannot show it

    @property
    def ranks(self) -> int:
        return _parse(self.command)[0]


@dataclass(frozen=True)
class RunResult:
    command: list[str]  # what was run
    returncode: int  # -9 after a timeout (the process group killed)
    output: str  # stdout and stderr together, every rank's
    verdict: str | None  # "DEVIATION" | "AS SPECIFIED" | None (no verdict line, or several)
    line: str  # the verdict line ("" when none)
    timed_out: bool = False
    # what the script left in its $TMPDIR (torch's own directories aside):
    # files a script should have removed, e.g. a case file or a checkpoint
    # a user's every run would leave in /tmp
    left_behind: tuple[str, ...] = ()


# torch's own in $TMPDIR: torchrun's log directory, inductor's cache
_TORCH_OWN = ("torchelastic_", "torchinductor_")


def docstring(path: Path | str) -> str:
    """The module docstring, or (older generated scripts) the leading comment block."""
    text = Path(path).read_text()
    try:
        doc = ast.get_docstring(ast.parse(text))
    except SyntaxError as e:
        raise ReproHeaderError(f"{path}: {e}") from None
    if doc:
        return doc
    lines = []
    for ln in text.splitlines():
        if not ln.startswith("#"):
            break
        lines.append(ln.lstrip("#").strip())
    return "\n".join(lines)


def finding(path: Path | str) -> str | None:
    """The finding id the header names (``Finding: <id>``)."""
    for ln in docstring(path).splitlines():
        if m := _FINDING_RE.match(ln.strip()):
            return m.group(1)
    return None


def modes(path: Path | str) -> list[Mode]:
    """Every mode the header names, in header order: ``Run:`` ones (shown)
    and ``Not shown by:`` ones. Raises ReproHeaderError for a command this
    module cannot run, or when the header offers no Run: mode."""
    out = []
    for ln in docstring(path).splitlines():
        ln = ln.strip()
        if m := _RUN_RE.match(ln):
            out.append(Mode(m.group(1), True))
        elif m := _NOT_SHOWN_RE.match(ln):
            out.append(Mode(m.group(1), False, m.group(2)))
        elif ln.startswith(("Run:", "Not shown by:")):
            raise ReproHeaderError(f"{path}: malformed mode line {ln!r}")
    for mode in out:
        _parse(mode.command, path)
    if not any(m.shown for m in out):
        raise ReproHeaderError(f"{path}: no 'Run: <command>' line in its header")
    return out


def _parse(command: str, path=None) -> tuple[int, list[str]]:
    """(ranks, arguments after the script) of a header command."""
    words = shlex.split(command)
    where = f"{path}: " if path else ""
    if words[:1] == ["python"] and len(words) >= 2 and words[1].endswith(".py"):
        return 1, words[2:]
    if words[:2] == ["torchrun", "--nproc-per-node"] and len(words) >= 4 and words[2].isdigit() and words[3].endswith(".py"):
        return int(words[2]), words[4:]
    raise ReproHeaderError(f"{where}cannot run {command!r}: expected 'python X.py ...' or 'torchrun --nproc-per-node N X.py ...'")


def argv(path: Path | str, mode: Mode, python: str = sys.executable) -> list[str]:
    """The command line of ``mode`` for the script at ``path``: torchrun as
    ``python -m torch.distributed.run --standalone`` (its rendezvous on a
    free port)."""
    ranks, args = _parse(mode.command)
    script = str(Path(path).resolve())
    if mode.command.startswith("python"):
        return [python, script, *args]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), script, *args]


def verdict_of(output: str) -> tuple[str | None, str]:
    """(verdict, line): the one verdict line in ``output``; (None, "") when
    there is none, or more than one (a script must print exactly one)."""
    found = [m for ln in output.splitlines() if (m := _VERDICT_RE.match(ln.strip()))]
    if len(found) != 1:
        return None, ""
    return found[0].group(1), found[0].group(0)


def run(path: Path | str, mode: Mode, *, timeout: float = 120, python: str = sys.executable) -> RunResult:
    """Run the repro at ``path`` in ``mode``, in a fresh temporary directory,
    as its own process group (killed whole on timeout: no orphaned ranks)."""
    cmd = argv(path, mode, python)
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)  # a caller under torchrun must not make a python run join its group
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="fsdp-repro-") as cwd:
        tmp = os.path.join(cwd, "tmp")
        os.mkdir(tmp)
        env["TMPDIR"] = tmp  # a script's checkpoints (tempfile.mkdtemp) go with it
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            output, _ = proc.communicate()
            output += f"\n[timed out after {timeout:g} s: process group killed]"
            timed_out = True
        finally:
            _kill_group(proc)  # ranks a dead launcher left behind
        left = tuple(sorted(n for n in os.listdir(tmp) if not n.startswith(_TORCH_OWN)))
    verdict, line = verdict_of(output)
    return RunResult(cmd, -9 if timed_out else proc.returncode, output, verdict, line, timed_out, left)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


REPROS_SCHEMA = "fsdp-conformance-repros"


def release_verdict(runs: list[dict]) -> str:
    """One release's verdict over a script's modes: DEVIATION when a shown
    mode showed it; AS SPECIFIED when every shown mode gave that; otherwise
    "no verdict" (an error, a timeout, a script this release cannot run)."""
    shown = [r for r in runs if r["shown"]]
    if any(r["verdict"] == "DEVIATION" for r in shown):
        return "DEVIATION"
    if shown and all(r["verdict"] == "AS SPECIFIED" for r in shown):
        return "AS SPECIFIED"
    return "no verdict"


def measure(paths: list[Path], *, python: str = sys.executable, timeout: float = 240, workers: int = 2) -> dict:
    """Every script at ``paths`` in every mode its header offers, with
    ``python`` (a release's venv): ``{finding id: [run, ...]}``, each run a
    dict (command, shown, verdict, line, returncode, timed_out, tail) and the
    release verdict of each finding (release_verdict)."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(p, m) for p in paths for m in modes(p)]

    def one(job):
        path, mode = job
        res = run(path, mode, timeout=timeout, python=python)
        return finding(path) or Path(path).stem, {"command": mode.command, "shown": mode.shown, "verdict": res.verdict, "line": res.line,
                                                  "returncode": res.returncode, "timed_out": res.timed_out,
                                                  "tail": "\n".join(res.output.strip().splitlines()[-8:])}

    out: dict[str, list[dict]] = {}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for fid, r in pool.map(one, jobs):
            out.setdefault(fid, []).append(r)
    return {fid: {"verdict": release_verdict(runs), "runs": runs} for fid, runs in out.items()}
