"""What an engine reports when it cannot give a result: errors and HANG / CRASH verdicts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

HANG = "HANG"
CRASH = "CRASH"


class EngineError(RuntimeError):
    """An engine could not do what it was asked (one-line message)."""


class BackendUnavailable(EngineError):
    """The requested process-group backend cannot run here (e.g. NCCL without
    enough GPUs)."""


class PoolStartError(EngineError):
    """Rank processes did not form a process group."""


@dataclass(frozen=True)
class RankState:
    """One rank at the moment an example was given up on."""

    rank: int
    pid: int
    state: str  # "returned" | "running" | "exited"
    exitcode: int | None = None  # negative: killed by that signal
    record: dict | None = None  # its result record, when it returned one
    stack: str = ""  # faulthandler dump of every thread (live ranks)
    log: str = ""  # what the rank wrote to stdout/stderr during the example

    def describe(self) -> str:
        if self.state == "exited":
            code = self.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            return f"rank {self.rank} (pid {self.pid}) {how}"
        if self.state == "returned":
            ok = self.record is not None and self.record.get("ok")
            if ok:
                return f"rank {self.rank} (pid {self.pid}) returned"
            err = (self.record or {}).get("error") or {}
            return f"rank {self.rank} (pid {self.pid}) raised {err.get('type')}: {err.get('message')}"
        return f"rank {self.rank} (pid {self.pid}) still running"


class ExampleFailed(EngineError):
    """An example got no result from every rank: a rank hung past the deadline
    (HANG) or died (CRASH). The pool has been torn down; the next run rebuilds
    it. ``str()`` is one line; ``report()`` adds each rank's stack and log."""

    verdict: str = ""

    def __init__(
        self,
        *,
        scenario: str,
        spec: Any,
        backend: str,
        world_size: int,
        deadline: float,
        elapsed: float,
        ranks: tuple[RankState, ...],
        idle: float | None = None,
    ) -> None:
        self.scenario = scenario
        self.spec = spec  # the CaseSpec as given to run()
        self.backend = backend
        self.world_size = world_size
        self.deadline = deadline
        self.elapsed = elapsed
        self.ranks = tuple(ranks)
        self.idle = idle  # a HANG declared before the deadline: every running rank used no CPU for this long
        self.replay: str | None = None  # a CRASH replayed on fresh ranks: what happened (RankPool._replay)
        # a CRASH that did not follow its case: the (scenario, spec, args) the
        # crashed ranks ran before it, oldest first (RankPool._replay_history)
        self.history: list[tuple[str, Any, dict | None]] = []
        super().__init__(self._line())
        if hasattr(self, "add_note"):
            self.add_note(self.report(headline=False))

    def _line(self) -> str:
        what = "no result within" if self.verdict == HANG else "rank died after"
        states = "; ".join(r.describe() for r in self.ranks)
        why = f"deadline {self.deadline:g}s" + (f"; no running rank used CPU for {self.idle:g}s" if self.idle else "")
        replay = f"; replayed on fresh ranks: {self.replay}" if self.replay else ""
        return (
            f"{self.verdict}: scenario {self.scenario!r} on {self.world_size} {self.backend} ranks, "
            f"{what} {self.elapsed:.1f}s ({why}): {states}{replay}"
        )

    def note_replay(self, outcome: str) -> None:
        """What the same example did when run again on fresh ranks."""
        self.replay = outcome
        self.args = (self._line(),)

    def report(self, headline: bool = True) -> str:
        """The full account: the spec as Python, then each rank's stack and log."""
        parts = [self._line()] if headline else []
        to_python = getattr(self.spec, "to_python", None)
        if to_python is not None:
            parts.append("# the case\n" + to_python())
        for r in self.ranks:
            if r.stack:
                parts.append(f"# rank {r.rank} (pid {r.pid}) stack\n{r.stack.rstrip()}")
            if r.log.strip():
                parts.append(f"# rank {r.rank} (pid {r.pid}) output\n{r.log.rstrip()}")
        return "\n\n".join(parts)

    def to_dict(self) -> dict:
        to_json = getattr(self.spec, "to_json", None)
        return {
            "verdict": self.verdict,
            "scenario": self.scenario,
            "spec": to_json() if to_json is not None else repr(self.spec),
            "backend": self.backend,
            "world_size": self.world_size,
            "deadline": self.deadline,
            "elapsed": self.elapsed,
            "idle": self.idle,
            "replay": self.replay,
            "ranks": [asdict(r) for r in self.ranks],
            **({"history": [_history_entry(sc, sp, a) for sc, sp, a in self.history]} if self.history else {}),
        }


class RankHang(ExampleFailed):
    """HANG: some rank gave no result before the example's deadline."""

    verdict = HANG


class RankCrash(ExampleFailed):
    """CRASH: some rank process died (signal, os._exit, killed) mid-example."""

    verdict = CRASH


class BenchError(RuntimeError):
    """A measurement that could not complete (a rank failed or timed out, a run wrote no timings)."""


def _history_entry(scenario: str, spec: Any, args: dict | None) -> dict:
    to_json = getattr(spec, "to_json", None)
    return {"scenario": scenario, "spec": to_json() if to_json is not None else repr(spec), **({"args": args} if args else {})}
