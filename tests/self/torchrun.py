"""Running torchrun from a test: its log directory (torchelastic_*, which
torch's elastic agent makes in $TMPDIR and does not remove) goes to the
test's own tmp_path, not /tmp (three were left there per test run)."""

from __future__ import annotations

import os


def torchrun_env(tmp_path) -> dict[str, str]:
    """The environment for a torchrun subprocess of a test: this one's, with
    TMPDIR the test's tmp_path."""
    return {**os.environ, "TMPDIR": str(tmp_path)}
