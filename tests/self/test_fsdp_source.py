"""FSDP from a source tree (conformance.selfcheck.fsdp_source): the overlay is in effect
in the driver, the pool's fork server and every rank, and the torchrun entry;
a source that cannot be used is one line and exit 2."""

import json
import os
import subprocess
import sys

import pytest

from conformance.case.examples import lora_model
from conformance.report.markdown import fsdp_source_label
from conformance.selfcheck import fsdp_source

pytestmark = pytest.mark.selfcheck

MARKER = "from-the-overlay"


@pytest.fixture(scope="module")
def overlay(tmp_path_factory):
    """A copy of the installed FSDP whose package carries a marker."""
    root = fsdp_source.copy_installed(tmp_path_factory.mktemp("fsdp-src"))
    init = root / "torch" / "distributed" / "fsdp" / "__init__.py"
    init.write_text(init.read_text() + f"\nCONFORMANCE_OVERLAY_MARKER = {MARKER!r}\n")
    return root


def _python(code: str, env_root=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(fsdp_source.ENV_VAR, None)
    if env_root is not None:
        env[fsdp_source.ENV_VAR] = str(env_root)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_overlay_in_every_rank_of_the_pool(overlay, monkeypatch):
    import tests.self.fsdp_source_scenarios  # noqa: F401  (registers the scenario)
    from conformance.engine.pool import RankPool

    # the fork server (and so every rank) inherits the driver's environment
    monkeypatch.setenv(fsdp_source.ENV_VAR, str(overlay))
    with RankPool(world_size=2, backend="gloo", deadline=120) as pool:
        records = pool.run("fsdp-source-where", lora_model(num_layers=1))
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        assert r["ok"], r
        v = r["value"]
        assert v["marker"] == MARKER
        for key in ("fsdp", "fully_shard", "composable"):
            assert v[key].startswith(str(overlay)), (key, v[key])
        assert v["active_root"] == str(overlay)


def test_overlay_in_torchrun_entry_and_driver(overlay):
    code = ("import conformance.engine.torchrun, torch.distributed.fsdp as f, torch.distributed._composable.fsdp as c; "
            "from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method; import sys; "
            "print(f.CONFORMANCE_OVERLAY_MARKER, f.__file__, c.__file__, sys.modules[fully_shard.__module__].__file__)")
    out = _python(code, overlay)
    assert out.returncode == 0, out.stderr
    marker, *files = out.stdout.split()
    assert marker == MARKER
    assert all(f.startswith(str(overlay)) for f in files), files
    # and without the variable, the installed FSDP
    out = _python("import conformance, torch.distributed.fsdp as f; print(hasattr(f, 'CONFORMANCE_OVERLAY_MARKER'))")
    assert out.stdout.strip() == "False", out.stderr


def test_report_header_records_the_overlay(overlay, monkeypatch):
    monkeypatch.setenv(fsdp_source.ENV_VAR, str(overlay))
    info = fsdp_source.report_info()
    assert info["path"] == str(overlay)
    assert set(info["packages"]) == set(fsdp_source.PACKAGES)
    assert info["differs_from_installed"] == ["torch/distributed/fsdp/__init__.py"]
    assert len(info["files_sha256"]) == 64 and info["git_commit"] is None
    assert "differs from installed in 1 file (__init__.py)" in fsdp_source_label(info)


def test_git_checkout_commit_and_dirty_hash(overlay, tmp_path):
    import shutil

    repo = tmp_path / "pytorch"
    shutil.copytree(overlay, repo)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    clean = fsdp_source.describe(repo)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert clean["git_commit"] == head and clean["git_dirty"] is False and clean["git_diff_sha256"] is None
    wrap = repo / "torch" / "distributed" / "fsdp" / "wrap.py"
    wrap.write_text(wrap.read_text() + "\n# a change\n")
    dirty = fsdp_source.describe(repo)
    assert dirty["git_dirty"] is True and len(dirty["git_diff_sha256"]) == 64
    assert dirty["files_sha256"] != clean["files_sha256"]


def cli(*args):
    env = dict(os.environ)
    env.pop(fsdp_source.ENV_VAR, None)
    return subprocess.run([sys.executable, "-m", "conformance.cli", *args], capture_output=True, text=True, timeout=300, env=env)


def assert_one_line(proc, needle):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert needle in lines[0], lines[0]


def test_path_without_fsdp_is_one_line(tmp_path):
    assert_one_line(cli("run", "--fsdp-source", str(tmp_path)), "no torch/distributed/fsdp/__init__.py")
    assert_one_line(cli("run", "--fsdp-source", str(tmp_path / "nope")), "not a directory")
    assert_one_line(cli("change", "installed", str(tmp_path)), "NEW: FSDP source")


def test_source_that_does_not_parse_is_one_line(overlay, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(overlay, bad)
    (bad / "torch" / "distributed" / "fsdp" / "wrap.py").write_text("def broken(:\n")
    assert_one_line(cli("run", "--fsdp-source", str(bad)), "torch/distributed/fsdp/wrap.py:1: does not parse")


def test_source_this_torch_cannot_import_names_the_name(overlay, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(overlay, bad)
    common = bad / "torch" / "distributed" / "fsdp" / "_common_utils.py"
    # an import-time use of a private name this torch lacks
    common.write_text(common.read_text() + "\nfrom torch._C import _no_such_private_name_in_this_torch\n")
    assert_one_line(cli("run", "--fsdp-source", str(bad)), "_no_such_private_name_in_this_torch")
    # a call-time use of a C++ op this torch lacks
    common.write_text(common.read_text().replace("from torch._C import _no_such_private_name_in_this_torch", "def _later():\n    return torch.ops.fsdp.no_such_op_in_this_torch(1)"))
    with pytest.raises(fsdp_source.SourceError, match=r"_common_utils.py:\d+: the installed torch .* lacks torch.ops.fsdp.no_such_op_in_this_torch"):
        fsdp_source.validate(bad)


def test_check_prints_the_description(overlay):
    out = subprocess.run([sys.executable, "-m", "conformance.selfcheck.fsdp_source", "check", str(overlay)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["path"] == str(overlay)
