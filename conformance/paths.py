"""Where the files the package ships live (the conformance suite, the
baselines, known failures), and where a run writes by default: all relative
to the installed package or the current directory, never to a checkout."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
SUITE = PACKAGE / "suite"  # the conformance tests, one module per area
# the committed baselines (reports/baselines in a checkout links here)
BASELINES = PACKAGE / "baselines"
KNOWN_FAILURES = PACKAGE / "known_failures.toml"


def default_report_dir(base: Path | None = None) -> Path:
    """reports/latest under ``base`` (default: the current directory)."""
    return (base or Path.cwd()) / "reports" / "latest"


def shown(p) -> str:
    """``p`` relative to the current directory where it lies below it, else
    absolute (for messages and the report's baseline paths)."""
    p = Path(p).resolve()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)
