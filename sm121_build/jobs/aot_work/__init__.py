"""`aot`: the files it rewrites, the compile loop over the cores, and the main job's aot step."""
