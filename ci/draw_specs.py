"""Draw CaseSpecs with the suite's strategies, derandomized, as JSON lines:
the cases `python -m conformance.engine.torchrun --specs FILE` runs on every rank."""

from __future__ import annotations

import argparse
import sys

from hypothesis import HealthCheck, Phase, given, settings

from conformance.strategies import case_specs


def draw(examples: int) -> list[str]:
    out: list[str] = []

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case_specs())
    def collect(spec):
        out.append(spec.to_json())

    collect()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=200)
    p.add_argument("-o", "--output", default="-")
    a = p.parse_args(argv)
    lines = "".join(s + "\n" for s in draw(a.examples))
    if a.output == "-":
        sys.stdout.write(lines)
    else:
        with open(a.output, "w") as f:
            f.write(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
