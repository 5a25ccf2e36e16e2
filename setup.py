"""The optional C extension; everything else about the package is in pyproject.toml.

``steptrace._hotpath`` (steptrace/_hotpath.c) runs the step handle's per-step methods in C. It is
optional: where it cannot be compiled (no C compiler or Python headers) the install goes on and the
same methods run in Python (steptrace/_handles.py), with the same behaviour and a higher cost per step.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("steptrace._hotpath", ["steptrace/_hotpath.c"], optional=True)])
