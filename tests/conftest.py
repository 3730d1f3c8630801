"""The suite's own tests: the options, fixtures and report come from the
package's pytest plugin (conformance.plugin, the pytest11 entry point); the
Hypothesis profile is loaded here too, since these tests draw cases."""

from conformance.plugin import ensure_profile


def pytest_configure(config):
    ensure_profile(config)
