"""Worlds: engines by world size, for cases saved under one world size and
loaded under another, and for HSDP cases (as many ranks as their mesh):
rank pools of the base pool's backend, the base pool for its own size, the
rest (world size 1 included: in a rank process, so that a crash is a CRASH
verdict and not the end of the driver) made on first use.
Multi-phase scenarios (a checkpoint round trip) run here: each phase on its
world, all in one temporary directory that is always removed."""

from __future__ import annotations

import shutil

from conformance.case.model_case import ModelCase
from conformance.case.spec import CaseSpec
from conformance.engine.errors import EngineError
from conformance.engine.scenarios import get_scenario
from conformance.paths import scratch_dir

TMP_PREFIX = "fsdp-conformance-ckpt-"


class Worlds:
    """``engine(w)`` for w in 1..max; ``run(scenario, spec)`` runs on the
    spec's save world, a multi-phase scenario phase by phase."""

    def __init__(self, base, *, deadline: float | None = None, phases: dict | None = None) -> None:
        self.base = base
        self.tier = getattr(base, "tier", getattr(base, "backend", "gloo"))
        self.backend = getattr(base, "backend", "gloo")
        # per example (one phase): checkpoint examples take well under a
        # second; a hung collective should not cost the base pool's minute
        self.deadline = deadline if deadline is not None else getattr(base, "deadline", 60.0)
        self._engines = {getattr(base, "world_size", None): base}
        self._owned = []
        self.phases = dict(phases or {})  # scenario -> (save, load) instead of its registered phases: a test's faults
        self.dirs_made: list[str] = []  # temporary checkpoint directories (each removed after its example)

    def view(self, *, deadline: float) -> Worlds:
        """These worlds (the same pools, made and closed once) with another
        per-example deadline."""
        v = Worlds(self.base, deadline=deadline, phases=self.phases)
        v._engines, v._owned, v.dirs_made = self._engines, self._owned, self.dirs_made
        return v

    def engine(self, world_size: int):
        eng = self._engines.get(world_size)
        if eng is None:
            # world size 1 too on a pool of its own (one rank process), not in
            # the driver: a save that segfaults (fsdp2-tied-list-group-
            # unsharded-save-segfault) is then a CRASH verdict, not the
            # death of the test process (seed 4711 killed an xdist worker)
            from conformance.engine.pool import RankPool

            # forked from the base pool's server where it can be: the new
            # world's start is a fork and a group init, not a torch import
            share = self.base if isinstance(self.base, RankPool) else None
            eng = RankPool(world_size, self.backend, deadline=self.deadline, share_server_with=share)
            self._engines[world_size] = eng
            self._owned.append(eng)
        return eng

    def run(self, scenario: str, spec: CaseSpec) -> list[dict]:
        h = getattr(spec, "hsdp", None)
        if h is not None:  # an HSDP case runs on as many ranks as its mesh has
            return self._run(h.world, scenario, spec)
        t = getattr(spec, "tp", None)
        if t is not None:  # so does a tensor-parallel one
            return self._run(t.world, scenario, spec)
        mb = getattr(spec, "microbatch", None)
        if mb is not None and mb.mesh is not None:  # and a microbatch sequence on a 2-D mesh
            return self._run(mb.mesh[0] * mb.mesh[1], scenario, spec)
        ck = getattr(spec, "ckpt", None)
        if ck is None:
            raise EngineError("Worlds runs checkpoint cases (spec.ckpt), HSDP cases (spec.hsdp), TP cases (spec.tp) and microbatch "
                              "cases on a 2-D mesh (spec.microbatch.mesh)")
        phases = self.phases.get(scenario) or get_scenario(scenario).phases
        if not phases:
            return self._run(ck.save_world, scenario, spec)
        save, load = phases
        d = scratch_dir(TMP_PREFIX, small=not isinstance(spec, ModelCase))  # a real model's can be gigabytes
        self.dirs_made.append(d)
        try:
            saved = self._run(ck.save_world, save, spec, {"dir": d})
            first = saved[0]
            if not all(r.get("ok") for r in saved) or first["value"].get("error") or first["value"].get("skipped"):
                return saved  # the save side's error (or skip) is the observation
            loaded = self._run(ck.load_world, load, spec, {"dir": d})
            # a record's seconds are the example's time inside the scenario
            # functions: the slowest save rank's and its own (the bench's
            # pool overhead is the driver's wait less these; the load's
            # alone made checkpoint's save phase read as overhead)
            saving = max((r.get("seconds", 0.0) for r in saved), default=0.0)
            for r in loaded:
                r["seconds"] = r.get("seconds", 0.0) + saving
                if r.get("ok"):
                    r["value"]["save"] = first["value"]
            return loaded
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def _run(self, world_size: int, scenario: str, spec: CaseSpec, args: dict | None = None) -> list[dict]:
        eng = self.engine(world_size)
        return eng.run(scenario, spec, deadline=min(self.deadline, eng.deadline), args=args)

    def close(self) -> None:
        for eng in self._owned:
            eng.close()
        self._owned.clear()
