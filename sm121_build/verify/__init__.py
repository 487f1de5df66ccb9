"""Verifying a built image (kernels by name, ABI against the base's torch, layer drift) and
the run record a build or inject writes."""
