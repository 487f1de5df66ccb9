"""`doctor` and `prune`."""
