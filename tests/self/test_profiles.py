"""The suite's Hypothesis profile stays in force after torch's test utilities,
which register a "dev" profile of their own and load a profile on import."""

import subprocess
import sys
import textwrap

import pytest

from conformance.run import profiles

pytestmark = pytest.mark.selfcheck


@pytest.mark.parametrize("name, examples", [("dev", 30), ("ci", 500), ("thorough", 3000)])
def test_profile_survives_torch_test_utils(name, examples):
    code = textwrap.dedent(
        f"""
        from hypothesis import settings
        from conformance.run import profiles
        profiles.activate({name!r})
        import torch.testing._internal.common_utils  # loads torch's own profile on first import
        from conformance.engine.fake import FakeEngine
        FakeEngine(world_size=2)  # the fake process group imports torch's test utilities too
        print(settings.default.max_examples, settings.default.derandomize)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    count, derandomize = out.stdout.split()[-2:]
    assert int(count) == examples
    if name == "ci":  # derives from Hypothesis's own ci profile
        assert derandomize == "True"


def test_unknown_profile_is_rejected():
    with pytest.raises(ValueError, match="unknown Hypothesis profile"):
        profiles.selected("fast")
