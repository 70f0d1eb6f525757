"""The single-request loop as it was before the one batched loop: a private baseline for the B=1 speed comparison, deleted once measured."""
