"""Building: deciding whether a rebuild helps, rendering the Dockerfile, the in-container build
script, the main job's pipeline and its build/inject tail, and the artifacts it exports."""
