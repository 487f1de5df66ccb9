# Built by sm121-build: the throwaway containers a source tree's CMake is evaluated in.
# Nothing but this host's cmake, the libraries it loads and CMake's modules; no shell.
# No "syntax=" directive on purpose: it would pull an image, which fails air-gapped.
FROM scratch
COPY root/ /
LABEL io.github.sm121-build.kind="cmake-evaluator"
USER 65534:65534
