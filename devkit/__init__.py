"""Helpers shared by the tests and the benchmarks, in one place (never shipped): the real
toolchain and cached nvcc builds, PyPI downloads, the CLI runner and its one-line-error
check, git, the Docker engine and the stock-like fixture image, image tarballs, a loopback
registry, and the two stand-ins at the engine boundary (dirfiles: an image's files as a
folder; fakeengine: a FAKE engine for the pipeline's unit tests)."""
