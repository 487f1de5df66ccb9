"""Jobs, a folder per command family (the main run, kernels images and inject, prove, aot,
doctor and prune) over what they share: the pipeline they run through (framework), the
rendered Dockerfiles and artifacts (formats) and the in-container payload."""
