"""Where a ``steptrace.steps()`` loop is: in its body, left, or left by an exception.

A ``for`` loop never tells its iterator why it stopped: ``break``, ``return`` and an exception in the
body all just drop the loop's reference to the generator. When nothing else holds it, CPython closes
it there and then (``GeneratorExit`` at its ``yield``), with the exception in flight hidden from it
(``_PyGen_Finalize`` in Objects/genobject.c saves and clears it around the close). When a variable
still holds it, nothing happens at all. So for the step it opened, ``steps()`` keeps the frame that
runs the loop (the *consumer*) and the bytecode offsets of the loop's body (every line from its
``for`` to its last body line, exception handlers and ``with`` clean-ups included, which CPython
places after the function's other code), and decides from where the consumer is:

* closed by the consumer while inside the body (the loop's own reference dropped): at an
  instruction that pops the iterator or returns (``break``, ``return``, an ``islice`` run out), the
  loop was left; at any other, that instruction raised and the frame is unwinding;
* asked at a later steptrace call on the loop's thread: the consumer on the stack inside the body is
  still running it; on the stack elsewhere, or finished at a return, it left; finished inside the
  body at any other instruction, it raised out of the body;
* closed explicitly (``close()``: the generator is still referenced, where a collection has already
  cleared its weak references, Modules/gcmodule.c and Objects/genobject.c) or from another thread:
  left, or decided at the next call on the loop's thread.

The exception itself is read where Python keeps it: ``sys.exc_info()`` while a handler (or a
``finally``) runs on the loop's thread, and ``sys.last_exc`` / ``sys.last_value`` once it ended the
program (set before ``atexit`` runs). It is the body's when its traceback passes through the consumer
frame at a body offset. A body that raised before it could be read is still an error step; its
text then says where the body raised (``ERROR_UNREAD``).

CPython only (frames, ``f_lasti`` and ``co_lines``); a consumer that is not a ``for`` loop
(``next()`` by hand, ``list()``) gets none of this: its step ends when the generator resumes or
closes.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

#: Verdicts on a loop's consumer.
RUNNING, LEFT, RAISED = "running", "left", "raised"
#: The text of an error step whose exception was handled before steptrace could read it.
ERROR_UNREAD = "exception left the steps() loop body at {where}"
#: Instructions at which a loop's frame drops the generator without raising: popping the iterator
#: (``break``, ``return``; ``END_FOR``/``FOR_ITER`` when an ``islice`` or ``zip`` around it ran out),
#: returning, a generator consumer closed at its ``yield``, a store or delete of the variable
#: holding it, an ``except`` block ending (its traceback held the frame).
_NORMAL_EXITS = frozenset((
    "POP_TOP", "POP_ITER", "END_FOR", "FOR_ITER", "RETURN_VALUE", "RETURN_CONST", "YIELD_VALUE", "SEND",
    "RESUME", "POP_EXCEPT", "STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF", "STORE_ATTR",
    "STORE_SUBSCR", "DELETE_FAST", "DELETE_NAME", "DELETE_GLOBAL", "DELETE_DEREF", "DELETE_ATTR",
    "DELETE_SUBSCR"))
#: A frame off the stack stopped at one of these returned (or is a generator suspended at a yield).
_RETURNED = frozenset(("RETURN_VALUE", "RETURN_CONST"))
_SUSPENDED = frozenset(("YIELD_VALUE", "SEND", "RESUME"))
#: Body offsets by (code, offset of the loop's FOR_ITER); None: not a for loop.
_BODIES: dict[tuple[Any, int], frozenset[int] | None] = {}
_BODIES_KEPT = 256
_settle_lock = threading.Lock()


class Loop:
    """A ``for`` loop over a ``steps()`` generator: its frame, its ``FOR_ITER``'s offset, its body's
    offsets, its thread."""

    __slots__ = ("frame", "lasti", "body", "thread")

    def __init__(self, frame: Any, lasti: int, body: frozenset[int], thread: int):
        self.frame = frame
        self.lasti = lasti
        self.body = body
        self.thread = thread


def loop_of(consumer: Any) -> Loop | None:
    """The loop ``consumer`` (the frame that resumed the generator) runs, or None when it is not at a
    ``FOR_ITER`` (the generator is driven by ``next()``, ``list()``, ...) or there is none."""
    if consumer is None:
        return None
    code, lasti = consumer.f_code, consumer.f_lasti
    key = (code, lasti)
    try:
        body = _BODIES[key]
    except KeyError:
        body = _body_offsets(code, lasti)
        if len(_BODIES) >= _BODIES_KEPT:
            _BODIES.clear()
        _BODIES[key] = body
    return None if body is None else Loop(consumer, lasti, body, threading.get_ident())


def same_loop(loop: Loop, consumer: Any) -> bool:
    """Whether ``consumer`` resumed the generator from ``loop`` (the same frame at the same ``for``)."""
    return consumer is not None and loop.frame is consumer and consumer.f_lasti == loop.lasti


def release(loop: Loop | None) -> None:
    """A step that did not end by its loop asking for more lets go of the loop's frame (and of every
    variable the frame holds); a generator resumed later finds a new one."""
    if loop is not None:
        loop.frame = None


def _body_offsets(code: Any, lasti: int) -> frozenset[int] | None:
    import dis

    target = None
    for instruction in dis.get_instructions(code):
        if instruction.offset == lasti:
            if instruction.opname != "FOR_ITER" or not isinstance(instruction.argval, int):
                return None
            target = instruction.argval  # where the loop goes when the iterator runs out
            break
    if target is None:
        return None
    lines = [line for start, end, line in code.co_lines() if line is not None and start < target and end > lasti]
    if not lines:
        return None
    first, last = min(lines), max(lines)
    return frozenset(offset for start, end, line in code.co_lines()
                     if line is not None and first <= line <= last for offset in range(start, end, 2))


def _opname(code: Any, offset: int) -> str:
    import opcode

    try:
        return opcode.opname[code.co_code[offset]]
    except (IndexError, TypeError):
        return "?"


def position(loop: Loop, start: Any, *, new_step: bool = False) -> str:
    """Where ``loop``'s consumer is, asked on the loop's thread from frame ``start`` (the caller of
    steptrace: the walk up from there reads frames the loop's thread already has, where starting at
    steptrace's own would make a frame object for each, on every call): :data:`RUNNING` (in the
    body), :data:`LEFT` or :data:`RAISED`. A consumer that is itself a generator suspended in its
    body (``yield batch`` inside the loop) runs the body in whatever drives it: a span there is the
    step's, but a new step (``new_step``) says that body is done (steps do not nest)."""
    consumer = loop.frame
    frame = start
    while frame is not None:
        if frame is consumer:
            return RUNNING if consumer.f_lasti in loop.body else LEFT
        frame = frame.f_back
    # Off the stack: finished, or a generator suspended at a yield.
    lasti = consumer.f_lasti
    if lasti not in loop.body:
        return LEFT
    name = _opname(consumer.f_code, lasti)
    if name in _SUSPENDED:
        return LEFT if new_step else RUNNING
    return LEFT if name in _RETURNED else RAISED


def closed(loop: Loop | None, closer: Any, collected: bool) -> str | None:
    """The verdict when the generator gets ``GeneratorExit``: ``closer`` is the frame closing it,
    ``collected`` whether it is being deallocated (not an explicit ``close()``). None: not on the
    loop's thread (a collection on another thread); the next call on the loop's thread decides."""
    if loop is None:
        return LEFT
    if loop.thread != threading.get_ident():
        return None
    if not collected:
        return LEFT
    consumer = loop.frame
    if closer is consumer:
        lasti = consumer.f_lasti
        if lasti in loop.body and _opname(consumer.f_code, lasti) not in _NORMAL_EXITS:
            return RAISED
        return LEFT
    verdict = position(loop, closer)
    return LEFT if verdict == RUNNING else verdict


def exception_of(loop: Loop, *, on_loop_thread: bool) -> BaseException | None:
    """The exception that left ``loop``'s body, where Python still has it: the one being handled on
    this thread (``on_loop_thread``), or the one that ended the program; else None."""
    candidates = []
    if on_loop_thread:
        candidates.append(sys.exc_info()[1])
    candidates.append(getattr(sys, "last_exc", None))  # Python 3.12+
    candidates.append(getattr(sys, "last_value", None))
    for exc in candidates:
        seen = 0
        while isinstance(exc, BaseException) and seen < 16:  # its cause or context may be the body's
            if _raised_in(loop, exc):
                return exc
            exc = exc.__cause__ or exc.__context__
            seen += 1
    return None


def _raised_in(loop: Loop, exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame is loop.frame and tb.tb_lasti in loop.body:
            return True
        tb = tb.tb_next
    return False


def unread_error(loop: Loop) -> str:
    """The error text of a step whose body raised an exception steptrace has not (yet) read."""
    frame = loop.frame
    return ERROR_UNREAD.format(where=f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")


def error_text(exc: BaseException) -> str:
    """As ``with steptrace.step(n)`` records an exception."""
    return f"{type(exc).__name__}: {exc}"


def settle(step: Any, *, on_loop_thread: bool, give_up: bool) -> bool:
    """A step whose body raised, its exception not read yet (``error_pending``): take the exception's
    text if it can be found now; with ``give_up``, keep the text it has. True once settled (its record
    can be written). Called by the training thread and the resolver; the first to settle wins."""
    loop = step.loop
    exc = exception_of(loop, on_loop_thread=on_loop_thread) if loop is not None else None
    if exc is None and not give_up:
        return False
    with _settle_lock:
        if step.error_pending:
            if exc is not None:
                step.error = error_text(exc)
            release(step.loop)  # the frame (and its variables) are not kept past the step
            step.loop = None
            step.error_pending = False
    return True
