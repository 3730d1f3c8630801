"""A test-only scenario that reports, from inside a rank, where FSDP was
imported from (tests/self/test_fsdp_source.py)."""

from conformance.engine.scenarios import scenario


@scenario("fsdp-source-where", test_only=True)
def fsdp_source_where(spec) -> dict:
    import torch.distributed.fsdp as fsdp
    from torch.distributed._composable import fsdp as composable
    from torch.distributed.fsdp._fully_shard import _fully_shard

    from conformance.selfcheck import fsdp_source

    return {
        "marker": getattr(fsdp, "CONFORMANCE_OVERLAY_MARKER", None),
        "fsdp": fsdp.__file__,
        "fully_shard": _fully_shard.__file__,
        "composable": composable.__file__,
        "active_root": str(fsdp_source.active_root()),
    }
