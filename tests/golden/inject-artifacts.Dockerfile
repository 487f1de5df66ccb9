# Rendered by sm121-build <VERSION>: prebuilt 12.1 kernels injected into vllm/vllm-openai@sha256:abababababababababababababababababababababababababababababababab
# vLLM 0.19.1 (tag v0.19.1), extensions: _C.abi3.so, _moe_C.abi3.so; no compile step.
# No "syntax=" directive on purpose: it would pull an image, which fails air-gapped.

# --- the pristine stock image, with ONLY the prebuilt extensions copied in ---
FROM vllm/vllm-openai@sha256:abababababababababababababababababababababababababababababababab
COPY artifacts/_C.abi3.so /usr/local/lib/python3.12/dist-packages/vllm/_C.abi3.so
COPY artifacts/_moe_C.abi3.so /usr/local/lib/python3.12/dist-packages/vllm/_moe_C.abi3.so
LABEL "io.github.sm121-build.vllm.version"="0.19.1" \
      "org.opencontainers.image.base.digest"="vllm/vllm-openai@sha256:abababababababababababababababababababababababababababababababab"
