"""The optional C extension; everything else about the package is in pyproject.toml.

``steptrace._hotpath`` (steptrace/_hotpath.c) runs the step handle's per-step methods in C. It is
optional: where it cannot be compiled (no C compiler or Python headers) the install goes on and the
same methods run in Python (steptrace/_handles.py), with the same behaviour and a higher cost per step.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "steptrace/_hotpath.c"
# The source's hash goes into the binary: steptrace._handles runs the Python calls instead of a module
# built from another version of the file (an in-place build that failed leaves the old one behind).
SOURCE_SHA256 = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

setup(ext_modules=[Extension("steptrace._hotpath", [SOURCE], optional=True,
                             define_macros=[("STEPTRACE_HOTPATH_SHA256", f'"{SOURCE_SHA256}"')])])
