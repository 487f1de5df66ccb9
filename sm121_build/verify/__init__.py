"""Verifying: the ELF/fatbin reader (the one module that parses them), CUDA's loading rules,
the audit and its reports, whether a rebuild can help, and the checks of a built image."""
