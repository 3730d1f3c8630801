"""What several areas share: the Area record, the catalog's Invariant, the
FSDP1 and FSDP2 wrap-plan oracles and adapters, API support checks, one
optimizer factory and single-process reference, rank agreement, one
violation factory, the repro preamble."""
