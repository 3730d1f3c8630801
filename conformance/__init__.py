"""fsdp-conformance: a property-based conformance suite for PyTorch FSDP."""

# FSDP from a source tree (conformance.selfcheck.fsdp_source): every process of a run
# imports this package before torch.distributed.fsdp (the driver, the pool's
# fork server and its ranks, the torchrun entry), so the overlay that the
# environment names is put in effect here, once, before FSDP is imported.
import os as _os

if _os.environ.get("FSDP_CONFORMANCE_FSDP_SOURCE"):
    import sys as _sys

    from conformance.selfcheck import fsdp_source as _fsdp_source

    try:
        _fsdp_source.install_from_env()
    except _fsdp_source.SourceError as _e:
        print(f"fsdp-conformance: error: {_e}", file=_sys.stderr)
        raise SystemExit(2) from None


def check_model(target: str, **kwargs):
    """Every applicable invariant on a real model: see conformance.run.models.check_model."""
    from conformance.run.models import check_model as run

    return run(target, **kwargs)


def __getattr__(name: str):
    """``conformance.Target`` and ``conformance.MethodCall``, what a model's
    target module imports (conformance.case.target), loaded on first use: the
    pytest plugin imports this package in every pytest run, torch-free ones
    too."""
    if name in ("Target", "MethodCall"):
        from conformance.case import target

        return getattr(target, name)
    raise AttributeError(f"module 'conformance' has no attribute {name!r}")
