"""The GPU suite's ground truth (tests/kernel_timeline.py) is itself tested here, on any machine."""

import json

import pytest

from kernel_timeline import KernelTimeline


def _x(cat, name, ts_us, dur_us, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur_us, "pid": 1, "tid": 1, "args": args}


def _trace():
    # Step 0 launches two kernels and a memcpy; step 1 launches one CUDA graph replaying two kernels
    # (both carry the graph launch's correlation id). Step 1 is launched while step 0 still runs.
    return {"traceEvents": [
        _x("user_annotation", "steptrace.step.0", 0, 100),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 20, 5, correlation=2),
        _x("cuda_driver", "cuMemcpyAsync", 30, 5, correlation=3),
        _x("user_annotation", "steptrace.step.1", 100, 50),
        _x("cuda_runtime", "cudaGraphLaunch", 110, 5, correlation=4),
        _x("kernel", "gemm", 12, 1000, correlation=1, stream=7),
        _x("kernel", "tanh", 1012, 500, correlation=2, stream=7),
        _x("gpu_memcpy", "Memcpy DtoH", 1600, 400, correlation=3, stream=7),
        _x("kernel", "graph_a", 2000, 300, correlation=4, stream=7),
        _x("kernel", "graph_b", 2400, 100, correlation=4, stream=7),
        {"ph": "s", "cat": "ac2g", "id": 1, "ts": 10},  # flow events are ignored
        _x("kernel", "orphan", 5000, 10, correlation=99),  # launched outside any trace range
    ]}


def test_device_work_belongs_to_the_range_that_launched_it():
    timeline = KernelTimeline.from_trace(_trace())
    step0 = timeline.window("steptrace.step.0")
    assert (step0.start, step0.end, step0.operations) == (pytest.approx(12e-6), pytest.approx(2000e-6), 3)
    assert step0.busy == pytest.approx((1500 + 400) * 1e-6)  # the 88 µs gap before the memcpy is not busy
    step1 = timeline.window("steptrace.step.1")
    assert (step1.seconds, step1.busy) == (pytest.approx(500e-6), pytest.approx(400e-6))
    assert timeline.last_device_end_before(2000e-6) == pytest.approx(2000e-6)


def test_the_timing_model_starts_a_step_at_its_entry_or_the_previous_steps_end():
    """start(n) = max(end(n-1), dispatch(n)), dispatch being the step's entry: step 1 was entered at
    100 µs while step 0's work ran until 2000 µs, so it starts at 2000 µs (its first kernel); a step
    entered on a drained device starts at its entry, before its first kernel."""
    trace = _trace()
    trace["traceEvents"] += [
        _x("user_annotation", "steptrace.step.2", 3000, 600),
        _x("cuda_runtime", "cudaStreamIsCapturing", 3000, 1, correlation=8),  # steptrace's look, at entry
        _x("cuda_runtime", "cudaLaunchKernel", 3400, 5, correlation=5),  # launched 400 µs after entry
        _x("kernel", "late", 3410, 200, correlation=5, stream=7),
    ]
    timeline = KernelTimeline.from_trace(trace)
    step1 = timeline.step_by_the_timing_model("steptrace.step.1", "steptrace.step.0")
    assert (step1.start, step1.end) == (pytest.approx(2000e-6), pytest.approx(2500e-6))
    step2 = timeline.step_by_the_timing_model("steptrace.step.2", "steptrace.step.1")
    assert (step2.start, step2.seconds) == (pytest.approx(3000e-6), pytest.approx(610e-6))
    assert timeline.window("steptrace.step.2").seconds == pytest.approx(200e-6)  # from the first kernel


def test_the_entry_is_the_step_s_first_cuda_call():
    """The range opens before steptrace looks at the stream and records its start marker: the first
    CUDA call inside the range is the entry."""
    trace = _trace()
    trace["traceEvents"] += [
        _x("user_annotation", "steptrace.step.2", 3000, 600),
        _x("cuda_runtime", "cudaStreamIsCapturing", 3060, 2, correlation=6),  # 60 µs in
        _x("cuda_runtime", "cudaLaunchKernel", 3400, 5, correlation=5),
        _x("kernel", "late", 3410, 200, correlation=5, stream=7),
        _x("cuda_runtime", "cudaEventRecord", 3590, 2, correlation=7),  # the end marker
    ]
    timeline = KernelTimeline.from_trace(trace)
    step2 = timeline.step_by_the_timing_model("steptrace.step.2", "steptrace.step.1")
    assert (step2.start, step2.seconds) == (pytest.approx(3060e-6), pytest.approx(550e-6))


def test_missing_ranges_and_empty_ranges_fail_loudly():
    timeline = KernelTimeline.from_trace(_trace())
    with pytest.raises(KeyError):
        timeline.window("steptrace.step.2")
    empty = KernelTimeline.from_trace({"traceEvents": [_x("user_annotation", "nothing", 0, 10)]})
    with pytest.raises(ValueError):
        empty.window("nothing")


def test_reads_a_real_torch_profiler_trace(tmp_path):
    """A real Kineto trace from this machine: steptrace's step ranges are found by name (no GPU
    here, so no device work; on a CUDA machine the GPU suite reads kernels from the same file)."""
    torch = pytest.importorskip("torch")
    import steptrace
    from steptrace.testing import capture

    path = tmp_path / "trace.json"
    with capture():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for n in range(3):
                with steptrace.step(n):
                    torch.ones(64).sum()
    prof.export_chrome_trace(str(path))
    timeline = KernelTimeline.load(path)
    assert [len(timeline.annotations[f"steptrace.step.{n}"]) for n in range(3)] == [1, 1, 1]
    (r0,), (r1,) = timeline.annotations["steptrace.step.0"], timeline.annotations["steptrace.step.1"]
    assert r0[0] < r0[1] <= r1[0]
    json.loads(path.read_text())  # the file is plain JSON


def test_xla_module_windows_come_from_the_gpu_modules_line():
    from kernel_timeline import xla_module_windows

    def meta(kind, pid, tid, name):
        return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}

    trace = {"traceEvents": [
        meta("process_name", 1, 0, "/host:CPU"), meta("process_name", 2, 0, "/device:GPU:0"),
        meta("thread_name", 2, 10, "XLA Modules"), meta("thread_name", 2, 11, "Stream #13(compute)"),
        meta("thread_name", 1, 5, "python"),
        {"ph": "X", "pid": 2, "tid": 10, "ts": 300, "dur": 100, "name": "jit_f"},
        {"ph": "X", "pid": 2, "tid": 10, "ts": 100, "dur": 150, "name": "jit_f"},
        {"ph": "X", "pid": 2, "tid": 11, "ts": 100, "dur": 10, "name": "fusion"},
        {"ph": "X", "pid": 1, "tid": 5, "ts": 0, "dur": 10, "name": "PjitFunction(f)"},
    ]}
    assert xla_module_windows(trace) == [(pytest.approx(100e-6), pytest.approx(250e-6)),
                                         (pytest.approx(300e-6), pytest.approx(400e-6))]
    with pytest.raises(ValueError, match="Stream #13"):
        xla_module_windows({"traceEvents": trace["traceEvents"][:2] + trace["traceEvents"][3:4]})


def test_xla_module_windows_from_kernels_when_there_is_no_modules_line():
    """jax 0.11's exported trace has only ``Stream #N(...)`` lines on the GPU: executions are the kernels'
    ``hlo_module``, grouped by ``run_id`` when given, else cut into equal runs."""
    from kernel_timeline import xla_module_windows

    def meta(kind, pid, tid, name):
        return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}

    def kernel(ts, dur, **args):
        return {"ph": "X", "pid": 2, "tid": 11, "ts": ts, "dur": dur, "name": "fusion", "args": args}

    head = [meta("process_name", 2, 0, "/device:GPU:0"), meta("thread_name", 2, 11, "Stream #13(compute)")]
    with_ids = {"traceEvents": head + [kernel(100, 10, hlo_module="jit_f", run_id=1),
                                       kernel(110, 20, hlo_module="jit_f", run_id=1),
                                       kernel(140, 10, hlo_module="jit_f", run_id=2),
                                       kernel(150, 30, hlo_module="jit_f", run_id=2),
                                       kernel(500, 5, hlo_module="jit_other", run_id=3)]}
    assert xla_module_windows(with_ids, module="jit_f") == [(pytest.approx(100e-6), pytest.approx(130e-6)),
                                                            (pytest.approx(140e-6), pytest.approx(180e-6))]
    without = {"traceEvents": head + [kernel(100, 10, hlo_module="jit_f"), kernel(110, 20, hlo_module="jit_f"),
                                      kernel(140, 10, hlo_module="jit_f"), kernel(150, 30, hlo_module="jit_f")]}
    assert xla_module_windows(without, module="jit_f", runs=2) == [(pytest.approx(100e-6), pytest.approx(130e-6)),
                                                                   (pytest.approx(140e-6), pytest.approx(180e-6))]
    with pytest.raises(ValueError):
        xla_module_windows(without, module="jit_f", runs=3)
