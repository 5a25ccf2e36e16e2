"""steptrace's version, in a leaf module so exporters and the collector can name it without
importing the package root (which imports them). Keep it equal to ``version`` in pyproject.toml
(``tests/test_api.py`` checks)."""

__version__ = "0.1.0"
