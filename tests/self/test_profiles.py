"""The suite's Hypothesis profile stays in force after torch's test utilities,
which register a "dev" profile of their own and load a profile on import."""

import os
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


def test_a_seed_randomizes_the_derandomized_ci_profile(tmp_path):
    """`run --profile ci --seed N` draws other examples for another N: a
    derandomized profile would ignore the seed (the same draws whatever it
    is), and a "several seeds" check would check one seed several times."""
    (tmp_path / "test_draws.py").write_text(textwrap.dedent(
        """
        from hypothesis import given, settings, strategies as st
        import os

        @settings(max_examples=5)
        @given(st.integers(0, 10**9))
        def test_draw(x):
            with open(os.environ["DRAWS"], "a") as f:
                f.write(f"{x}\\n")
        """
    ))

    runs = iter(range(100))

    def draws(seed):
        out = tmp_path / f"draws-{next(runs)}"
        cmd = [sys.executable, "-m", "pytest", "-q", "--conformance-profile=ci", "-p", "no:cacheprovider",
               str(tmp_path / "test_draws.py")] + ([f"--hypothesis-seed={seed}"] if seed is not None else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "DRAWS": str(out)})
        assert r.returncode == 0, r.stdout + r.stderr
        return out.read_text().split()

    assert draws(None) == draws(None)  # derandomized without a seed
    assert draws(1) != draws(2)
