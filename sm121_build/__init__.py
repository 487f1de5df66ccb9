"""sm121-build: native sm_121 (DGX Spark / GB10) kernels for stock vLLM images."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("sm121-build")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"
