"""Sources: pinning vLLM (and the flash-attention it pins) to the image's commit, reading
their CMake, evaluating the arch guards, and applying the guard rules in patches/."""
