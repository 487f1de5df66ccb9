# Rendered by sm121-build <VERSION>: native 12.1 kernels for vllm/vllm-openai@sha256:abababababababababababababababababababababababababababababababab
# vLLM 0.19.1 (tag v0.19.1), extensions: _C_stable_libtorch.abi3.so, _moe_C_stable_libtorch.abi3.so
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
# (no external project sources: vLLM's CMake gets empty stand-ins for them)
# the image lacks cmake: this machine's copies, in the builder stage only
COPY tools/ /sm121/tools/
ENV PATH=/sm121/tools/bin:/sm121/tools/cmake/bin:$PATH
# (libnvrtc.so present: no link fix needed)
RUN python3 /sm121/build_extensions.py --source /sm121/src --out /sm121/out --build-dir /sm121/build --target _C_stable_libtorch --target _moe_C_stable_libtorch --stand-in VLLM_FLASH_ATTN_SRC_DIR

# --- final: the pristine stock image, with ONLY the rebuilt extensions copied in ---
FROM vllm/vllm-openai@sha256:abababababababababababababababababababababababababababababababab
COPY --from=builder /sm121/out/_C_stable_libtorch.abi3.so /opt/venv/lib/python3.11/site-packages/vllm/_C_stable_libtorch.abi3.so
COPY --from=builder /sm121/out/_moe_C_stable_libtorch.abi3.so /opt/venv/lib/python3.11/site-packages/vllm/_moe_C_stable_libtorch.abi3.so
LABEL "io.github.sm121-build.vllm.version"="0.19.1" \
      "org.opencontainers.image.base.digest"="vllm/vllm-openai@sha256:abababababababababababababababababababababababababababababababab"
