"""Framework adapters, installed as ``steptrace.adapters``.

Each adapter imports its framework lazily, only when used, and raises an
``ImportError`` that names the ``pip install`` that fixes a missing one.
"""
