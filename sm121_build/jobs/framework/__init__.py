"""The framework a command runs in: the pipeline over the engine, the session, the run's
warnings, the sandbox a source tree's CMake is evaluated in."""
