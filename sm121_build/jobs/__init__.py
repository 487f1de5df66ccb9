"""Jobs: the main job (its plan and its carrying out), aot, inject, the local build, kernels
images, doctor and prune; the pipeline they run through, the rendered Dockerfiles and the
in-container build script (a resource)."""
