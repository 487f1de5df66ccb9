"""The `audit` command's work: reading any input (file, folder, wheel, image tarball, local
image) for its device code, the per-file and per-package report, and `--source` verdicts
from the main job's decide step.  An image's engine is imported only to read an image."""
