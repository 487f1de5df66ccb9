"""What the commands do: the main job and its one owner (`run`), inject, aot, kernels
images, local, prune, doctor."""
