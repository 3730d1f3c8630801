"""The case kernel: CaseSpec and ModelCase (pure data), the module graph the oracle reads, build, Violation; it imports nothing above it."""
