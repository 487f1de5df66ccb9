"""The files the tool writes and reads: the artifacts folder and its manifest, the rendered
Dockerfiles."""
