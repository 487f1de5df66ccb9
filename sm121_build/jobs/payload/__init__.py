"""What runs inside the builder stage: `build_extensions.py`, copied into the build context
and run by the image's own python3 (`python3 /sm121/build_extensions.py --source … --out …
--target …`, see dockerfiles/build.Dockerfile.in), and by `sm121-build local` in this
process.  Its interface is its command line (`build_extensions.main(argv, environ)`): the
standard library only, no import of this package, so it runs in any image with a Python.
"""

from __future__ import annotations

from pathlib import Path

# the file the build context gets
PAYLOAD = Path(__file__).with_name("build_extensions.py")
