"""sm121-build: native sm_121 (DGX Spark / GB10) kernels for stock vLLM images."""

from functools import cache


@cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sm121-build")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0.0.0+source"


def __getattr__(name: str) -> str:
    """`__version__`, read from the installed metadata when first asked (importlib.metadata
    is a sixth of a short command's start-up)."""
    if name == "__version__":
        return _version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
