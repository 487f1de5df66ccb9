# Rendered by sm121-build <VERSION>: native 12.1 kernels for vllm/vllm-openai@sha256:abababababababababababababababababababababababababababababababab
# vLLM 0.19.1 (tag v0.19.1), extensions: _C.abi3.so, _moe_C.abi3.so, vllm_flash_attn/_vllm_fa2_C.abi3.so
# No "syntax=" directive on purpose: it would pull an image, which fails air-gapped.

# --- builder: the stock image itself, so torch, CUDA and Python match exactly ---
FROM vllm/vllm-openai@sha256:abababababababababababababababababababababababababababababababab AS builder
ENV TORCH_CUDA_ARCH_LIST="12.1" \
    VLLM_TARGET_DEVICE=cuda \
    CUDA_HOME=/usr/local/cuda \
    CMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
    CPATH=/usr/local/lib/python3.12/dist-packages/nvidia/cu13/include \
    LIBRARY_PATH=/usr/local/lib/python3.12/dist-packages/nvidia/cu13/lib \
    MAX_JOBS=8 \
    NVCC_THREADS=2 \
    CCACHE_DIR=/root/.cache/ccache
COPY src/ /sm121/src/
COPY build_extensions.py /sm121/build_extensions.py
COPY vllm-flash-attn/ /sm121/vllm-flash-attn/
ENV VLLM_FLASH_ATTN_SRC_DIR=/sm121/vllm-flash-attn
# (cmake and ninja: the image's own)
RUN ln -sf /usr/local/lib/python3.12/dist-packages/nvidia/cu13/lib/libnvrtc.so.13 /usr/local/lib/python3.12/dist-packages/nvidia/cu13/lib/libnvrtc.so
RUN --mount=type=cache,target=/root/.cache/ccache python3 /sm121/build_extensions.py --source /sm121/src --out /sm121/out --build-dir /sm121/build --target _C --target _moe_C --target _vllm_fa2_C

# --- final: the pristine stock image, with ONLY the rebuilt extensions copied in ---
FROM vllm/vllm-openai@sha256:abababababababababababababababababababababababababababababababab
COPY --from=builder /sm121/out/_C.abi3.so /usr/local/lib/python3.12/dist-packages/vllm/_C.abi3.so
COPY --from=builder /sm121/out/_moe_C.abi3.so /usr/local/lib/python3.12/dist-packages/vllm/_moe_C.abi3.so
COPY --from=builder /sm121/out/_vllm_fa2_C.abi3.so /usr/local/lib/python3.12/dist-packages/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
LABEL "io.github.sm121-build.vllm.version"="0.19.1" \
      "org.opencontainers.image.base.digest"="vllm/vllm-openai@sha256:abababababababababababababababababababababababababababababababab"
