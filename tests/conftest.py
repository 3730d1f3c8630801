"""The suite's own tests: the options, fixtures and report come from the
package's pytest plugin (conformance.plugin, the pytest11 entry point); the
Hypothesis profile is loaded here too, since these tests draw cases."""

from conformance.plugin import ensure_profile


def pytest_configure(config):
    ensure_profile(config)


def pytest_collection_modifyitems(config, items):
    """The `repros` tests (every committed repro script in every mode:
    minutes) run only when asked for: pytest -m repros."""
    if "repros" in (config.getoption("markexpr") or ""):
        return
    keep = [i for i in items if "repros" not in i.keywords]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if "repros" in i.keywords])
        items[:] = keep
