"""Configuration: one validated dataclass, filled from code, then ``STEPTRACE_*``, then launchers.

Every environment variable steptrace reads is a documented constant here, so the
README and the code cannot drift apart. Validation happens in
:func:`resolve_config`, at ``init()``: bad configuration fails loudly there
(``ValueError`` naming the field), never inside the training loop.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import warnings
import secrets
import sys
import time
from typing import Any, Sequence

from ._errors import SteptraceWarning
from ._ids import run_id_problem

#: Set to ``1``/``true`` to turn every steptrace call into a no-op.
ENV_DISABLED = "STEPTRACE_DISABLED"
#: Set to ``1``/``true`` to run the per-step calls in Python even where the C extension
#: (steptrace/_hotpath.c) was built. Read once, at ``import steptrace``.
ENV_PURE_PYTHON = "STEPTRACE_PURE_PYTHON"
#: Directory that holds one sub-directory per run (default ``steptrace-runs``).
ENV_RUN_DIR = "STEPTRACE_RUN_DIR"
#: Identifier shared by every rank of one run.
ENV_RUN_ID = "STEPTRACE_RUN_ID"
#: This process's rank (falls back to ``RANK``, then the JAX process index).
ENV_RANK = "STEPTRACE_RANK"
#: Number of ranks (falls back to ``WORLD_SIZE``, then the JAX process count).
ENV_WORLD_SIZE = "STEPTRACE_WORLD_SIZE"
#: Rank on this host, used to pick per-rank ports (falls back to ``LOCAL_RANK``).
ENV_LOCAL_RANK = "STEPTRACE_LOCAL_RANK"
#: Device backend: ``auto``, ``host``, ``jax`` or ``torch``.
ENV_BACKEND = "STEPTRACE_BACKEND"
#: Peak dense TFLOP/s of one device, for MFU.
ENV_PEAK_TFLOPS = "STEPTRACE_PEAK_TFLOPS"
#: ``auto``: every step's hardware FLOPs from the compiler (XLA cost analysis, torch's FLOP counter).
ENV_FLOPS = "STEPTRACE_FLOPS"
#: ``1`` makes misuse inside the loop raise instead of warn (for tests and CI).
ENV_STRICT = "STEPTRACE_STRICT"
#: ``0`` turns off profiler annotations (XProf ``StepTraceAnnotation``, torch ``record_function``).
ENV_ANNOTATE = "STEPTRACE_ANNOTATE"
#: Records that may wait for the resolver or a sink before new ones are dropped.
ENV_MAX_QUEUE = "STEPTRACE_MAX_QUEUE"
#: Seconds ``shutdown()`` may take to resolve and export what is pending.
ENV_SHUTDOWN_TIMEOUT_S = "STEPTRACE_SHUTDOWN_TIMEOUT_S"
#: Size in bytes at which a rank's JSONL file is rotated (``0``: never).
ENV_JSONL_MAX_BYTES = "STEPTRACE_JSONL_MAX_BYTES"
#: The default of ``jsonl_max_bytes``: 256 MiB, about 250,000 steps at ~1 KiB a step.
DEFAULT_JSONL_MAX_BYTES = 256 * 2**20

#: Serve Prometheus ``/metrics`` on this port + local_rank (one port per rank).
ENV_PROMETHEUS_PORT = "STEPTRACE_PROMETHEUS_PORT"
#: Address the ``/metrics`` server binds to (default ``127.0.0.1``).
ENV_PROMETHEUS_ADDR = "STEPTRACE_PROMETHEUS_ADDR"
#: Steps in the sliding window of ``steptrace_goodput_ratio``.
ENV_GOODPUT_WINDOW_STEPS = "STEPTRACE_GOODPUT_WINDOW_STEPS"
#: Seconds one OTLP export may take before it is abandoned (and its records counted as dropped).
ENV_OTLP_TIMEOUT_S = "STEPTRACE_OTLP_TIMEOUT_S"
#: Seconds the oldest record may wait for others before an OTLP span export (one request for several steps).
ENV_OTLP_BATCH_DELAY_S = "STEPTRACE_OTLP_BATCH_DELAY_S"
#: Seconds between OTLP metric exports.
ENV_OTLP_METRICS_INTERVAL_S = "STEPTRACE_OTLP_METRICS_INTERVAL_S"
# The standard OpenTelemetry variables (https://opentelemetry.io/docs/specs/otel/protocol/exporter/).
ENV_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_OTLP_HEADERS = "OTEL_EXPORTER_OTLP_HEADERS"
ENV_OTLP_COMPRESSION = "OTEL_EXPORTER_OTLP_COMPRESSION"
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_TAGS = "STEPTRACE_TAGS"
#: ``0`` turns off the stall watch (a ``stall`` record with every thread's stack when a rank stops moving).
ENV_STALL_WATCH = "STEPTRACE_STALL_WATCH"
#: Trackers each rank writes its numbers to, comma-separated: ``tensorboard``, ``mlflow``, ``wandb``.
ENV_TRACKERS = "STEPTRACE_TRACKERS"
#: Where the TensorBoard tracker writes ``rank_<r>/`` (default ``<run_dir>/<run_id>/tensorboard``).
ENV_TENSORBOARD_DIR = "STEPTRACE_TENSORBOARD_DIR"
#: The trackers ``init(trackers=...)`` knows (steptrace.trackers), each with the extra that installs it.
TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
#: Deep capture triggers, comma-separated: ``slow``, ``stall``, ``request`` (``off``: none). See steptrace/_capture.py.
ENV_CAPTURE = "STEPTRACE_CAPTURE"
ENV_CAPTURE_PROFILER = "STEPTRACE_CAPTURE_PROFILER"
ENV_CAPTURE_STEPS = "STEPTRACE_CAPTURE_STEPS"
ENV_CAPTURE_COOLDOWN_STEPS = "STEPTRACE_CAPTURE_COOLDOWN_STEPS"
ENV_CAPTURE_MAX = "STEPTRACE_CAPTURE_MAX"
ENV_CAPTURE_MAX_BYTES = "STEPTRACE_CAPTURE_MAX_BYTES"
ENV_CAPTURE_SLOW_FACTOR = "STEPTRACE_CAPTURE_SLOW_FACTOR"
ENV_CAPTURE_SLOW_MAD = "STEPTRACE_CAPTURE_SLOW_MAD"
CAPTURE_TRIGGERS = ("slow", "stall", "request", "spike", "straggler")
ENV_CAPTURE_POLL_S = "STEPTRACE_CAPTURE_POLL_S"
ENV_CAPTURE_SPIKE_SCALAR = "STEPTRACE_CAPTURE_SPIKE_SCALAR"
#: The bearer token of the HTTP capture trigger (``POST /v1/steptrace/capture`` on the rank's ``/metrics``
#: server); unset, that trigger is off. See docs/capture.md.
ENV_CAPTURE_TOKEN = "STEPTRACE_CAPTURE_TOKEN"
#: The shortest capture token accepted (a guessable one would let any peer that reaches the port take traces).
CAPTURE_TOKEN_MIN_CHARS = 16
#: GPU health per step window (steptrace/_health.py, docs/health.md): ``nvml`` or ``off`` (default).
ENV_HEALTH = "STEPTRACE_HEALTH"
#: The GPU to read, by NVML UUID (``GPU-...``) or PCI bus id (default: the GPU the rank's steps are timed on).
ENV_HEALTH_DEVICE = "STEPTRACE_HEALTH_DEVICE"
#: Seconds between health samples (default and least: 1).
ENV_HEALTH_PERIOD_S = "STEPTRACE_HEALTH_PERIOD_S"
HEALTH_SOURCES = ("off", "nvml")
#: Host pauses per step (steptrace/_pauses.py, docs/pauses.md): the training thread's garbage collections
#: (charged as ``gc``), run-queue wait and major faults. ``1``/``0`` (default off).
ENV_PAUSES = "STEPTRACE_PAUSES"
#: The shortest health sampling period: NVML's power is a 1 s average, its counters are cumulative,
#: so a faster reader adds calls and no information (docs/health.md).
MIN_HEALTH_PERIOD_S = 1.0
CAPTURE_PROFILERS = ("auto", "torch", "jax")
#: Added to the step number the trackers write at (the framework's own logging axis).
ENV_TRACKER_STEP_OFFSET = "STEPTRACE_TRACKER_STEP_OFFSET"
#: Which ranks write to the trackers: ``auto``, ``all`` or ranks (``0,7``).
ENV_TRACKER_RANKS = "STEPTRACE_TRACKER_RANKS"
#: Past this many ranks, ``tracker_ranks="auto"`` lets rank 0 alone write its own numbers: one run or
#: directory per rank floods a tracker (NVIDIA/dllogger#9), and the job's view across ranks is the
#: collector's (``steptrace collector --trackers``, the aggregate mode).
TRACKER_PER_RANK_MAX_WORLD_SIZE = 64
#: A step open this many times the run's median interval is a stall (default 10).
ENV_STALL_FACTOR = "STEPTRACE_STALL_FACTOR"
#: ... and at least this many seconds (default 60).
ENV_STALL_MIN_S = "STEPTRACE_STALL_MIN_S"
ENV_JAX_SWITCH_INTERVAL_S = "STEPTRACE_JAX_SWITCH_INTERVAL_S"
#: Which process start of the run this is (0 for the first); see :func:`launcher_attempt` for the fallbacks.
ENV_ATTEMPT = "STEPTRACE_ATTEMPT"
#: Launcher variables that count restarts, read in this order when no attempt is given.
LAUNCHER_ATTEMPT_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
#: Full ``train.microbatch`` spans over OTLP: ``none`` (default: a per-step summary on ``train.step``),
#: ``all``, or ``every:N`` (steps whose number is a multiple of N).
ENV_OTLP_MICROBATCH_SPANS = "STEPTRACE_OTLP_MICROBATCH_SPANS"
#: ``1`` serves bucketed per-rank histograms on ``/metrics`` (default: ``_sum``/``_count`` only).
ENV_PROMETHEUS_HISTOGRAMS = "STEPTRACE_PROMETHEUS_HISTOGRAMS"
#: The longest timeout or interval accepted (a day): larger ones overflow the threading primitives.
MAX_TIMEOUT_S = 86400.0
#: The longest OTLP batch delay accepted: spans later than the collector's join window are late.
MAX_OTLP_BATCH_DELAY_S = 5.0
MAX_TAGS = 64

BACKENDS = ("auto", "host", "jax", "torch")
OTLP_PROTOCOLS = ("http/protobuf", "grpc")
OTLP_COMPRESSIONS = ("gzip", "none")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclasses.dataclass(frozen=True)
class Config:
    """Resolved, validated settings of one process. Built by :func:`resolve_config`."""

    enabled: bool = True
    run_dir: str = "steptrace-runs"
    run_id: str = ""
    # Where the run id came from: code | env | launcher:TORCHELASTIC_RUN_ID | launcher:SLURM_JOB_ID |
    # torchelastic_agent | generated (see _run_id).
    run_id_source: str = "generated"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: Any = "auto"  # a name from BACKENDS, or a backend object (e.g. testing.SimulatedDevice)
    peak_tflops: float | None = None
    flops: str | None = None  # "auto": hardware FLOPs of every step from the compiler
    strict: bool = False
    annotate: bool = True
    max_queue: int = 65536
    shutdown_timeout_s: float = 10.0
    jsonl: bool = True
    jsonl_max_bytes: int = DEFAULT_JSONL_MAX_BYTES  # rotate rank-<r>.jsonl at this size; 0: never
    prometheus_port: int | None = None  # None: no /metrics server
    prometheus_addr: str = "127.0.0.1"
    goodput_window_steps: int = 100
    prometheus_histograms: bool = False  # True: bucketed per-rank histograms on /metrics
    otlp_endpoint: str | None = None  # None: no OTLP export
    otlp_protocol: str = "http/protobuf"
    otlp_headers: tuple[tuple[str, str], ...] = ()
    otlp_compression: str = "gzip"
    otlp_microbatch_spans: str = "none"  # "all", "none" or "every:N": full train.microbatch spans
    otlp_timeout_s: float = 10.0
    otlp_metrics_interval_s: float = 10.0
    otlp_batch_delay_s: float = 0.5
    service_name: str | None = None  # None: OTEL_SERVICE_NAME, else "steptrace"
    tags: tuple[tuple[str, str], ...] = ()  # user labels for the run (metadata record, compare)
    # Which process start of the run this is: init(attempt=...), STEPTRACE_ATTEMPT, a launcher's restart
    # count, or (at init, with JSONL on) one more than the attempts this rank's run directory records.
    attempt: int = 0
    attempt_source: str = "default"
    stall_watch: bool = True
    stall_factor: float = 10.0
    stall_min_s: float = 60.0  # code | env | launcher:<VAR> | run_dir | default
    # JAX: Python's GIL switch interval while the resolver waits for a step's outputs (None: leave it).
    # The end is read when the resolver gets the GIL back; see docs/devices.md.
    jax_switch_interval_s: float | None = None
    trackers: tuple[str, ...] = ()  # tensorboard, mlflow, wandb: see steptrace/trackers.py
    tensorboard_dir: str | None = None  # None: <run_dir>/<run_id>/tensorboard
    tracker_ranks: str = "auto"  # "auto", "all" or "0,7": the ranks that write to the trackers
    # Added to steptrace's step number where a tracker writes it: the axis the framework's own logging
    # uses (HF Trainer logs at global_step after the update, steptrace's step n: 1; see docs/trackers.md).
    tracker_step_offset: int = 0
    # Deep capture (steptrace/_capture.py, docs/capture.md): the triggers that arm a profiler trace.
    capture: tuple[str, ...] = ()
    capture_profiler: str = "auto"
    capture_steps: int = 3
    capture_cooldown_steps: int = 500
    capture_max: int = 5
    capture_max_bytes: int = 1 << 30
    capture_window_steps: int = 100
    capture_slow_factor: float = 2.0
    capture_slow_mad: float = 6.0
    capture_spike_scalar: str = "loss"  # the s.log scalar whose spikes the "spike" trigger watches
    capture_poll_s: float = 5.0  # the "straggler" trigger asks the collector (otlp_endpoint) this often
    # The bearer token POST /v1/steptrace/capture on the rank's /metrics server needs (None: that route is off).
    # Kept out of repr(): a config printed in a log must not hand the token out.
    capture_token: str | None = dataclasses.field(default=None, repr=False)
    # GPU health per step window (steptrace/_health.py, docs/health.md): "nvml" or "off".
    health: str = "off"
    health_device: str | None = None  # NVML UUID or PCI bus id; None: the GPU the steps are timed on
    health_period_s: float = 1.0
    # Host pauses per step (steptrace/_pauses.py, docs/pauses.md): gc, preemption, major faults.
    pauses: bool = False


def _env_bool(name: str, environ: dict[str, str]) -> bool | None:
    raw = environ.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _env_int(name: str, environ: dict[str, str]) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


def _env_float(name: str, environ: dict[str, str]) -> float | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{name}={raw!r}: expected a finite number")
    return value


def _jax_process(attr: str) -> int | None:
    """JAX's process id/count once ``jax.distributed`` is initialised; never imports jax.

    Calling ``jax.process_index()`` would initialise the backends, which breaks a later
    ``jax.distributed.initialize()``; the distributed global state is read instead.
    """
    if "jax" not in sys.modules:
        return None
    try:
        from jax._src import distributed  # private, hence the broad except below

        state = distributed.global_state
        if state.client is None:
            return None
        return int(getattr(state, attr))
    except Exception:
        return None


def _first(*values: Any) -> Any:
    for value in values:
        if value is not None:
            return value
    return None


def generate_run_id() -> str:
    """A sortable, collision-resistant id: UTC time plus random hex."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def known_variables() -> list[str]:
    """Every ``STEPTRACE_*`` variable steptrace reads."""
    return sorted(v for k, v in globals().items() if k.startswith("ENV_") and isinstance(v, str)
                  and v.startswith("STEPTRACE_"))


def _warn_unknown_variables(env: dict[str, str]) -> None:
    known = set(known_variables())
    for name in sorted(n for n in env if n.startswith("STEPTRACE_") and n not in known):
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else f"; steptrace reads {', '.join(sorted(known))}"
        warnings.warn(f"{name} is not a steptrace setting and is ignored{hint}", SteptraceWarning, stacklevel=4)


def resolve_config(environ: dict[str, str] | None = None, **code: Any) -> Config:
    """Merge code arguments (winning), ``STEPTRACE_*`` variables and launcher variables.

    Raises ``ValueError`` naming the offending argument or variable.
    """
    env = dict(os.environ if environ is None else environ)
    unknown = set(code) - {f.name for f in dataclasses.fields(Config)} | ({"attempt_source", "run_id_source"}
                                                                          & set(code))
    if unknown:
        raise ValueError(f"init() got unknown argument(s): {', '.join(sorted(unknown))}")
    _warn_unknown_variables(env)

    disabled = _env_bool(ENV_DISABLED, env)
    enabled = _first(code.get("enabled"), None if disabled is None else not disabled, True)

    rank = _first(code.get("rank"), _env_int(ENV_RANK, env), _env_int("RANK", env),
                  _jax_process("process_id"), 0)
    world_size = _first(code.get("world_size"), _env_int(ENV_WORLD_SIZE, env),
                        _env_int("WORLD_SIZE", env), _jax_process("num_processes"), 1)
    local_rank = _first(code.get("local_rank"), _env_int(ENV_LOCAL_RANK, env),
                        _env_int("LOCAL_RANK", env), rank if world_size == 1 else None, 0)
    run_id, run_id_source = _run_id(code.get("run_id"), env, world_size)
    attempt, attempt_source = _attempt(code.get("attempt"), env)
    config = Config(
        attempt=attempt,
        attempt_source=attempt_source,
        enabled=bool(enabled),
        run_dir=str(_first(code.get("run_dir"), env.get(ENV_RUN_DIR) or None, "steptrace-runs")),
        run_id=str(run_id),
        run_id_source=run_id_source,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        backend=_first(code.get("backend"), env.get(ENV_BACKEND) or None, "auto"),
        peak_tflops=_first(code.get("peak_tflops"), _env_float(ENV_PEAK_TFLOPS, env)),
        flops=_first(code.get("flops"), env.get(ENV_FLOPS, "").strip().lower() or None),
        strict=bool(_first(code.get("strict"), _env_bool(ENV_STRICT, env), False)),
        annotate=bool(_first(code.get("annotate"), _env_bool(ENV_ANNOTATE, env), True)),
        max_queue=_first(code.get("max_queue"), _env_int(ENV_MAX_QUEUE, env), 65536),
        shutdown_timeout_s=_first(code.get("shutdown_timeout_s"), _env_float(ENV_SHUTDOWN_TIMEOUT_S, env), 10.0),
        jsonl=bool(_first(code.get("jsonl"), True)),
        jsonl_max_bytes=_first(code.get("jsonl_max_bytes"), _env_int(ENV_JSONL_MAX_BYTES, env),
                               DEFAULT_JSONL_MAX_BYTES),
        prometheus_port=_first(code.get("prometheus_port"), _env_int(ENV_PROMETHEUS_PORT, env)),
        prometheus_addr=str(_first(code.get("prometheus_addr"), env.get(ENV_PROMETHEUS_ADDR) or None, "127.0.0.1")),
        goodput_window_steps=_first(code.get("goodput_window_steps"), _env_int(ENV_GOODPUT_WINDOW_STEPS, env), 100),
        prometheus_histograms=bool(_first(code.get("prometheus_histograms"),
                                          _env_bool(ENV_PROMETHEUS_HISTOGRAMS, env), False)),
        otlp_endpoint=_first(code.get("otlp_endpoint"), env.get(ENV_OTLP_ENDPOINT) or None),
        otlp_protocol=str(_first(code.get("otlp_protocol"), env.get(ENV_OTLP_PROTOCOL) or None, "http/protobuf")),
        otlp_headers=_parse_headers(_first(code.get("otlp_headers"), env.get(ENV_OTLP_HEADERS) or None, ())),
        otlp_compression=str(_first(code.get("otlp_compression"), env.get(ENV_OTLP_COMPRESSION) or None, "gzip")),
        otlp_microbatch_spans=str(_first(code.get("otlp_microbatch_spans"),
                                         env.get(ENV_OTLP_MICROBATCH_SPANS) or None, "none")).strip().lower(),
        otlp_timeout_s=_first(code.get("otlp_timeout_s"), _env_float(ENV_OTLP_TIMEOUT_S, env), 10.0),
        otlp_batch_delay_s=_first(code.get("otlp_batch_delay_s"), _env_float(ENV_OTLP_BATCH_DELAY_S, env), 0.5),
        otlp_metrics_interval_s=_first(code.get("otlp_metrics_interval_s"),
                                       _env_float(ENV_OTLP_METRICS_INTERVAL_S, env), 10.0),
        service_name=_first(code.get("service_name"), env.get(ENV_SERVICE_NAME) or None),
        tags=_parse_tags(_first(code.get("tags"), env.get(ENV_TAGS) or None, ())),
        stall_watch=bool(_first(code.get("stall_watch"), _env_bool(ENV_STALL_WATCH, env), True)),
        stall_factor=_first(code.get("stall_factor"), _env_float(ENV_STALL_FACTOR, env), 10.0),
        stall_min_s=_first(code.get("stall_min_s"), _env_float(ENV_STALL_MIN_S, env), 60.0),
        jax_switch_interval_s=_first(code.get("jax_switch_interval_s"), _env_float(ENV_JAX_SWITCH_INTERVAL_S, env),
                                     None),
        trackers=_parse_trackers(_first(code.get("trackers"), env.get(ENV_TRACKERS) or None, ())),
        tensorboard_dir=_first(code.get("tensorboard_dir"), env.get(ENV_TENSORBOARD_DIR) or None),
        capture=_parse_capture(_first(code.get("capture"), env.get(ENV_CAPTURE) or None, ())),
        capture_profiler=str(_first(code.get("capture_profiler"), env.get(ENV_CAPTURE_PROFILER) or None,
                                    "auto")).strip().lower(),
        capture_steps=_first(code.get("capture_steps"), _env_int(ENV_CAPTURE_STEPS, env), 3),
        capture_cooldown_steps=_first(code.get("capture_cooldown_steps"), _env_int(ENV_CAPTURE_COOLDOWN_STEPS, env),
                                      500),
        capture_max=_first(code.get("capture_max"), _env_int(ENV_CAPTURE_MAX, env), 5),
        capture_max_bytes=_first(code.get("capture_max_bytes"), _env_int(ENV_CAPTURE_MAX_BYTES, env), 1 << 30),
        capture_window_steps=_first(code.get("capture_window_steps"), 100),
        capture_slow_factor=_first(code.get("capture_slow_factor"), _env_float(ENV_CAPTURE_SLOW_FACTOR, env), 2.0),
        capture_slow_mad=_first(code.get("capture_slow_mad"), _env_float(ENV_CAPTURE_SLOW_MAD, env), 6.0),
        capture_poll_s=_first(code.get("capture_poll_s"), _env_float(ENV_CAPTURE_POLL_S, env), 5.0),
        capture_spike_scalar=str(_first(code.get("capture_spike_scalar"), env.get(ENV_CAPTURE_SPIKE_SCALAR) or None,
                                        "loss")),
        health=str(_first(code.get("health"), env.get(ENV_HEALTH) or None, "off")).strip().lower(),
        health_device=_first(code.get("health_device"), env.get(ENV_HEALTH_DEVICE) or None),
        health_period_s=_first(code.get("health_period_s"), _env_float(ENV_HEALTH_PERIOD_S, env), 1.0),
        pauses=_first(code.get("pauses"), _env_bool(ENV_PAUSES, env), False),
        capture_token=_first(code.get("capture_token"), env.get(ENV_CAPTURE_TOKEN) or None),
        tracker_step_offset=_first(code.get("tracker_step_offset"), _env_int(ENV_TRACKER_STEP_OFFSET, env), 0),
        tracker_ranks=_parse_tracker_ranks(_first(code.get("tracker_ranks"), env.get(ENV_TRACKER_RANKS) or None,
                                                  "auto")),
    )
    _validate(config)
    return config


#: Fallback messages already given by this process: each once, however often init() runs.
_WARNED: set[str] = set()


def warn_once(message: str, stacklevel: int = 5) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, SteptraceWarning, stacklevel=stacklevel)


def _run_id(code_value: Any, env: dict[str, str], world_size: int) -> tuple[Any, str]:
    """The run id and where it came from: code, ``STEPTRACE_RUN_ID``, the launcher (never its
    placeholder, see :func:`steptrace._attempts.launch_run_id`), else generated for this process.

    One launch is one run unless the user or the launcher names the run: a run id derived from
    the launch changes with it, so a second launch is never filed as a restart of the first.
    """
    if code_value is not None:
        return code_value, "code"
    if env.get(ENV_RUN_ID):
        return env[ENV_RUN_ID], "env"
    from ._attempts import launch_run_id

    launched = launch_run_id(env)
    if launched is not None:
        run_id, source = launched
        if source == "torchelastic_agent":
            several_nodes = (_env_int("GROUP_WORLD_SIZE", env) or 1) > 1
            warn_once(
                f"TORCHELASTIC_RUN_ID is {env.get('TORCHELASTIC_RUN_ID')!r} (torchrun without --rdzv-id): this launch "
                f"is run {run_id!r}, named after its torchrun agent, and a relaunch is a new run (the agent's own "
                f"restarts stay attempts of this one). "
                + ("Ranks on other nodes have other agents, so other run ids: pass --rdzv-id=ID or set "
                   f"{ENV_RUN_ID} so all ranks share one. " if several_nodes else "")
                + f"To resume a run across launches, give its id: --rdzv-id or {ENV_RUN_ID} (docs/goodput.md).")
        return run_id, source
    run_id = generate_run_id()
    if world_size > 1:
        # Ranks cannot agree on a random id without talking to each other.
        warnings.warn(
            f"world_size={world_size} but no run_id was given: each rank generated its own "
            f"({run_id}). Pass init(run_id=...) or set {ENV_RUN_ID} so ranks share one trace.",
            SteptraceWarning,
            stacklevel=4,
        )
    elif env.get("TORCHELASTIC_RUN_ID") is not None:
        warn_once(f"TORCHELASTIC_RUN_ID is {env['TORCHELASTIC_RUN_ID']!r} (torchrun without --rdzv-id) and the "
                  f"torchrun agent cannot be identified: this process is run {run_id!r}. Pass --rdzv-id=ID or "
                  f"set {ENV_RUN_ID} (docs/goodput.md).")
    return run_id, "generated"


def _attempt(code_value: Any, env: dict[str, str]) -> tuple[Any, str]:
    """The attempt number and where it came from (code, STEPTRACE_ATTEMPT, a launcher's restart count)."""
    if code_value is not None:
        return code_value, "code"
    value = _env_int(ENV_ATTEMPT, env)
    if value is not None:
        return value, "env"
    for name in LAUNCHER_ATTEMPT_VARIABLES:
        value = _env_int(name, env)
        if value is not None:
            return value, f"launcher:{name}"
    return 0, "default"


def _parse_tags(value: Any) -> tuple[tuple[str, str], ...]:
    """``{"k": "v"}`` or ``k1=v1,k2=v2`` (STEPTRACE_TAGS): short printable names and values."""
    if isinstance(value, str):
        items = []
        for item in value.split(","):
            if item.strip():
                key, sep, val = item.partition("=")
                if not sep:
                    raise ValueError(f"{ENV_TAGS} must be key=value pairs separated by commas, got {item!r}")
                items.append((key.strip(), val.strip()))
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"tags must be a dict of str to str (or {ENV_TAGS}=k=v,...), got {type(value).__name__}")
    if len(items) > MAX_TAGS:
        raise ValueError(f"tags: at most {MAX_TAGS}, got {len(items)}")
    tags = []
    for key, val in items:
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            val = str(val)
        if not (isinstance(key, str) and isinstance(val, str) and key and key.isprintable() and val.isprintable()
                and len(key) <= 128 and len(val) <= 1024):
            raise ValueError(f"tags: {key!r}={val!r} must be a printable name (<= 128 characters) and a "
                             "printable str or number value (<= 1024 characters)")
        tags.append((key, val))
    return tuple(tags)


def _parse_headers(value: Any) -> tuple[tuple[str, str], ...]:
    """``{"k": "v"}``, pairs, or the OTEL form ``k1=v1,k2=v2`` (values URL-encoded)."""
    from urllib.parse import unquote

    if isinstance(value, str):
        pairs = []
        for item in value.split(","):
            if not item.strip():
                continue
            key, sep, val = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"otlp_headers / {ENV_OTLP_HEADERS}: expected key=value pairs separated by "
                                 f"commas, got {item!r}")
            pairs.append((unquote(key.strip()), unquote(val.strip())))
        return tuple(pairs)
    if isinstance(value, dict):
        value = value.items()
    try:
        return tuple((str(k), str(v)) for k, v in value)
    except (TypeError, ValueError):
        raise ValueError(f"otlp_headers must be a dict, (key, value) pairs or 'k=v,k2=v2', got {value!r}") from None


def parse_names(value: Any, field: str, known: Sequence[str], env_name: str, *, off: bool = False) -> tuple[str, ...]:
    """``"a,b"`` or a list of names -> the names, lower-cased, in order, each once; an unknown one is a
    ``ValueError`` naming ``field``, ``env_name`` and the known names. With ``off``, ``"off"`` / ``"none"``
    alone mean none."""
    if isinstance(value, str):
        names = [part.strip().lower() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        names = [v.strip().lower() for v in value]
    else:
        raise ValueError(f"{field} must be a comma-separated string or a list of names, got {value!r}")
    if off and names in (["off"], ["none"]):
        return ()
    for name in names:
        if name not in known:
            raise ValueError(f"{field}: unknown {'trigger' if field == 'capture' else 'tracker'} {name!r} (set by "
                             f"init({field}=...) or {env_name}); known: {', '.join(known)}"
                             f"{', or off' if off else ''}")
    return tuple(dict.fromkeys(names))


def _parse_trackers(value: Any) -> tuple[str, ...]:
    return parse_names(value, "trackers", tuple(TRACKERS), ENV_TRACKERS)


def _parse_capture(value: Any) -> tuple[str, ...]:
    return parse_names(value, "capture", CAPTURE_TRIGGERS, ENV_CAPTURE, off=True)


def _parse_tracker_ranks(value: Any) -> str:
    """``auto``, ``all``, or ranks as ``"0,7"`` / ``[0, 7]`` -> the canonical text."""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    text = str(value).strip().lower()
    if text in ("auto", "all"):
        return text
    try:
        ranks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        ranks = []
    if not ranks or ranks[0] < 0:
        raise ValueError(f"tracker_ranks must be 'auto', 'all' or ranks such as '0,7' (set by init(tracker_ranks=...) "
                         f"or {ENV_TRACKER_RANKS}), got {value!r}")
    return ",".join(map(str, ranks))


def tracker_writes_here(config: Config) -> bool:
    """Whether this rank writes its own numbers to the configured trackers (``tracker_ranks``)."""
    if config.tracker_ranks == "all":
        return True
    if config.tracker_ranks == "auto":
        return config.world_size <= TRACKER_PER_RANK_MAX_WORLD_SIZE or config.rank == 0
    return str(config.rank) in config.tracker_ranks.split(",")


def _validate(config: Config) -> None:
    def need_int(field: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{field} must be an integer, got {value!r}")

    for field in ("rank", "world_size", "local_rank", "max_queue", "attempt", "jsonl_max_bytes", "tracker_step_offset",
                  "capture_steps", "capture_cooldown_steps", "capture_max", "capture_max_bytes",
                  "capture_window_steps"):
        need_int(field, getattr(config, field))
    for field, low in (("capture_steps", 1), ("capture_cooldown_steps", 0), ("capture_max", 0),
                       ("capture_max_bytes", 0), ("capture_window_steps", 20)):
        if getattr(config, field) < low:
            raise ValueError(f"{field} must be >= {low}, got {getattr(config, field)}")
    if config.capture_profiler not in CAPTURE_PROFILERS:
        raise ValueError(f"capture_profiler must be one of {', '.join(CAPTURE_PROFILERS)}, got "
                         f"{config.capture_profiler!r} (set by init(capture_profiler=...) or {ENV_CAPTURE_PROFILER})")
    if "straggler" in config.capture and (config.otlp_endpoint is None or config.otlp_protocol != "http/protobuf"):
        raise ValueError("capture: the 'straggler' trigger asks the steptrace collector the ranks export to: it needs "
                         "otlp_endpoint (OTEL_EXPORTER_OTLP_ENDPOINT) with otlp_protocol 'http/protobuf'")
    token = config.capture_token
    if token is not None:
        # Never the token itself in a message: it ends up in logs.
        if not isinstance(token, str) or len(token) < CAPTURE_TOKEN_MIN_CHARS or any(c.isspace() for c in token) \
                or not token.isprintable():
            raise ValueError(f"capture_token must be a string of at least {CAPTURE_TOKEN_MIN_CHARS} printable "
                             f"characters without spaces (e.g. `openssl rand -hex 16`) (set by "
                             f"init(capture_token=...) or {ENV_CAPTURE_TOKEN})")
        if "request" not in config.capture or config.prometheus_port is None:
            raise ValueError(f"capture_token (set by init(capture_token=...) or {ENV_CAPTURE_TOKEN}) is the token of "
                             "POST /v1/steptrace/capture on the rank's /metrics server: it needs capture to include "
                             "'request' and prometheus_port to be set")
    poll = config.capture_poll_s
    if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0.05 <= poll <= 3600:
        raise ValueError(f"capture_poll_s must be a number of seconds in [0.05, 3600], got {poll!r}")
    for field, least in (("capture_slow_factor", 1.0), ("capture_slow_mad", 0.0)):
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not least <= value < math.inf:
            raise ValueError(f"{field} must be a number >= {least:g}, got {value!r}")
    if not isinstance(config.pauses, bool):
        raise ValueError(f"pauses must be True or False, got {config.pauses!r} (set by init(pauses=...) or "
                         f"{ENV_PAUSES})")
    if config.health not in HEALTH_SOURCES:
        raise ValueError(f"health must be one of {', '.join(HEALTH_SOURCES)}, got {config.health!r} (set by "
                         f"init(health=...) or {ENV_HEALTH})")
    period = config.health_period_s
    if isinstance(period, bool) or not isinstance(period, (int, float)) or \
            not MIN_HEALTH_PERIOD_S <= period <= MAX_TIMEOUT_S:
        raise ValueError(f"health_period_s must be a number of seconds in [{MIN_HEALTH_PERIOD_S:g}, "
                         f"{MAX_TIMEOUT_S:g}], got {period!r} (NVML's power is a 1 s average: docs/health.md)")
    device = config.health_device
    if device is not None and not (isinstance(device, str) and device.strip() and device.isprintable()):
        raise ValueError(f"health_device must be an NVML UUID (GPU-...) or a PCI bus id, got {device!r} "
                         f"(set by init(health_device=...) or {ENV_HEALTH_DEVICE})")
    if config.attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {config.attempt} (init(attempt=...), {ENV_ATTEMPT} or "
                         f"{'/'.join(LAUNCHER_ATTEMPT_VARIABLES)})")
    if config.jsonl_max_bytes < 0:
        raise ValueError(f"jsonl_max_bytes must be >= 0 (0: never rotate), got {config.jsonl_max_bytes} "
                         f"(set by init(jsonl_max_bytes=...) or {ENV_JSONL_MAX_BYTES})")
    if config.world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {config.world_size}")
    if not 0 <= config.rank < config.world_size:
        raise ValueError(
            f"rank must be in [0, world_size={config.world_size}), got {config.rank}; "
            f"check {ENV_RANK}/RANK and {ENV_WORLD_SIZE}/WORLD_SIZE"
        )
    if config.local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {config.local_rank}")
    if config.max_queue < 16:
        raise ValueError(f"max_queue must be >= 16, got {config.max_queue}")
    problem = run_id_problem(config.run_id)
    if problem is not None:
        raise ValueError(f"run_id {problem}, got {config.run_id!r} (the collector refuses such a run)")
    if isinstance(config.backend, str) and config.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or a backend object, got {config.backend!r}")
    if config.flops not in (None, "auto"):
        raise ValueError(f"flops must be 'auto' or None (per-step model FLOPs go to step(n, flops=...)), "
                         f"got {config.flops!r}")
    if config.peak_tflops is not None and not config.peak_tflops > 0:
        raise ValueError(f"peak_tflops must be > 0, got {config.peak_tflops!r}")
    for field in ("shutdown_timeout_s", "otlp_timeout_s", "otlp_metrics_interval_s", "otlp_batch_delay_s",
                  "peak_tflops"):
        value = getattr(config, field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ValueError(f"{field} must be a finite number, got {value!r}")
    for field in ("stall_factor", "stall_min_s"):
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
            raise ValueError(f"{field} must be a number in (0, {MAX_TIMEOUT_S:g}], got {value!r}")
    value = config.jax_switch_interval_s
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 1e-6 <= value <= 0.1):
        raise ValueError(f"jax_switch_interval_s must be a number of seconds in [1e-06, 0.1] (Python's "
                         f"default switch interval is 0.005), got {value!r}")
    if config.stall_factor < 1:
        raise ValueError(f"stall_factor must be >= 1 (a multiple of the median step), got {config.stall_factor!r}")
    if not 0 <= config.shutdown_timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"shutdown_timeout_s must be in [0, {MAX_TIMEOUT_S:g}], got {config.shutdown_timeout_s!r}")
    if config.prometheus_port is not None:
        need_int("prometheus_port", config.prometheus_port)
        if not 0 <= config.prometheus_port or config.prometheus_port + config.local_rank > 65535:
            raise ValueError(f"prometheus_port must be in [0, 65535 - local_rank], got {config.prometheus_port} "
                             f"(set by init(prometheus_port=...) or {ENV_PROMETHEUS_PORT})")
    need_int("goodput_window_steps", config.goodput_window_steps)
    if config.goodput_window_steps < 1:
        raise ValueError(f"goodput_window_steps must be >= 1, got {config.goodput_window_steps}")
    if config.otlp_endpoint is not None:
        problem = _endpoint_problem(config.otlp_endpoint)
        if problem:
            raise ValueError(f"otlp_endpoint {problem}, got {config.otlp_endpoint!r} "
                             f"(set by init(otlp_endpoint=...) or {ENV_OTLP_ENDPOINT})")
    if config.otlp_protocol not in OTLP_PROTOCOLS:
        raise ValueError(f"otlp_protocol must be one of {', '.join(OTLP_PROTOCOLS)}, got {config.otlp_protocol!r} "
                         f"(set by init(otlp_protocol=...) or {ENV_OTLP_PROTOCOL})")
    if config.otlp_compression not in OTLP_COMPRESSIONS:
        raise ValueError(f"otlp_compression must be one of {', '.join(OTLP_COMPRESSIONS)}, got "
                         f"{config.otlp_compression!r} (set by init(otlp_compression=...) or {ENV_OTLP_COMPRESSION})")
    try:
        microbatch_span_every(config.otlp_microbatch_spans)
    except ValueError as exc:
        raise ValueError(f"{exc} (set by init(otlp_microbatch_spans=...) or {ENV_OTLP_MICROBATCH_SPANS})") from None
    for field in ("otlp_timeout_s", "otlp_metrics_interval_s"):
        if not 0 < getattr(config, field) <= MAX_TIMEOUT_S:
            raise ValueError(f"{field} must be in (0, {MAX_TIMEOUT_S:g}], got {getattr(config, field)!r}")
    if not 0 <= config.otlp_batch_delay_s <= MAX_OTLP_BATCH_DELAY_S:
        raise ValueError(f"otlp_batch_delay_s must be in [0, {MAX_OTLP_BATCH_DELAY_S:g}] (the collector joins a "
                         f"step's ranks within its window, 10 s by default), got {config.otlp_batch_delay_s!r} "
                         f"(set by init(otlp_batch_delay_s=...) or {ENV_OTLP_BATCH_DELAY_S})")


def microbatch_span_every(value: str) -> int:
    """``otlp_microbatch_spans`` as a step period: ``none`` 0, ``all`` 1, ``every:N`` N."""
    text = str(value).strip().lower()
    if text == "none":
        return 0
    if text == "all":
        return 1
    if text.startswith("every:"):
        try:
            every = int(text[len("every:"):])
        except ValueError:
            every = 0
        if every >= 1:
            return every
    raise ValueError(f"otlp_microbatch_spans must be 'all', 'none' or 'every:N' with N >= 1, got {value!r}")


def _endpoint_problem(endpoint: Any) -> str | None:
    """Why ``endpoint`` is not an http(s) URL with a host and a valid port, or None."""
    from urllib.parse import urlsplit

    if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
        return "must start with http:// or https://"
    try:
        parts = urlsplit(endpoint)
        port = parts.port  # raises ValueError when out of range or not a number
    except ValueError as exc:
        return f"has a bad port ({exc})"
    if not parts.hostname:
        return "has no host"
    if port == 0:
        return "has port 0"
    if not endpoint.isprintable() or any(c.isspace() for c in endpoint):
        return "must not contain spaces or control characters"
    return None
