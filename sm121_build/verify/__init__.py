"""Verifying a built image (kernels by name, ABI against the base's torch, layer drift) and
an aot'd file against its stock file; the record of a run is jobs/framework/run_record."""
