"""The suite's self-check machinery: FSDP from a source tree (the overlay), and the mutation catalog and its runner."""
