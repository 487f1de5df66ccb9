"""CUDA binaries: ELF (`elf`), fatbins (`fatbin`, rewritten by `fatbin_rewrite`), dynamic
symbols (`dynsym`), host code (`host`), wheels (`wheel`): the one layer that parses them;
CUDA's loading rules and the GPU table (`compat`), NVIDIA's tools (`ptxas`, `nvidia_smi`),
and one binary's audit (`binary`)."""
