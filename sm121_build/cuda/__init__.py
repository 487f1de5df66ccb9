"""CUDA binaries: the ELF/fatbin reader (the one place that parses them), CUDA's loading
rules (which cubin or PTX a GPU and driver load), and one binary's audit (`binary`)."""
