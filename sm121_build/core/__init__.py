"""The bottom layer: the vocabulary every other layer shares and nothing above it defines
again (errors and exit codes, labels, cache and state paths, vLLM's extension names and
external projects, shipped data, console output, units).  It imports nothing of the package
above it."""
