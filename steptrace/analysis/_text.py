"""Text from run files is data: shown as it is, never read as markup or terminal control.

Names in a run (span and idle reasons, run ids, tags, host names) come from
whoever wrote the files. Rendered raw they can be rich markup (``fetch[/tmp]``
ends the command with a markup error), matplotlib mathtext (``$\\alpha_$``),
terminal control sequences (ESC, BEL) or markdown that injects headings,
images and @mentions into a PR comment.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["code_span", "literal_text", "markup", "visible"]

T = TypeVar("T")

# C0 controls but tab, DEL and C1 controls; newlines too (a name is one line).
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def visible(value: Any) -> str:
    """``str(value)`` with every control character written as an escape (``\\x1b``, ``\\n``)."""
    text = value if isinstance(value, str) else str(value)
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def markup(value: Any) -> str:
    """``value`` as literal text in rich markup: controls made visible, ``[`` escaped."""
    from rich.markup import escape

    return escape(visible(value))


def code_span(value: Any) -> str:
    """``value`` as a markdown code span: no heading, image, link, mention or emphasis inside it is read.

    The fence is one backtick longer than the longest run of backticks in the text, and
    newlines are made visible, so nothing can close it early (CommonMark 6.1).
    """
    text = visible(value)
    longest = max((len(m) for m in re.findall("`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith(("`", " ")) or text.endswith(("`", " ")) else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def literal_text(fn: Callable[..., T]) -> Callable[..., T]:
    """Run a plotting function with matplotlib's mathtext off: ``$`` in a name is a dollar sign."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        import matplotlib

        with matplotlib.rc_context({"text.parse_math": False}):
            return fn(*args, **kwargs)

    return wrapper
