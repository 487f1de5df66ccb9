# Rendered by sm121-build <VERSION>: a kernels image, the verified extensions of one
# build at their paths in the base and its manifest (/sm121-build/manifest.json); nothing
# runs in it: `sm121-build inject --from` reads it back through the engine.
# No "syntax=" directive on purpose: it would pull an image, which fails air-gapped.
FROM scratch
COPY root/ /
LABEL "io.github.sm121-build.arch-list"="12.1" \
      "io.github.sm121-build.extensions"="_C.abi3.so,_moe_C.abi3.so" \
      "io.github.sm121-build.kind"="kernels" \
      "io.github.sm121-build.patches"="0123456789abcdef" \
      "io.github.sm121-build.reuse-key"="f163d04f51b20f73333732f5" \
      "io.github.sm121-build.torch.version"="2.11.0+cu130" \
      "io.github.sm121-build.vllm.commit"="v0.19.1" \
      "io.github.sm121-build.vllm.version"="0.19.1" \
      "org.opencontainers.image.base.digest"="vllm/vllm-openai@sha256:abababababababababababababababababababababababababababababababab"
