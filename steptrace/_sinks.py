"""Sinks consume finalized records; each runs behind its own bounded queue and thread.

A sink implements the tiny protocol :class:`Sink` (``export``, ``force_flush``,
``shutdown``, after OpenTelemetry's exporters). :class:`SinkWorker` gives each
sink a thread of its own, so a slow sink delays neither the training thread
nor the resolver (whose promptness is what makes device end times exact) nor
the other sinks. When a sink falls behind, records are dropped and counted
under ``sink:<name>``; sink exceptions are logged once and counted.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from steptrace._schema import invalid_record_reason, rejected_record_reason, sink_drop_reason
from steptrace._wakeup import Wakeup

# The C encoder json.dumps uses (None on an interpreter without the _json accelerator).
_c_encoder: Any = getattr(json.encoder, "c_make_encoder", None)
_encode_str: Any = getattr(json.encoder, "c_encode_basestring_ascii", None) or json.encoder.py_encode_basestring_ascii

log = logging.getLogger("steptrace")


class Sink(Protocol):
    """Where finalized records go. Called from the sink's own background thread."""

    name: str

    def export(self, records: Sequence[Mapping[str, Any]]) -> None: ...

    def force_flush(self, timeout_s: float) -> bool: ...

    def shutdown(self, timeout_s: float) -> None: ...


class JsonlSink:
    """The embedded default: ``<run_dir>/<run_id>/rank-<rank>.jsonl``, one record per line.

    Each batch goes to the OS in one unbuffered write, so every record handed over survives a
    crash of the training process. A record that cannot be encoded (a circular value in its
    attrs, say) costs that record alone (``invalid_records``, counted as ``invalid:jsonl``). A
    failed write (a full disk) is cut back to the last whole line before the batch is counted
    as dropped, so the file never holds a torn line in the middle; where even that fails, the
    next write starts on a fresh line (and readers skip the torn one).

    With ``max_bytes`` (> 0), the file is rotated before a batch would take it past that size:
    ``rank-<r>.jsonl`` is renamed ``rank-<r>.<k>.jsonl``, k = 1, 2, ... in the order they were
    written (a restart continues the numbering), and a new ``rank-<r>.jsonl`` is opened. Readers
    take the numbered files in order, then the unnumbered one. A batch is never split, so every
    file holds whole lines; a rotation that fails is logged once and writing goes on in the
    current file.
    """

    name = "jsonl"
    instant_flush = True  # unbuffered: force_flush only says so (SinkWorker calls it on the caller's thread)

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = 0):
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        #: Records that could not be encoded as JSON (each dropped alone).
        self.invalid_records = 0
        #: Files this sink rotated out (``rank-<r>.<k>.jsonl``).
        self.rotations = 0
        self._rotate_failed = False
        self._torn = False
        self._encode = record_encoder()
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, exist_ok=True)
            self._next_segment = 1 + max(rotated_segments(self.path), default=0)
            self._file = open(self.path, "ab", buffering=0)
            # A crashed earlier writer left half a line: end it, so our first record starts a
            # line of its own (readers skip the torn line).
            self._torn = self._file.tell() > 0 and not _ends_with_newline(self.path)
        except OSError as exc:
            raise ValueError(f"run_dir: cannot write {self.path}: {exc.strerror or exc}") from exc

    def _rotate(self) -> None:
        """Move the full file aside as the next numbered segment and start an empty one."""
        base, ext = os.path.splitext(self.path)
        target = f"{base}.{self._next_segment}{ext}"
        try:
            if os.path.exists(target):  # never overwrite: a segment is written once
                raise FileExistsError(f"{target} exists")
            os.rename(self.path, target)
            fresh = open(self.path, "ab", buffering=0)
        except OSError as exc:
            if not self._rotate_failed:
                self._rotate_failed = True
                log.warning("steptrace jsonl: cannot rotate %s (%s); writing on in it", self.path, exc)
            return
        self._file.close()
        self._file = fresh
        self._next_segment += 1
        self.rotations += 1
        self._torn = False  # the torn line, if any, stays at the end of the rotated file

    def export(self, records: Sequence[Mapping[str, Any]]) -> None:
        lines = []
        encode = self._encode
        for record in records:
            try:
                lines.append(encode(record))
            except (TypeError, ValueError, RecursionError):
                self.invalid_records += 1
                encode = self._encode = record_encoder()
        if not lines:
            return
        # One text and one bytes object for the batch: the last line's newline joined in, and the batch
        # copied again only to end a torn line (each copy of a ~1 MB batch is fresh pages to fault in).
        lines.append("")
        body = "\n".join(lines).encode("utf-8", "replace")
        if self.max_bytes > 0:
            size = self._file.tell()
            if size > 0 and size + len(body) > self.max_bytes:
                self._rotate()
        data = b"\n" + body if self._torn else body
        start = self._file.tell()
        try:
            view = memoryview(data)
            while view:
                written = self._file.write(view)
                view = view[written:]
            self._torn = False
        except OSError:
            try:
                self._file.truncate(start)  # never leave half a batch (a torn line) behind
            except OSError:
                self._torn = True
            raise

    def force_flush(self, timeout_s: float) -> bool:
        return True  # unbuffered: every batch is already with the OS

    def shutdown(self, timeout_s: float) -> None:
        self._file.close()


def rotated_segments(path: str) -> list[int]:
    """The numbers k of the rotated files ``<base>.<k>.jsonl`` beside *path* (``<base>.jsonl``)."""
    directory, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    pattern = re.compile(re.escape(stem) + r"\.(\d+)" + re.escape(ext) + "$")
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(pattern.match, names) if m)


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _dumps(record: Mapping[str, Any]) -> str:
    return json.dumps(record, default=_json_default, separators=(",", ":"))


def record_encoder() -> Callable[[Mapping[str, Any]], str]:
    """``record -> json.dumps(record, default=_json_default, separators=(",", ":"))``, the same text,
    from one encoder made here: ``json.dumps`` with any argument builds a ``JSONEncoder`` and a C
    encoder per call, a fifth of a step record's encoding time. For one thread (a sink's); after it
    raises (a circular or unencodable value), make a new one: its circular-reference markers may
    hold what the failed record left."""
    if _c_encoder is None:  # an interpreter without the _json accelerator
        return _dumps
    encoder = _c_encoder({}, _json_default, _encode_str, None, ":", ",", False, False, True)

    def encode(record: Mapping[str, Any]) -> str:
        return "".join(encoder(record, 0))

    return encode


def _json_default(value: Any) -> Any:
    """User attrs may hold numpy scalars and the like: numbers stay numbers, the rest becomes text."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except Exception:
            pass
    return str(value)


class DropCounter:
    """A run's drop counts by reason (call it, from any thread), and the names of the sinks that exist.

    Exporters that publish drops (``attach_drop_counter``) export the usual reasons of
    ``sink_names`` at 0 before any drop, and nothing for sinks that are not configured.
    """

    def __init__(self, read: Callable[[], dict[str, int]], sink_names: Iterable[str]):
        self._read = read
        self.sink_names = tuple(sink_names)

    def __call__(self) -> dict[str, int]:
        return self._read()


#: Records a sink is handed at most at once.
_BATCH_RECORDS = 1024
# How long an idle sink thread sleeps before it looks at its queue again, though nothing woke it. Every
# way records or a stop reach it wakes it (offer() into an empty queue, flush(), begin_stop()), so this
# is a safety net, not a poll: at 0.1 s its ten wake-ups a second were most of a sink's CPU on a JAX loop
# of 60 ms steps, whose records come in a batch a second (the resolver's value steps, _DEFER_STEPS):
# the sink's CPU per step went from 39 to 10 µs at 1 s (bench_jax_trainer.py, the 2-vCPU VM).
_IDLE_WAIT_S = 1.0


_DONE = threading.Event()
_DONE.set()


class SinkCall:
    """One of a sink's own calls (``force_flush``, ``shutdown``, a last ``export``) on a thread of its own,
    so the caller (``flush()``, ``shutdown()``, the atexit shutdown, on the training thread) waits for it
    only until a deadline: a tracker's ``shutdown`` can block for minutes (MLflow's HTTP retries with its
    server gone, W&B's ``finish()``, TensorBoard's ``close()`` behind a hung writer). A call that outlives
    the deadline is left to finish (or not) on its daemon thread."""

    def __init__(self, name: str, call: Callable[[], Any], inline: bool = False):
        self._call = call
        self.result: Any = None
        self.error: BaseException | None = None
        if inline:
            # A call that cannot block (``instant_flush``): a thread of its own would cost more than it
            # (~1 ms a flush() on the 2-vCPU VM), and so would an Event's locks (each release can hand the GIL
            # to a sink thread): run here, already done.
            self.done = _DONE
            self._run()
            return
        self.done = threading.Event()
        try:
            threading.Thread(target=self._run, name=name, daemon=True).start()
        except RuntimeError:  # no new thread (the interpreter is finalizing): run it here
            self._run()

    def _run(self) -> None:
        try:
            self.result = self._call()
        except BaseException as exc:  # the sink's own failure, reported by the caller
            self.error = exc
        finally:
            if self.done is not _DONE:
                self.done.set()

    def wait(self, deadline: float) -> bool:
        """Whether the call returned by ``deadline`` (``time.monotonic()``)."""
        if self.done.is_set():  # no lock taken: an inline call's case, every flush() of JSONL and memory
            return True
        return self.done.wait(max(0.0, deadline - time.monotonic()))


class SinkWorker:
    """A sink's bounded queue and background thread."""

    def __init__(self, sink: Sink, max_queue: int, count_drop: Callable[[str, int], None]):
        self.sink = sink
        self.name = getattr(sink, "name", type(sink).__name__)
        self._max_queue = max_queue
        self._count_drop = count_drop
        self._queue: collections.deque[Mapping[str, Any]] = collections.deque()
        self._wake = Wakeup()
        self._offered = 0
        self._done = 0
        self._stopping = False
        self._failures = 0
        self._in_flight = 0  # records in the export call now running
        # A sink with ``batch_delay_s`` (OTLP) gets a batch once its oldest record waited that
        # long (or the batch is full, or a flush or stop asks): one request then carries several
        # steps, and the request, not the records, is most of an export's CPU.
        self._batch_delay_s = max(0.0, float(getattr(sink, "batch_delay_s", 0.0) or 0.0))
        self._oldest_queued = 0.0  # time.monotonic() when the queue last went from empty to not
        # Record types after which the batch goes out at once, without the delay (OTLP: a
        # checkpoint, a stall): what a process killed there would otherwise lose is what waited.
        self._flush_at = frozenset(getattr(sink, "flush_at", ()) or ()) if self._batch_delay_s else frozenset()
        self._flush_through = 0  # records offered up to the last such one: exported without waiting
        self._urgent = 0  # flushes waiting: export at once
        self._urgent_lock = threading.Lock()  # flush() may run on several threads at once
        self._abandoned = False  # shutdown gave up on a hung export and counted its batch
        # Records exported that the sink has not yet said are written: a successful force_flush() says so
        # (for a sink whose ``flush_confirms`` is not False; W&B's run only holds them at finish()), and so
        # does a shutdown() that returned. A flush or shutdown that outlives its deadline leaves them
        # unfinished: counted as dropped then.
        self._unconfirmed = 0
        self._flush_confirms = getattr(sink, "flush_confirms", True) is not False
        # A sink whose force_flush only returns a value (JSONL: unbuffered; Prometheus; the in-memory sink)
        # says ``instant_flush = True``: it is called on the caller's thread, where a thread of its own would
        # cost ~1 ms a flush() (thread start and GIL hand-offs, measured on the 2-vCPU VM) for nothing.
        self._instant_flush = getattr(sink, "instant_flush", False) is True
        self._hung: SinkCall | None = None  # a force_flush/shutdown/export of the sink's that has not returned
        self._said_hung = False
        #: CPU seconds this sink's thread has used (it holds the GIL for nearly all of them).
        self.cpu_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name=f"steptrace-sink-{self.name}", daemon=True)
        self._thread.start()

    def offer(self, records: Sequence[Mapping[str, Any]]) -> None:
        queue = self._queue
        queued = len(queue)
        if self._stopping or queued + len(records) > self._max_queue:
            self._count_drop(sink_drop_reason(self.name), len(records))
            return
        if not queued:
            self._oldest_queued = time.monotonic()
        queue.extend(records)
        self._offered += len(records)
        urgent = False
        if self._flush_at and any(r.get("type") in self._flush_at for r in records):
            self._flush_through = self._offered
            urgent = True
        # The thread takes everything queued before it sleeps again (at most _IDLE_WAIT_S): it
        # needs waking only when it may be asleep with nothing to do (the queue was empty), or
        # asleep gathering a batch (batch_delay_s) that must now go out (full, or a flush_at record).
        if not queued or urgent or (self._batch_delay_s and queued + len(records) >= _BATCH_RECORDS):
            self._wake.set()

    def _run(self) -> None:
        cpu_start = time.thread_time()
        while True:
            self.cpu_seconds = time.thread_time() - cpu_start
            if not self._queue:
                self._wake.wait(_IDLE_WAIT_S)
            while self._queue:
                wait = self._gather_for()
                if wait > 0:
                    self._wake.wait(min(wait, 0.1))
                    break
                # Only this thread takes from the queue (offer() appends), so what len() counts is there,
                # unless stop() cleared it under a hung export: then what was taken goes out, as before.
                take = self._queue.popleft
                batch: list[Mapping[str, Any]] = []
                keep = batch.append
                try:
                    for _ in range(min(len(self._queue), _BATCH_RECORDS)):
                        keep(take())
                except IndexError:
                    pass
                self._export(batch)
                self._done += len(batch)
            if self._stopping and not self._queue:
                self.cpu_seconds = time.thread_time() - cpu_start
                return

    def _gather_for(self) -> float:
        """Seconds the queued records should still wait for others (0: export now)."""
        if not self._batch_delay_s or self._stopping or self._urgent or len(self._queue) >= _BATCH_RECORDS \
                or self._done < self._flush_through:
            return 0.0
        return self._oldest_queued + self._batch_delay_s - time.monotonic()

    def _export(self, batch: list[Mapping[str, Any]]) -> None:
        invalid_before = getattr(self.sink, "invalid_records", 0)
        rejected_before = dict(getattr(self.sink, "rejected", None) or {})
        self._in_flight = len(batch)
        failed = False
        lost = None
        try:
            self.sink.export(batch)
        except Exception as exc:
            failed = True
            # A sink may say how many of the batch's records the failure lost (it skips some kinds).
            lost = getattr(exc, "dropped_records", None)
            self._failures += 1
            if self._failures == 1 and not getattr(exc, "said", False):  # said: the sink told why already
                log.exception("steptrace sink %s failed; its records are dropped and counted", self.name)
        finally:
            self._in_flight = 0
        if self._abandoned:
            return  # shutdown already counted this batch as dropped
        invalid = max(0, getattr(self.sink, "invalid_records", 0) - invalid_before)
        if invalid:
            self._count_drop(invalid_record_reason(self.name), invalid)
        # Spans the receiver refused (OTLP partial_success), by its reason.
        for reason, count in (getattr(self.sink, "rejected", None) or {}).items():
            if count > rejected_before.get(reason, 0):
                self._count_drop(rejected_record_reason(self.name, reason), count - rejected_before.get(reason, 0))
        if failed:
            if not isinstance(lost, int) or not 0 <= lost <= len(batch) - invalid:
                lost = len(batch) - invalid
            if lost:
                self._count_drop(sink_drop_reason(self.name), lost)
            self._unconfirmed += len(batch) - invalid - lost
        else:
            self._unconfirmed += len(batch) - invalid

    def _call(self, what: str, call: Callable[[], Any], inline: bool = False) -> SinkCall | None:
        """Start one of the sink's own calls off the caller's thread (``inline``: on it); None while an
        earlier one has not returned (the sink is stuck in it: another would only pile up threads)."""
        hung = self._hung
        if hung is not None and not hung.done.is_set():
            return None
        self._hung = None
        return SinkCall(f"steptrace-sink-{self.name}-{what}", call, inline)

    def _ended(self, what: str, call: SinkCall | None, deadline: float, final: bool) -> tuple[bool, Any]:
        """Wait for ``call`` until ``deadline``: ``(returned, result)``. With ``final`` (shutdown), a call
        that did not return leaves the records the sink had not confirmed written unfinished: they are
        counted as dropped, and said."""
        if call is not None and call.wait(deadline):
            if call.error is not None:
                log.error("steptrace sink %s failed to %s: %s: %s", self.name, what, type(call.error).__name__,
                          call.error)
                return True, None
            return True, call.result
        if call is not None:
            self._hung = call
        if final:
            lost, self._unconfirmed = self._unconfirmed, 0
            if lost:
                self._count_drop(sink_drop_reason(self.name), lost)
            if not self._said_hung:
                self._said_hung = True
                log.warning("steptrace sink %s: its %s did not return within the shutdown timeout; left "
                            "running on a daemon thread%s", self.name, what,
                            f", and the {lost} records it had not confirmed written are counted as dropped "
                            f"(sink:{self.name})" if lost else "")
        return False, None

    def _flushed(self, call: SinkCall | None, deadline: float, final: bool) -> bool:
        returned, result = self._ended("force_flush", call, deadline, final)
        if returned and result and self._flush_confirms:
            self._unconfirmed = 0
        return returned and bool(result)

    def flush(self, deadline: float) -> bool:
        """Wait until everything offered so far is exported, then flush the sink (its ``force_flush`` off
        this thread, waited for until ``deadline``)."""
        return self.exported(deadline) and self.end_flush(self.begin_flush(), deadline)

    def begin_flush(self) -> SinkCall | None:
        """Start the sink's ``force_flush`` (every sink's at once: one that hangs must not use up the
        others' time); :meth:`end_flush` waits for it."""
        return self._call("force_flush",
                          lambda: self.sink.force_flush(max(0.0, self._flush_deadline - time.monotonic())),
                          self._instant_flush)

    def end_flush(self, call: SinkCall | None, deadline: float) -> bool:
        return self._flushed(call, deadline, final=False)

    _flush_deadline = 0.0  # what begin_flush() tells the sink it has: set by the caller before it

    def exported(self, deadline: float) -> bool:
        """Wait until everything offered so far is exported (not yet flushed by the sink)."""
        self._flush_deadline = deadline
        target = self._offered
        with self._urgent_lock:
            self._urgent += 1
        try:
            while self._done < target:
                if time.monotonic() >= deadline or not self._thread.is_alive():
                    return False
                self._wake.set()
                time.sleep(0.001)
        finally:
            with self._urgent_lock:
                self._urgent -= 1
        return True

    def forked(self) -> None:
        """In a forked child: offer nothing more and drop the copied queue (the parent exports it)."""
        self._stopping = True
        self._urgent_lock = threading.Lock()
        self._queue.clear()

    def begin_stop(self) -> None:
        """Let the thread export what is queued and exit (every sink at once: one hung export must
        not use up the others' time)."""
        self._stopping = True
        self._wake.set()

    def stop(self, deadline: float) -> bool:
        """Export what is queued (until ``deadline``), stop the thread, and count as dropped whatever
        did not get out: records still queued and a batch stuck in an export that never returned.
        After this the drop counts for this sink are final. True when nothing was left."""
        self.end_stop(self.stop_thread(deadline), deadline)
        return self._stop_complete

    def stop_thread(self, deadline: float) -> SinkCall | None:
        """:meth:`stop`'s first half: the thread exports what is queued and ends (until ``deadline``);
        then the sink's ``force_flush`` starts, off this thread (None: none, the thread is still in an
        export, or the sink is still in an earlier call)."""
        self.begin_stop()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            return None
        self._flush_deadline = deadline
        return self.begin_flush()

    def end_stop(self, call: SinkCall | None, deadline: float) -> None:
        """:meth:`stop`'s second half: wait for the flush until ``deadline`` and count what is lost."""
        flushed = True
        hung_flush = False
        if not self._thread.is_alive():
            flushed = self._flushed(call, deadline, final=False)
            hung_flush = call is None or not call.done.is_set()
            if hung_flush:
                self._ended("force_flush", None, deadline, final=True)  # counts the unconfirmed records
        left = len(self._queue)
        if left:
            # The thread may still be alive (a hung export): make sure it stops here
            # rather than exporting after shutdown() has returned.
            self._queue.clear()
            self._count_drop(sink_drop_reason(self.name), left)
        in_flight = self._in_flight if self._thread.is_alive() else 0
        if in_flight:
            self._abandoned = True
            self._count_drop(sink_drop_reason(self.name), in_flight)
        # A sink stuck in its flush gets nothing more (the run record would wait behind it).
        self._stopped_cleanly = not self._thread.is_alive() and not hung_flush
        self._stop_complete = flushed and not left and not in_flight

    _stop_complete = False

    def deliver_last(self, records: Sequence[Mapping[str, Any]], deadline: float | None = None) -> None:
        """Export the run's last records (the run record, with the final counts) after :meth:`stop`, off
        this thread, until ``deadline``; a sink whose export or flush hung gets nothing more (and counts
        it), and so does one whose export of these does not return in time."""
        self.end_deliver(self.begin_deliver(records), len(records), 1e18 if deadline is None else deadline)

    def begin_deliver(self, records: Sequence[Mapping[str, Any]]) -> SinkCall | None:
        """Start :meth:`deliver_last`'s export (every sink's at once); None: not started, counted dropped."""
        if not getattr(self, "_stopped_cleanly", False):
            self._count_drop(sink_drop_reason(self.name), len(records))
            return None
        batch = list(records)
        call = self._call("export", lambda: self._export(batch))
        if call is None:
            self._count_drop(sink_drop_reason(self.name), len(batch))
        return call

    def end_deliver(self, call: SinkCall | None, count: int, deadline: float) -> None:
        if call is not None and not call.wait(deadline):
            self._hung = call
            self._abandoned = True  # the export, if it ever returns, counts nothing more
            self._count_drop(sink_drop_reason(self.name), count)

    def begin_close(self, deadline: float) -> SinkCall | None:
        """Start the sink's ``shutdown`` off this thread (every sink's at once); :meth:`end_close` waits."""
        return self._call("shutdown", lambda: self.sink.shutdown(max(0.0, deadline - time.monotonic())))

    def end_close(self, call: SinkCall | None, deadline: float) -> bool:
        """Whether the sink's shutdown returned by ``deadline`` without raising; if it did not return,
        what it had not confirmed written is counted as dropped (and said)."""
        returned, _ = self._ended("shutdown", call, deadline, final=True)
        if returned and call is not None and call.error is None:
            self._unconfirmed = 0
            return True
        return False

    def close(self, deadline: float) -> bool:
        return self.end_close(self.begin_close(deadline), deadline)

    def shutdown(self, deadline: float) -> bool:
        """stop() then close(): for sinks used on their own."""
        stopped = self.stop(deadline)
        return self.close(deadline) and stopped
