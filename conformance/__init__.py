"""fsdp-conformance: a property-based conformance suite for PyTorch FSDP."""


def check_model(target: str, **kwargs):
    """Every applicable invariant on a real model: see conformance.models.check_model."""
    from conformance.models import check_model as run

    return run(target, **kwargs)
