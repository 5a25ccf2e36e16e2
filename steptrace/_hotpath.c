/* steptrace._hotpath: the training thread's per-step calls in C (optional).
 *
 * Why: `steptrace.step(n)`, the step's `__enter__`, `wait_for` and `__exit__` run on the training
 * thread every step (pipeline ranks: every microbatch's step too). In Python they cost 4-8x a minimal
 * recorder (two clock reads and a deque.append) on the 2-vCPU bench VM, nearly all of it the
 * interpreter's frames and attribute traffic around a few tests and stores (bench/bench_overhead.py,
 * issue 35). Calling a Python-level attribute API from C is no cheaper than 3.11's specialized
 * bytecode, so the state these calls touch lives in C structs here:
 *
 *   StepBase     the base of steptrace._handles.StepHandle: the handle's hot fields as members
 *   RuntimeBase  the base of steptrace._runtime.Runtime: the training-thread state the calls read
 *
 * Python code reads and writes those fields by name as before (member descriptors), so the resolver,
 * the adapters and the tests are unchanged. Each function here does exactly what the Python method of
 * the same name does, for what a training loop meets every step: a host step, or a step whose one
 * output is a value of a type seen before (the loss: a jax.Array, a host number). Everything else (a
 * CUDA stream device, misuse, spans open at the step's end, an exception, a deep capture starting or
 * stopping, flops="auto", step arguments, several values, a type not seen yet) goes, before any side
 * effect, to the Python method (install() hands them over), which stays the one full definition.
 * Where this module is not built (no C compiler at install) or STEPTRACE_PURE_PYTHON=1, the Python
 * classes have no C base and their own methods run, with the same behaviour.
 *
 * A CUDA unit's markers (issue 47) follow the same rule one level down: the torch adapter's devices say
 * `compiled_markers`, and the entries and exits here record a marker themselves in the steady state their
 * Python entries (start_unit, end_unit, span_marker) describe, handing everything else to those entries; the
 * training thread then runs no Python frame of steptrace's for a CUDA step or microbatch.
 *
 * Host times come from the handles module's own `_perf` (read from its globals at each call, so a
 * test that replaces it is honoured), as in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* What install() hands over (strong references, for the process's life). */
static PyObject *HOST;           /* steptrace._devices.HOST */
static PyObject *TORCH_TENSORS;  /* steptrace._devices.TORCH_TENSORS: tensors, whose device is per value */
static PyObject *STEP_CLASS;     /* steptrace._handles.StepHandle */
static PyObject *STEP_SLOW;      /* the Python Runtime.step */
static PyObject *ENTER_SLOW;     /* the Python StepHandle.__enter__ */
static PyObject *WAIT_FOR_SLOW;  /* the Python StepHandle.wait_for */
static PyObject *EXIT_SLOW;      /* the Python StepHandle.__exit__ */
static PyObject *LOG_SLOW;       /* the Python StepHandle.log */
static PyObject *SPAN_CLASS;     /* steptrace._handles.SpanHandle */
static PyObject *SPAN_SLOW;      /* the Python Runtime.span */
static PyObject *SPAN_ENTER_SLOW; /* the Python SpanHandle.__enter__ */
static PyObject *SPAN_EXIT_SLOW; /* the Python SpanHandle.__exit__ */
static PyObject *MICROBATCH_CLASS;      /* steptrace._handles.MicrobatchHandle */
static PyObject *MICROBATCH_SLOW;       /* the Python Runtime.microbatch */
static PyObject *MB_WAIT_FOR_SLOW;      /* the Python MicrobatchHandle.wait_for */
static PyObject *MB_EXIT_SLOW;          /* the Python MicrobatchHandle.__exit__ */
static PyObject *FORWARD, *BACKWARD;    /* the microbatch kinds */
static PyObject *GLOBALS;        /* steptrace._handles.__dict__ (its `_perf`) */

static PyObject *ZERO;           /* 0.0, the default host times */
static PyObject *s_pending, *s_active, *s_may_stream, *s_stream_for_unit, *s_start_markers, *s__cuda, *s_torch, *s_span_marker, *s_close_span,
    *s__crossed_into, *s_start_event, *s_microbatches, *s_backends, *s_forced_values, *s_by_type, *s_uses_events,
    *s_forced_stream, *s_timed_by_values, *s_submit, *s__perf, *s__stopping, *s__queue, *s__max_queue,
    *s_append, *s_end_marker, *s_start_unit, *s_end_unit, *s_auto, *s_device;

/* -- the two types ------------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *current;       /* the open step, or None */
    PyObject *last_step;     /* the last step's number, or None */
    PyObject *last_step_end; /* host clock when the last step was left */
    PyObject *closed_spans;  /* spans closed since the last step ended (a list) */
    PyObject *open_spans;    /* spans open now (a list) */
    PyObject *capture;       /* the deep capture, or None */
    PyObject *annotate;      /* a framework's per-step annotation, or None */
    PyObject *annotate_enabled; /* its cheap check (annotate(n) is None while it says False), or None */
    PyObject *backends;      /* steptrace._devices.Backends */
    PyObject *resolver;      /* steptrace._resolver.Resolver */
    PyObject *hot;           /* `_hot`: active and set up: step() may take its fast path */
    PyObject *unsettled;     /* a steps() step whose exception is not read yet, or None */
    PyObject *step_extras;   /* `_step_extras`: the next step is more than a number */
    PyObject *active;        /* not shut down */
} RuntimeObject;

typedef struct {
    PyObject_HEAD
    PyObject *rt;
    PyObject *step;
    PyObject *attrs;
    PyObject *host_start;
    PyObject *dispatch;
    PyObject *host_end;
    PyObject *device;
    PyObject *waited;
    PyObject *submitted;
    PyObject *values;
    PyObject *annotation;  /* `_annotation` */
    PyObject *auto_flops;
    PyObject *start_event;
    PyObject *spans;
    PyObject *scalars;     /* name -> a float, or a reader the resolver calls (s.log); None until logged */
    PyObject *loop;        /* the steptrace.steps() loop running the step, or None */
} StepObject;

typedef struct {
    PyObject_HEAD
    PyObject *rt;
    PyObject *name;
    PyObject *attrs;
    PyObject *start;      /* host clock as it began */
    PyObject *marker;     /* (device, marker, host time) recorded on the step's stream as it began, or None */
    PyObject *opened_in;  /* the step open as it began, or None */
    PyObject *crossed;    /* a step boundary inside it was reported already */
} SpanObject;

typedef struct {
    PyObject_HEAD
    PyObject *rt;
    PyObject *step;        /* `_step`: the step it belongs to */
    PyObject *index;
    PyObject *stage;
    PyObject *chunk;
    PyObject *kind;
    PyObject *host_start;
    PyObject *dispatch;
    PyObject *host_end;
    PyObject *device;
    PyObject *values;
    PyObject *start_event;
} MicrobatchObject;

static PyTypeObject RuntimeBaseType;
static PyTypeObject StepBaseType;
static PyTypeObject SpanBaseType;
static PyTypeObject MicrobatchBaseType;

#define RUNTIME_FIELDS(X) X(current) X(last_step) X(last_step_end) X(closed_spans) X(open_spans) X(capture) \
    X(annotate) X(annotate_enabled) X(backends) X(resolver) X(hot) X(unsettled) X(step_extras) X(active)
#define STEP_FIELDS(X) X(rt) X(step) X(attrs) X(host_start) X(dispatch) X(host_end) X(device) X(waited) \
    X(submitted) X(values) X(annotation) X(auto_flops) X(start_event) X(spans) X(scalars) X(loop)

#define MICROBATCH_FIELDS(X) X(rt) X(step) X(index) X(stage) X(chunk) X(kind) X(host_start) X(dispatch) \
    X(host_end) X(device) X(values) X(start_event)
#define SPAN_FIELDS(X) X(rt) X(name) X(attrs) X(start) X(marker) X(opened_in) X(crossed)

#define VISIT_FIELD(name) Py_VISIT(self->name);
#define CLEAR_FIELD(name) Py_CLEAR(self->name);

/* tp_traverse, tp_clear and tp_dealloc of a type whose object references are the fields FIELDS lists. */
#define GC_FUNCTIONS(prefix, Type, FIELDS)                    \
    static int                                                \
    prefix##_traverse(Type *self, visitproc visit, void *arg) \
    {                                                         \
        FIELDS(VISIT_FIELD)                                   \
        return 0;                                             \
    }                                                         \
    static int                                                \
    prefix##_clear(Type *self)                                \
    {                                                         \
        FIELDS(CLEAR_FIELD)                                   \
        return 0;                                             \
    }                                                         \
    static void                                               \
    prefix##_dealloc(Type *self)                              \
    {                                                         \
        PyObject_GC_UnTrack(self);                            \
        prefix##_clear(self);                                 \
        Py_TYPE(self)->tp_free((PyObject *)self);             \
    }

/* The defaults steptrace._handles.TimedUnit declares for the fields a step and a microbatch share. */
#define TIMED_UNIT_DEFAULTS(self)                  \
    do {                                           \
        (self)->host_start = Py_NewRef(ZERO);      \
        (self)->dispatch = Py_NewRef(ZERO);        \
        (self)->host_end = Py_NewRef(Py_None);     \
        (self)->device = Py_NewRef(HOST);          \
        (self)->values = Py_NewRef(Py_None);       \
        (self)->start_event = Py_NewRef(Py_None);  \
    } while (0)

GC_FUNCTIONS(runtime, RuntimeObject, RUNTIME_FIELDS)

static PyObject *
runtime_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    RuntimeObject *self = (RuntimeObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    /* Runtime.__init__ sets every one; these keep a half-made runtime readable. */
    self->current = Py_NewRef(Py_None);
    self->last_step = Py_NewRef(Py_None);
    self->last_step_end = Py_NewRef(ZERO);
    self->closed_spans = PyList_New(0);
    self->open_spans = PyList_New(0);
    self->capture = Py_NewRef(Py_None);
    self->annotate = Py_NewRef(Py_None);
    self->annotate_enabled = Py_NewRef(Py_None);
    self->backends = Py_NewRef(Py_None);
    self->resolver = Py_NewRef(Py_None);
    self->hot = Py_NewRef(Py_False);
    self->unsettled = Py_NewRef(Py_None);
    self->step_extras = Py_NewRef(Py_False);
    self->active = Py_NewRef(Py_False);
    if (self->closed_spans == NULL || self->open_spans == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

GC_FUNCTIONS(step, StepObject, STEP_FIELDS)

/* A handle with the defaults steptrace._handles.TimedUnit and StepHandle declare (tests compare them). */
static StepObject *
new_step(PyTypeObject *type)
{
    if (HOST == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "steptrace._hotpath: install() was not called");
        return NULL;
    }
    StepObject *self = (StepObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    TIMED_UNIT_DEFAULTS(self);
    self->waited = Py_NewRef(Py_False);
    self->submitted = Py_NewRef(Py_False);
    self->annotation = Py_NewRef(Py_None);
    self->auto_flops = Py_NewRef(Py_False);
    self->scalars = Py_NewRef(Py_None);
    self->loop = Py_NewRef(Py_None);
    self->spans = PyTuple_New(0);
    if (self->spans == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return self;
}

static PyObject *
step_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    return (PyObject *)new_step(type);
}

GC_FUNCTIONS(span, SpanObject, SPAN_FIELDS)

/* A span handle with the defaults steptrace._handles.SpanHandle declares (tests compare them). */
static SpanObject *
new_span(PyTypeObject *type)
{
    SpanObject *self = (SpanObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->start = Py_NewRef(ZERO);
    self->marker = Py_NewRef(Py_None);
    self->opened_in = Py_NewRef(Py_None);
    self->crossed = Py_NewRef(Py_False);
    return self;
}

static PyObject *
span_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    return (PyObject *)new_span(type);
}

GC_FUNCTIONS(microbatch, MicrobatchObject, MICROBATCH_FIELDS)

/* A microbatch handle with TimedUnit's defaults (tests compare them). */
static MicrobatchObject *
new_microbatch(PyTypeObject *type)
{
    if (HOST == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "steptrace._hotpath: install() was not called");
        return NULL;
    }
    MicrobatchObject *self = (MicrobatchObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    TIMED_UNIT_DEFAULTS(self);
    return self;
}

static PyObject *
microbatch_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    return (PyObject *)new_microbatch(type);
}

/* -- helpers ------------------------------------------------------------------------------------------------ */

/* 1: true, 0: false, -1: error (the common values without a call). */
static int
truth(PyObject *value)
{
    if (value == Py_True) {
        return 1;
    }
    if (value == Py_False || value == Py_None) {
        return 0;
    }
    return PyObject_IsTrue(value);
}

/* 1: obj.name is None, 0: it is not, -1: error. */
static int
attr_is_none(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) {
        return -1;
    }
    int none = value == Py_None;
    Py_DECREF(value);
    return none;
}

/* 1: obj.name is true, 0: false, -1: error. */
static int
attr_is_true(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) {
        return -1;
    }
    int r = truth(value);
    Py_DECREF(value);
    return r;
}

/* 1: a stream device (`device is not HOST and device.uses_events`: timed by markers), 0: not, -1: error. */
static int
uses_events(PyObject *device)
{
    if (device == HOST || device == Py_None) {
        return 0;
    }
    return attr_is_true(device, s_uses_events);
}

/* The clock every host time of a handle comes from: the handles module's `_perf`. */
static PyObject *
read_clock(void)
{
    PyObject *perf = PyDict_GetItemWithError(GLOBALS, s__perf); /* borrowed */
    if (perf == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "steptrace._handles has no _perf");
        }
        return NULL;
    }
    return PyObject_CallNoArgs(perf);
}

/* The handle's runtime, if it is one this module knows (borrowed), else NULL without an error. */
static RuntimeObject *
runtime_of(StepObject *self)
{
    PyObject *rt = self->rt;
    if (rt == NULL || !PyObject_TypeCheck(rt, &RuntimeBaseType)) {
        return NULL;
    }
    return (RuntimeObject *)rt;
}

/* `slow(first, *args, **kwargs)`: a Python method called with the arguments a compiled one got. */
static PyObject *
forward(PyObject *slow, PyObject *first, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *small[8];
    Py_ssize_t total = nargs + (kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames));
    PyObject **full = total + 1 <= 8 ? small : PyMem_Malloc((size_t)(total + 1) * sizeof(PyObject *));
    if (full == NULL) {
        return PyErr_NoMemory();
    }
    full[0] = first;
    for (Py_ssize_t i = 0; i < total; i++) {
        full[i + 1] = args[i];
    }
    PyObject *result = PyObject_Vectorcall(slow, full, (size_t)(nargs + 1), kwnames);
    if (full != small) {
        PyMem_Free(full);
    }
    return result;
}

/* -- Runtime.step ------------------------------------------------------------------------------------------- */

/* steptrace.step(n): a handle for step `n` when it is only a number that follows the last one on a
 * runtime that is set up; anything else (arguments, misuse, the first step, a steps() loop to follow)
 * is the Python method's. */
static PyObject *
runtime_step(RuntimeObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs == 1 && (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0) && self->hot == Py_True &&
            self->current == Py_None && self->unsettled == Py_None && self->step_extras == Py_False &&
            PyLong_CheckExact(args[0]) && STEP_CLASS != NULL) {
        PyObject *n = args[0];
        int follows = 1;
        if (self->last_step != Py_None) {
            follows = PyObject_RichCompareBool(n, self->last_step, Py_GT);
            if (follows < 0) {
                return NULL;
            }
        }
        if (follows) {
            PyObject *attrs = PyDict_New();
            if (attrs == NULL) {
                return NULL;
            }
            StepObject *handle = new_step((PyTypeObject *)STEP_CLASS);
            if (handle == NULL) {
                Py_DECREF(attrs);
                return NULL;
            }
            handle->rt = Py_NewRef((PyObject *)self);
            handle->step = Py_NewRef(n);
            handle->attrs = attrs;
            return (PyObject *)handle;
        }
    }
    if (STEP_SLOW == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "steptrace._hotpath: install() was not called");
        return NULL;
    }
    return forward(STEP_SLOW, (PyObject *)self, args, nargs, kwnames);
}

/* Backends.stream_for_unit() (a new reference: the stream device, or None), answered without the call in
 * the common cases: a stream device forced; CUDA in use (every step of a CUDA loop); no stream device forced
 * or known and torch not even imported (a CPU loop). */
static PyObject *
stream_for_unit(PyObject *backends)
{
    PyObject *forced = PyObject_GetAttr(backends, s_forced_stream);
    if (forced == NULL) {
        return NULL;
    }
    if (forced != Py_None) {
        return forced;
    }
    Py_DECREF(forced);
    PyObject *cuda = PyObject_GetAttr(backends, s__cuda);
    if (cuda == NULL) {
        return NULL;
    }
    if (cuda != Py_None) {
        /* `if not self.auto or self.timed_by_values: return None`, then the known CUDA device. */
        int r = attr_is_true(backends, s_auto);
        if (r == 1) {
            r = attr_is_true(backends, s_timed_by_values);
            r = r < 0 ? -1 : !r;
        }
        if (r == 1) {
            return cuda;
        }
        Py_DECREF(cuda);
        if (r < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    Py_DECREF(cuda);
    int imported = PyDict_Contains(PyImport_GetModuleDict(), s_torch);
    if (imported < 0) {
        return NULL;
    }
    if (!imported) {
        Py_RETURN_NONE;
    }
    return PyObject_CallMethodNoArgs(backends, s_stream_for_unit);
}

/* `type(device).<name>` where the stream device's class defines it as a plain function (a new reference), or
 * NULL without an error: the device's one-call marker entries (start_unit, end_unit; see
 * steptrace._devices.StreamDevice), looked up in the type's method cache, no bound method made. */
static PyObject *
unit_entry(PyObject *device, PyObject *name)
{
    PyObject *entry = _PyType_Lookup(Py_TYPE(device), name); /* borrowed; never sets an error */
    return entry != NULL && PyFunction_Check(entry) ? Py_NewRef(entry) : NULL;
}

/* -- CUDA markers in C: the steady state of the torch adapter's one-call entries (issue 47) ---------------------
 *
 * A stream device class that sets `compiled_markers` ("device": steptrace.adapters.torch.TorchCudaDevice, "gpu":
 * TorchCudaGpu) lets the calls below record its markers without a Python frame, reading the fields its own
 * start_unit / end_unit / span_marker read (their Python definitions are the full ones: everything but the steady
 * state, and every failure before a side effect, goes to them, which meet it again and handle it). Each returns
 * 1: done here, 0: the Python entry must do it (nothing was changed), -1: an error to propagate. */
static PyObject *s_compiled_markers, *s__capturing, *s__get_device, *s_tensor_device, *s__timed, *s__checks_left,
    *s__raw_stream, *s__placements, *s_steptrace_device, *s__free, *s__record_raw, *s_memory_due,
    *s_steptrace_handle, *s_handle, *s__last, *s__last_stream_handle, *s_stream, *s_start_recorded_after,
    *s_end_recorded_after, *s_host_start, *s_device_failed, *s_drop_markers, *s__owner, *s_index, *s_checked,
    *s_end_event;

static double perf_seconds(void); /* time.perf_counter's clock (below, with GcWatch) */

/* The class's `compiled_markers` (borrowed), or NULL. */
static PyObject *
compiled_kind(PyObject *device)
{
    PyObject *kind = _PyType_Lookup(Py_TYPE(device), s_compiled_markers);
    return kind != NULL && PyUnicode_CheckExact(kind) ? kind : NULL;
}

/* An exception met before any side effect: an Exception is the Python entry's to meet again (0), anything
 * else (KeyboardInterrupt) propagates (-1). */
static int
not_here(void)
{
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* 1: a call of `obj.name()` is true, 0: false, -1: error. */
static int
call_attr_true(PyObject *obj, PyObject *name)
{
    PyObject *out = PyObject_CallMethodNoArgs(obj, name);
    if (out == NULL) {
        return -1;
    }
    int r = truth(out);
    Py_DECREF(out);
    return r;
}

/* The GPU's pool and driver record when both are usable (new references), else 0 (or -1). */
static int
pool_ready(PyObject *gpu, PyObject **free, PyObject **record)
{
    *free = PyObject_GetAttr(gpu, s__free);
    if (*free == NULL) {
        return -1;
    }
    if (!PyList_CheckExact(*free) || PyList_GET_SIZE(*free) == 0) {
        Py_CLEAR(*free);
        return 0;
    }
    *record = PyObject_GetAttr(gpu, s__record_raw);
    if (*record == NULL || *record == Py_None) {
        Py_CLEAR(*free);
        Py_CLEAR(*record);
        return *record == NULL && PyErr_Occurred() ? -1 : 0;
    }
    return 1;
}

/* rt.device_failed(exc) for the exception set now (an Exception; anything else propagates): 0 or -1. */
static int
count_failure(PyObject *rt)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return -1;
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) {
        PyException_SetTraceback(value, tb);
    }
    PyObject *out = value == NULL ? NULL : PyObject_CallMethodOneArg(rt, s_device_failed, value);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (out == NULL) {
        return -1;
    }
    Py_DECREF(out);
    return 0;
}

/* Take the newest event of `free` and record it on the raw stream `stream` through `record` (the driver's
 * cuEventRecord keeping the GIL), as the Python entries do: 1 recorded (*marker: a new reference), 2 refused
 * or failed (counted through rt.device_failed; the event is not given back, it may be the broken one), -1. */
static int
record_pooled(PyObject *rt, PyObject *free, PyObject *record, PyObject *stream, PyObject **marker)
{
    Py_ssize_t last = PyList_GET_SIZE(free) - 1;
    PyObject *event = Py_NewRef(PyList_GET_ITEM(free, last));
    if (PyList_SetSlice(free, last, last + 1, NULL) < 0) {
        Py_DECREF(event);
        return -1;
    }
    PyObject *rc = NULL, *handle = PyObject_GetAttr(event, s_steptrace_handle);
    if (handle != NULL) {
        PyObject *call[2] = {handle, stream};
        rc = PyObject_Vectorcall(record, call, 2, NULL);
        Py_DECREF(handle);
    }
    int failed = rc == NULL ? 1 : truth(rc);
    if (failed == 1 && rc != NULL) {
        /* A CUresult other than CUDA_SUCCESS: the Python entries' OSError. */
        PyErr_Format(PyExc_OSError, "cuEventRecord failed (CUresult %S)", rc);
    }
    Py_XDECREF(rc);
    if (failed) {
        Py_DECREF(event);
        return count_failure(rt) < 0 ? -1 : 2;
    }
    *marker = event;
    return 1;
}

/* Set each (name, value) pair on obj: 0 or -1. */
static int
set_attrs(PyObject *obj, int count, PyObject **names, PyObject **values)
{
    for (int i = 0; i < count; i++) {
        if (PyObject_SetAttr(obj, names[i], values[i]) < 0) {
            return -1;
        }
    }
    return 0;
}

/* A start marker from the pool on ``stream``, then what the Python entries set after it: the GPU's last
 * marker and stream, the unit's start event, device, placement and host time. 1, or -1 with an error set
 * (the general path is not taken once an event has left the pool). ``*marker``: a new reference or NULL. */
static int
record_start(PyObject *rt, PyObject *free, PyObject *record, PyObject *stream, PyObject *gpu, PyObject *unit,
             PyObject *placement, PyObject *host_start, PyObject **marker)
{
    int r = record_pooled(rt, free, record, stream, marker);
    if (r != 1) {
        return r < 0 ? -1 : 1;
    }
    PyObject *gpu_names[2] = {s__last, s__last_stream_handle}, *gpu_values[2] = {*marker, stream};
    PyObject *unit_names[4] = {s_start_event, s_device, s_stream, s_start_recorded_after};
    PyObject *unit_values[4] = {*marker, gpu, placement, host_start};
    return set_attrs(gpu, 2, gpu_names, gpu_values) < 0 || set_attrs(unit, 4, unit_names, unit_values) < 0 ? -1 : 1;
}

/* TorchCudaDevice.start_unit's steady state: the GPU chosen, its stream seen before and the thread's current
 * device, the allocator's sample not due, an event in the pool, the driver's record. */
static int
cuda_start_device(PyObject *rt, PyObject *unit, PyObject *device)
{
    PyObject *current = NULL, *index = NULL, *raw = NULL, *stream_id = NULL, *key = NULL, *placements = NULL,
        *placement = NULL, *gpu = NULL, *free = NULL, *record = NULL, *due = NULL, *stream = NULL, *marker = NULL,
        *host_start = NULL;
    int r = call_attr_true(device, s__capturing);
    if (r != 0) {
        return r < 0 ? not_here() : 1; /* a graph capture is in progress: no marker (as the Python entry) */
    }
    current = PyObject_CallMethodNoArgs(device, s__get_device);
    index = current == NULL ? NULL : PyObject_GetAttr(device, s_tensor_device);
    if (index == NULL) {
        goto not_here;
    }
    if (index == Py_None) {
        PyObject *timed = PyObject_GetAttr(device, s__timed);
        if (timed == NULL) {
            goto not_here;
        }
        PyObject *found = PyDict_CheckExact(timed) ? PyDict_GetItemWithError(timed, current) : NULL;
        Py_XSETREF(index, Py_XNewRef(found));
        Py_DECREF(timed);
        if (index == NULL) {
            goto not_here; /* the GPU is still to be chosen (or an error) */
        }
        r = attr_is_true(device, s__checks_left);
        if (r != 0 || !PyLong_CheckExact(index) || PyLong_AsLong(index) < 0) {
            goto not_here; /* the choice is still being checked, or no GPU is timed */
        }
    }
    r = PyObject_RichCompareBool(current, index, Py_EQ);
    raw = r == 1 ? PyObject_GetAttr(device, s__raw_stream) : NULL;
    if (raw == NULL || raw == Py_None) {
        goto not_here; /* torch's record sets the device first; or no raw stream to look the stream up by */
    }
    stream_id = PyObject_CallOneArg(raw, index);
    key = stream_id == NULL ? NULL : PyTuple_Pack(2, index, stream_id);
    placements = key == NULL ? NULL : PyObject_GetAttr(device, s__placements);
    if (placements == NULL || !PyDict_CheckExact(placements)) {
        goto not_here;
    }
    placement = Py_XNewRef(PyDict_GetItemWithError(placements, key));
    gpu = placement == NULL ? NULL : PyObject_GetAttr(placement, s_steptrace_device);
    r = gpu == NULL ? 0 : pool_ready(gpu, &free, &record);
    if (r != 1) {
        goto not_here;
    }
    due = PyObject_GetAttr(gpu, s_memory_due);
    double due_s = due == NULL ? -1.0 : PyFloat_AsDouble(due);
    if (PyErr_Occurred() || perf_seconds() >= due_s) {
        goto not_here; /* the allocator is sampled there, once a second */
    }
    stream = PyObject_GetAttr(placement, s_handle);
    host_start = stream == NULL ? NULL : PyObject_GetAttr(unit, s_host_start);
    if (host_start == NULL) {
        goto not_here;
    }
    /* Side effects from here: the event leaves the pool. */
    r = record_start(rt, free, record, stream, gpu, unit, placement, host_start, &marker);
    goto done;
not_here:
    r = PyErr_Occurred() ? not_here() : 0;
done:
    Py_XDECREF(current);
    Py_XDECREF(index);
    Py_XDECREF(raw);
    Py_XDECREF(stream_id);
    Py_XDECREF(key);
    Py_XDECREF(placements);
    Py_XDECREF(placement);
    Py_XDECREF(gpu);
    Py_XDECREF(free);
    Py_XDECREF(record);
    Py_XDECREF(due);
    Py_XDECREF(stream);
    Py_XDECREF(marker);
    Py_XDECREF(host_start);
    return r;
}

/* What every entry of a GPU (TorchCudaGpu) checks first: its owner, the pool and driver record usable, and the
 * thread's current device this GPU (new references in the out-pointers): 1, 0 (the Python entry), -1. */
static int
gpu_ready(PyObject *gpu, PyObject **owner, PyObject **free, PyObject **record)
{
    *owner = PyObject_GetAttr(gpu, s__owner);
    int r = *owner == NULL ? -1 : pool_ready(gpu, free, record);
    if (r == 1) {
        PyObject *current = PyObject_CallMethodNoArgs(*owner, s__get_device);
        PyObject *index = current == NULL ? NULL : PyObject_GetAttr(gpu, s_index);
        r = index == NULL ? -1 : PyObject_RichCompareBool(current, index, Py_EQ);
        Py_XDECREF(current);
        Py_XDECREF(index);
        if (r != 1) {
            Py_CLEAR(*free);
            Py_CLEAR(*record);
        }
    }
    if (r != 1) {
        Py_CLEAR(*owner);
    }
    return r < 0 ? not_here() : r;
}

/* TorchCudaGpu.start_unit's steady state (a microbatch of a step timed on this GPU). */
static int
cuda_start_gpu(PyObject *rt, PyObject *unit, PyObject *gpu)
{
    PyObject *owner = NULL, *free = NULL, *record = NULL, *index = NULL, *raw = NULL, *stream_id = NULL, *key = NULL,
        *placements = NULL, *placement = NULL, *stream = NULL, *host_start = NULL, *marker = NULL;
    int r = gpu_ready(gpu, &owner, &free, &record);
    if (r != 1) {
        return r;
    }
    r = call_attr_true(owner, s__capturing);
    if (r != 0) {
        r = r < 0 ? not_here() : 1; /* a graph capture is in progress: no marker */
        goto done;
    }
    index = PyObject_GetAttr(gpu, s_index);
    raw = index == NULL ? NULL : PyObject_GetAttr(owner, s__raw_stream);
    if (raw == NULL || raw == Py_None) {
        goto not_here;
    }
    stream_id = PyObject_CallOneArg(raw, index);
    key = stream_id == NULL ? NULL : PyTuple_Pack(2, index, stream_id);
    placements = key == NULL ? NULL : PyObject_GetAttr(owner, s__placements);
    if (placements == NULL || !PyDict_CheckExact(placements)) {
        goto not_here;
    }
    placement = Py_XNewRef(PyDict_GetItemWithError(placements, key));
    stream = placement == NULL ? NULL : PyObject_GetAttr(placement, s_handle);
    host_start = stream == NULL ? NULL : PyObject_GetAttr(unit, s_host_start);
    if (host_start == NULL) {
        goto not_here;
    }
    r = record_start(rt, free, record, stream, gpu, unit, placement, host_start, &marker);
    goto done;
not_here:
    r = PyErr_Occurred() ? not_here() : 0;
done:
    Py_XDECREF(owner);
    Py_XDECREF(free);
    Py_XDECREF(record);
    Py_XDECREF(index);
    Py_XDECREF(raw);
    Py_XDECREF(stream_id);
    Py_XDECREF(key);
    Py_XDECREF(placements);
    Py_XDECREF(placement);
    Py_XDECREF(stream);
    Py_XDECREF(host_start);
    Py_XDECREF(marker);
    return r;
}

/* TorchCudaGpu.end_unit's steady state: the unit's stream known and not being captured. */
static int
cuda_end_gpu(PyObject *rt, PyObject *unit, PyObject *gpu)
{
    PyObject *owner = NULL, *free = NULL, *record = NULL, *placement = NULL, *stream = NULL, *now = NULL,
        *marker = NULL;
    placement = PyObject_GetAttr(unit, s_stream);
    if (placement == NULL || placement == Py_None) {
        Py_XDECREF(placement);
        return PyErr_Occurred() ? not_here() : 0;
    }
    int r = gpu_ready(gpu, &owner, &free, &record);
    if (r != 1) {
        Py_DECREF(placement);
        return r;
    }
    r = call_attr_true(owner, s__capturing);
    stream = r == 0 ? PyObject_GetAttr(placement, s_handle) : NULL;
    if (stream == NULL) {
        r = r == 1 ? 0 : not_here(); /* being captured: the Python entry falls back to host timing */
        goto done;
    }
    if (PyObject_SetAttr(owner, s_checked, Py_None) < 0) {
        r = not_here();
        goto done;
    }
    now = PyFloat_FromDouble(perf_seconds());
    if (now == NULL || PyObject_SetAttr(unit, s_end_recorded_after, now) < 0) {
        r = -1;
        goto done;
    }
    r = record_pooled(rt, free, record, stream, &marker);
    if (r == 1) {
        PyObject *gpu_names[2] = {s__last, s__last_stream_handle}, *gpu_values[2] = {marker, stream};
        r = set_attrs(gpu, 2, gpu_names, gpu_values) < 0 || PyObject_SetAttr(unit, s_end_event, marker) < 0 ? -1 : 1;
    }
    else if (r == 2) {
        /* As Runtime.end_marker: the unit falls back to host timing. */
        PyObject *out = PyObject_CallMethodOneArg(rt, s_drop_markers, unit);
        r = out == NULL || PyObject_SetAttr(unit, s_device, HOST) < 0 ? -1 : 1;
        Py_XDECREF(out);
    }
done:
    Py_XDECREF(owner);
    Py_XDECREF(free);
    Py_XDECREF(record);
    Py_XDECREF(placement);
    Py_XDECREF(stream);
    Py_XDECREF(now);
    Py_XDECREF(marker);
    return r;
}

/* TorchCudaGpu.span_marker's steady state: a new reference ((gpu, marker, host time) or None), or NULL: with an
 * error set, or without one where the Python entry must do it. */
static PyObject *
cuda_span_gpu(PyObject *rt, PyObject *step, PyObject *gpu)
{
    PyObject *owner = NULL, *free = NULL, *record = NULL, *placement = NULL, *stream = NULL, *now = NULL,
        *marker = NULL, *result = NULL;
    placement = PyObject_GetAttr(step, s_stream);
    if (placement == NULL || placement == Py_None) {
        Py_XDECREF(placement);
        if (PyErr_Occurred()) {
            (void)not_here(); /* an Exception is cleared (the Python entry meets it), anything else stays set */
        }
        return NULL;
    }
    int r = gpu_ready(gpu, &owner, &free, &record);
    if (r != 1) {
        Py_DECREF(placement);
        return NULL; /* an error set by gpu_ready propagates; else the Python entry */
    }
    now = PyFloat_FromDouble(perf_seconds());
    r = now == NULL ? -1 : call_attr_true(owner, s__capturing);
    if (r != 0) {
        if (r == 1) {
            result = Py_NewRef(Py_None); /* the marker could be captured too */
        }
        else if (now != NULL) {
            not_here();
        }
        goto done;
    }
    stream = PyObject_GetAttr(placement, s_handle);
    if (stream == NULL || PyObject_SetAttr(owner, s_checked, Py_None) < 0) {
        not_here();
        goto done;
    }
    r = record_pooled(rt, free, record, stream, &marker);
    if (r == 1) {
        PyObject *gpu_names[2] = {s__last, s__last_stream_handle}, *gpu_values[2] = {marker, stream};
        result = set_attrs(gpu, 2, gpu_names, gpu_values) < 0 ? NULL : PyTuple_Pack(3, gpu, marker, now);
    }
    else if (r == 2) {
        result = Py_NewRef(Py_None);
    }
done:
    Py_XDECREF(owner);
    Py_XDECREF(free);
    Py_XDECREF(record);
    Py_XDECREF(placement);
    Py_XDECREF(stream);
    Py_XDECREF(now);
    Py_XDECREF(marker);
    return result;
}

/* A unit's start marker on stream device `device` (not None): `device.start_unit(unit, rt)` where it has
 * one, else `rt.start_markers(unit, device)`; 0 or -1. */
static int
start_markers(PyObject *rt, PyObject *unit, PyObject *device)
{
    PyObject *kind = compiled_kind(device);
    if (kind != NULL) {
        int r = PyUnicode_CompareWithASCIIString(kind, "device") == 0 ? cuda_start_device(rt, unit, device)
            : PyUnicode_CompareWithASCIIString(kind, "gpu") == 0 ? cuda_start_gpu(rt, unit, device) : 0;
        if (r != 0) {
            return r < 0 ? -1 : 0;
        }
    }
    PyObject *out, *entry = unit_entry(device, s_start_unit);
    if (entry != NULL) {
        PyObject *call[3] = {device, unit, rt};
        out = PyObject_Vectorcall(entry, call, 3, NULL);
        Py_DECREF(entry);
    }
    else {
        PyObject *call[3] = {rt, unit, device};
        out = PyObject_VectorcallMethod(s_start_markers, call, 3, NULL);
    }
    if (out == NULL) {
        return -1;
    }
    Py_DECREF(out);
    return 0;
}

/* A unit's end marker, as the Python exits do first: `unit.device.end_unit(unit, rt)` where the device has
 * one, else `rt.end_marker(unit)` (the end marker on the unit's stream or, where none can be recorded, the
 * unit falls back to host timing there); 0 or -1. */
static int
end_marker(PyObject *rt, PyObject *unit, PyObject *device)
{
    PyObject *out;
    Py_INCREF(rt);
    Py_INCREF(device);
    PyObject *kind = compiled_kind(device);
    if (kind != NULL && PyUnicode_CompareWithASCIIString(kind, "gpu") == 0) {
        int r = cuda_end_gpu(rt, unit, device);
        if (r != 0) {
            Py_DECREF(device);
            Py_DECREF(rt);
            return r < 0 ? -1 : 0;
        }
    }
    PyObject *entry = unit_entry(device, s_end_unit);
    if (entry != NULL) {
        PyObject *call[3] = {device, unit, rt};
        out = PyObject_Vectorcall(entry, call, 3, NULL);
        Py_DECREF(entry);
    }
    else {
        PyObject *call[2] = {rt, unit};
        out = PyObject_VectorcallMethod(s_end_marker, call, 2, NULL);
    }
    Py_DECREF(device);
    Py_DECREF(rt);
    if (out == NULL) {
        return -1;
    }
    Py_DECREF(out);
    return 0;
}

/* A marker on `step`'s stream as a host span inside it begins or ends (a new reference: (device, marker, host
 * time), or None): `step.device.span_marker(step, rt)` where the device has one, else `rt.span_marker(step)`. */
static PyObject *
span_marker(PyObject *rt, PyObject *step)
{
    PyObject *device = PyObject_TypeCheck(step, &StepBaseType) ? Py_XNewRef(((StepObject *)step)->device)
                                                                : PyObject_GetAttr(step, s_device);
    if (device == NULL) {
        return NULL;
    }
    Py_INCREF(rt);
    Py_INCREF(step);
    PyObject *out = NULL, *entry = NULL, *kind = compiled_kind(device);
    if (kind != NULL && PyUnicode_CompareWithASCIIString(kind, "gpu") == 0) {
        out = cuda_span_gpu(rt, step, device);
    }
    if (out != NULL || PyErr_Occurred()) {
        /* done in C, or an error */
    }
    else if ((entry = unit_entry(device, s_span_marker)) != NULL) {
        PyObject *call[3] = {device, step, rt};
        out = PyObject_Vectorcall(entry, call, 3, NULL);
        Py_DECREF(entry);
    }
    else {
        PyObject *call[2] = {rt, step};
        out = PyObject_VectorcallMethod(s_span_marker, call, 2, NULL);
    }
    Py_DECREF(step);
    Py_DECREF(rt);
    Py_DECREF(device);
    return out;
}

/* -- StepHandle.__enter__ ----------------------------------------------------------------------------------- */

/* 1: the step opens here (no open step, no profiler to start or stop, no FLOP counters), 0: the Python
 * method opens it, -1: error. */
static int
enter_is_plain(StepObject *self, RuntimeObject *rt)
{
    if (rt->current != Py_None) {
        return 0;
    }
    if (rt->capture != Py_None) {
        /* Armed but idle: nothing happens at the boundary. */
        int r = attr_is_none(rt->capture, s_pending);
        if (r == 1) {
            r = attr_is_none(rt->capture, s_active);
        }
        if (r != 1) {
            return r;
        }
    }
    int r = truth(self->auto_flops);
    if (r != 0) {
        return r < 0 ? -1 : 0;
    }
    return 1;
}

static PyObject *
step_enter(StepObject *self, PyObject *unused)
{
    RuntimeObject *rt = runtime_of(self);
    int plain = rt == NULL ? 0 : enter_is_plain(self, rt);
    if (plain <= 0) {
        return plain < 0 ? NULL : PyObject_CallOneArg(ENTER_SLOW, (PyObject *)self);
    }
    Py_SETREF(rt->current, Py_NewRef((PyObject *)self));
    int annotating = rt->annotate != Py_None;
    if (annotating && rt->annotate_enabled != Py_None) {
        /* The annotator's own check first: a call of a builtin, where annotate(n) is a Python frame that
         * makes the same check and returns None (no profiler running: nearly every step). */
        PyObject *check = Py_NewRef(rt->annotate_enabled);
        PyObject *enabled = PyObject_CallNoArgs(check);
        Py_DECREF(check);
        if (enabled == NULL) {
            return NULL;
        }
        annotating = truth(enabled);
        Py_DECREF(enabled);
        if (annotating < 0) {
            return NULL;
        }
    }
    if (annotating) {
        PyObject *annotate = Py_NewRef(rt->annotate);
        PyObject *annotation = PyObject_CallOneArg(annotate, self->step);
        Py_DECREF(annotate);
        if (annotation == NULL) {
            return NULL;
        }
        Py_XSETREF(self->annotation, annotation);
    }
    PyObject *clock = read_clock();
    if (clock == NULL) {
        return NULL;
    }
    Py_XSETREF(self->host_start, Py_NewRef(clock));
    Py_XSETREF(self->dispatch, clock);
    /* Stream markers, last (after the host start, as in Python): where CUDA may be in use, the backends say
     * whether this step is timed on a stream. */
    PyObject *backends = Py_NewRef(rt->backends);
    int r = attr_is_true(backends, s_may_stream);
    PyObject *device = r == 1 ? stream_for_unit(backends) : NULL;
    Py_DECREF(backends);
    if (r < 0 || (r == 1 && device == NULL)) {
        return NULL;
    }
    if (device != NULL && device != Py_None) {
        PyObject *rt_object = Py_NewRef((PyObject *)rt);
        int failed = start_markers(rt_object, (PyObject *)self, device);
        Py_DECREF(rt_object);
        if (failed) {
            Py_DECREF(device);
            return NULL;
        }
    }
    Py_XDECREF(device);
    return Py_NewRef((PyObject *)self);
}

/* -- StepHandle.wait_for ------------------------------------------------------------------------------------ */

static PyObject *
wait_for_slow(StepObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return forward(WAIT_FOR_SLOW, (PyObject *)self, args, nargs, NULL);
}

/* What Backends.for_values() answers for one value of a type seen before, without the call: the device (a
 * new reference: a device, HOST, None for "the values do not say", or TORCH_TENSORS), or NULL: with an
 * error set, or without one where only the Python method can answer (values forced, a type not seen yet). */
static PyObject *
seen_type_device(PyObject *backends, PyObject *value)
{
    int r = attr_is_none(backends, s_forced_values);
    if (r != 1) {
        return NULL;
    }
    PyObject *by_type = PyObject_GetAttr(backends, s_by_type);
    if (by_type == NULL) {
        return NULL;
    }
    PyObject *device = PyDict_CheckExact(by_type) ? PyDict_GetItemWithError(by_type, (PyObject *)Py_TYPE(value))
                                                  : NULL;
    Py_XINCREF(device);
    Py_DECREF(by_type);
    return device;
}

/* What the Python method does with one value of a type seen before: 1 done here, 0 the Python method
 * must do it, -1 error. Nothing is changed before the answer is known. */
static int
wait_for_one(StepObject *self, RuntimeObject *rt, PyObject *value)
{
    PyObject *backends = rt->backends;
    /* One value of a type seen before (the loss, every step): its device without a call. */
    PyObject *device = seen_type_device(backends, value);
    if (device == NULL) {
        return PyErr_Occurred() ? -1 : 0; /* a type not seen yet: the Python method classifies it */
    }
    int r, done = 0;
    if (device == TORCH_TENSORS || self->device != HOST) {
        goto finish; /* a tensor (per value), or markers started at entry (a stream device) */
    }
    if (device == Py_None || device == HOST) {
        /* The values do not say, or were computed synchronously: the step stays a host step. */
        Py_SETREF(self->waited, Py_NewRef(Py_True));
        done = 1;
        goto finish;
    }
    r = attr_is_none(backends, s_forced_stream);
    if (r != 1) {
        done = r;
        goto finish;
    }
    r = uses_events(device);
    if (r != 0) {
        done = r < 0 ? -1 : 0; /* CUDA tensors */
        goto finish;
    }
    if (self->start_event != Py_None) {
        goto finish;
    }
    r = attr_is_true(backends, s_timed_by_values);
    if (r != 1) {
        done = r; /* the first step timed by values switches the backends over */
        goto finish;
    }
    /* A value device (JAX): handed over now, so the resolver starts waiting while the host runs ahead. */
    PyObject *values = PyTuple_New(1);
    if (values == NULL) {
        done = -1;
        goto finish;
    }
    PyTuple_SET_ITEM(values, 0, Py_NewRef(value));
    Py_SETREF(self->waited, Py_NewRef(Py_True));
    Py_SETREF(self->device, Py_NewRef(device));
    Py_XSETREF(self->values, values);
    Py_SETREF(self->submitted, Py_NewRef(Py_True));
    PyObject *resolver = Py_NewRef(rt->resolver);
    PyObject *call[3] = {resolver, (PyObject *)self, Py_True}; /* resolver.submit(self, urgent=True) */
    PyObject *out = PyObject_VectorcallMethod(s_submit, call, 3, NULL);
    Py_DECREF(resolver);
    if (out == NULL) {
        done = -1;
        goto finish;
    }
    Py_DECREF(out);
    done = 1;
finish:
    Py_DECREF(device);
    return done;
}

static PyObject *
step_wait_for(StepObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    RuntimeObject *rt = runtime_of(self);
    if (rt == NULL || rt->current != (PyObject *)self) {
        return wait_for_slow(self, args, nargs); /* misuse */
    }
    int r = truth(self->waited);
    if (r != 0) {
        return r < 0 ? NULL : wait_for_slow(self, args, nargs); /* a second wait_for */
    }
    if (nargs == 0) {
        Py_SETREF(self->waited, Py_NewRef(Py_True));
        Py_RETURN_NONE;
    }
    if (nargs == 1) {
        r = wait_for_one(self, rt, args[0]);
        if (r < 0) {
            return NULL;
        }
        if (r == 1) {
            Py_RETURN_NONE;
        }
    }
    return wait_for_slow(self, args, nargs);
}

/* -- StepHandle.log ------------------------------------------------------------------------------------------ */

/* s.log(loss=0.5, ...): host floats (the common case, as the Python method takes them) stored here; any
 * other value, positional arguments or misuse go, all of them, to the Python method. */
static PyObject *
step_log(StepObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    RuntimeObject *rt = runtime_of(self);
    Py_ssize_t count = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    int plain = nargs == 0 && rt != NULL && rt->current == (PyObject *)self &&
        (self->scalars == Py_None || PyDict_CheckExact(self->scalars));
    for (Py_ssize_t i = 0; plain && i < count; i++) {
        plain = PyFloat_CheckExact(args[i]);
    }
    if (!plain) {
        return forward(LOG_SLOW, (PyObject *)self, args, nargs, kwnames);
    }
    if (self->scalars == Py_None) {
        PyObject *logged = PyDict_New();
        if (logged == NULL) {
            return NULL;
        }
        Py_SETREF(self->scalars, logged);
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyDict_SetItem(self->scalars, PyTuple_GET_ITEM(kwnames, i), args[i]) < 0) {
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

/* -- StepHandle.__exit__ ------------------------------------------------------------------------------------ */

/* Queue an ended step on the resolver as Resolver.submit(step) does (no wake-up: a host step's end is
 * known), or let submit() itself count the drop when the resolver stops or its queue is full. */
static int
submit_ended(RuntimeObject *rt, StepObject *self)
{
    PyObject *resolver = Py_NewRef(rt->resolver), *queue = NULL, *limit = NULL, *out = NULL;
    int r = attr_is_true(resolver, s__stopping);
    if (r < 0) {
        goto error;
    }
    if (r == 0) {
        queue = PyObject_GetAttr(resolver, s__queue);
        limit = queue == NULL ? NULL : PyObject_GetAttr(resolver, s__max_queue);
        if (limit == NULL) {
            goto error;
        }
        Py_ssize_t length = PyObject_Size(queue);
        Py_ssize_t bound = length < 0 ? -1 : PyLong_AsSsize_t(limit);
        if (length < 0 || (bound == -1 && PyErr_Occurred())) {
            goto error;
        }
        if (length < bound) {
            out = PyObject_CallMethodOneArg(queue, s_append, (PyObject *)self);
            goto finish;
        }
    }
    out = PyObject_CallMethodOneArg(resolver, s_submit, (PyObject *)self); /* counts the drop */
finish:
    if (out == NULL) {
        goto error;
    }
    Py_DECREF(out);
    Py_XDECREF(queue);
    Py_XDECREF(limit);
    Py_DECREF(resolver);
    return 0;
error:
    Py_XDECREF(queue);
    Py_XDECREF(limit);
    Py_DECREF(resolver);
    return -1;
}

/* 1: the step closes here (the open step, ended without an exception, no FLOP counters, no profiler
 * annotation, no span open), 2: the same for a step timed by stream markers (its end marker is recorded
 * first, by the runtime), 0: the Python method closes it, -1: error. */
static int
exit_is_plain(StepObject *self, RuntimeObject *rt, PyObject *exc_type)
{
    if (exc_type != Py_None || rt->current != (PyObject *)self || self->annotation != Py_None) {
        return 0;
    }
    int events = uses_events(self->device);
    if (events < 0) {
        return -1;
    }
    int r = truth(self->auto_flops);
    if (r != 0) {
        return r < 0 ? -1 : 0;
    }
    r = truth(rt->open_spans);
    if (r != 0) {
        return r < 0 ? -1 : 0;
    }
    return events ? 2 : 1;
}

static PyObject *
step_exit(StepObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__exit__() takes 3 arguments");
        return NULL;
    }
    RuntimeObject *rt = runtime_of(self);
    int plain = rt == NULL ? 0 : exit_is_plain(self, rt, args[0]);
    if (plain <= 0) {
        if (plain < 0) {
            return NULL;
        }
        PyObject *full[4] = {(PyObject *)self, args[0], args[1], args[2]};
        return PyObject_Vectorcall(EXIT_SLOW, full, 4, NULL);
    }
    if (plain == 2 && end_marker((PyObject *)rt, (PyObject *)self, self->device) < 0) {
        return NULL; /* the step's end marker first, as the Python method records it */
    }
    PyObject *end = read_clock();
    if (end == NULL) {
        return NULL;
    }
    Py_SETREF(rt->current, Py_NewRef(Py_None));
    Py_XSETREF(rt->last_step, Py_XNewRef(self->step));
    Py_XSETREF(rt->last_step_end, Py_NewRef(end));
    int any = truth(rt->closed_spans);
    if (any < 0) {
        Py_DECREF(end);
        return NULL;
    }
    if (any) { /* spans closed since the last step ended: this step takes them */
        PyObject *fresh = PyList_New(0);
        if (fresh == NULL) {
            Py_DECREF(end);
            return NULL;
        }
        Py_XSETREF(self->spans, rt->closed_spans);
        rt->closed_spans = fresh;
    }
    /* Published last: a step handed over at wait_for() is finalized by the resolver as soon as
     * host_end is set, so everything else must be in place first. */
    Py_XSETREF(self->host_end, end);
    int submitted = truth(self->submitted);
    if (submitted < 0) {
        return NULL;
    }
    if (!submitted) {
        Py_XSETREF(self->submitted, Py_NewRef(Py_True));
        if (submit_ended(rt, self) < 0) {
            return NULL;
        }
    }
    Py_RETURN_FALSE; /* never swallow the user's exception */
}

/* -- Runtime.span, SpanHandle.__enter__ / __exit__ --------------------------------------------------------- */

/* steptrace.span(name, **attrs): a handle when the runtime is active, the name a non-empty str and no
 * steps() loop is to be followed; else the Python method (misuse, a loop, a shut-down runtime). */
static PyObject *
runtime_span(RuntimeObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (SPAN_SLOW == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "steptrace._hotpath: install() was not called");
        return NULL;
    }
    PyObject *current = self->current;
    if (nargs == 1 && self->active == Py_True && self->unsettled == Py_None && PyUnicode_CheckExact(args[0]) &&
            PyUnicode_GET_LENGTH(args[0]) > 0 &&
            (current == Py_None ||
             (PyObject_TypeCheck(current, &StepBaseType) && ((StepObject *)current)->loop == Py_None))) {
        PyObject *attrs = PyDict_New();
        if (attrs == NULL) {
            return NULL;
        }
        Py_ssize_t count = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < count; i++) {
            if (PyDict_SetItem(attrs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
                Py_DECREF(attrs);
                return NULL;
            }
        }
        SpanObject *span = new_span((PyTypeObject *)SPAN_CLASS);
        if (span == NULL) {
            Py_DECREF(attrs);
            return NULL;
        }
        span->rt = Py_NewRef((PyObject *)self);
        span->name = Py_NewRef(args[0]);
        span->attrs = attrs;
        return (PyObject *)span;
    }
    return forward(SPAN_SLOW, (PyObject *)self, args, nargs, kwnames);
}

static RuntimeObject *
span_runtime(SpanObject *self)
{
    PyObject *rt = self->rt;
    return rt != NULL && PyObject_TypeCheck(rt, &RuntimeBaseType) ? (RuntimeObject *)rt : NULL;
}

static PyObject *
span_enter(SpanObject *self, PyObject *unused)
{
    RuntimeObject *rt = span_runtime(self);
    if (rt == NULL || !PyList_CheckExact(rt->open_spans)) {
        return PyObject_CallOneArg(SPAN_ENTER_SLOW, (PyObject *)self);
    }
    PyObject *start = read_clock();
    if (start == NULL) {
        return NULL;
    }
    Py_XSETREF(self->start, start);
    PyObject *current = Py_NewRef(rt->current);
    Py_XSETREF(self->opened_in, Py_NewRef(current));
    if (current != Py_None) {
        /* Inside an event-timed step: the device's own timeline says when it ran out of work. */
        PyObject *start_event = PyObject_TypeCheck(current, &StepBaseType)
            ? Py_NewRef(((StepObject *)current)->start_event) : PyObject_GetAttr(current, s_start_event);
        if (start_event == NULL) {
            Py_DECREF(current);
            return NULL;
        }
        int timed = start_event != Py_None;
        Py_DECREF(start_event);
        if (timed) {
            PyObject *marker = span_marker((PyObject *)rt, current);
            if (marker == NULL) {
                Py_DECREF(current);
                return NULL;
            }
            Py_XSETREF(self->marker, marker);
        }
    }
    Py_DECREF(current);
    if (PyList_Append(rt->open_spans, (PyObject *)self) < 0) {
        return NULL;
    }
    return Py_NewRef((PyObject *)self);
}

/* The innermost open span closing (spans end in the reverse order they began): closed here, through
 * Runtime.close_span (the one place that records a span), with its device markers where it has one (begun
 * inside an event-timed step: the end marker goes on the same step's stream, as the Python method records
 * it); anything else by the Python method. */
static PyObject *
span_exit(SpanObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__exit__() takes 3 arguments");
        return NULL;
    }
    RuntimeObject *rt = span_runtime(self);
    PyObject *open_spans = rt == NULL ? NULL : rt->open_spans;
    PyObject *marker = self->marker;
    if (open_spans == NULL || !PyList_CheckExact(open_spans) || PyList_GET_SIZE(open_spans) == 0 ||
            PyList_GET_ITEM(open_spans, PyList_GET_SIZE(open_spans) - 1) != (PyObject *)self ||
            marker == NULL || (marker != Py_None && !(PyTuple_CheckExact(marker) && PyTuple_GET_SIZE(marker) == 3)) ||
            self->start == NULL || self->name == NULL || self->attrs == NULL) {
        PyObject *full[4] = {(PyObject *)self, args[0], args[1], args[2]};
        return PyObject_Vectorcall(SPAN_EXIT_SLOW, full, 4, NULL);
    }
    PyObject *end = read_clock();
    if (end == NULL) {
        return NULL;
    }
    PyObject *end_marker = Py_NewRef(Py_None);
    marker = Py_NewRef(marker);
    Py_INCREF(rt);
    if (PyList_SetSlice(open_spans, PyList_GET_SIZE(open_spans) - 1, PyList_GET_SIZE(open_spans), NULL) < 0) {
        goto error;
    }
    if (marker != Py_None) {
        Py_SETREF(self->marker, Py_NewRef(Py_None)); /* handed over (see SpanHandle.take_marker) */
        PyObject *current = Py_NewRef(rt->current);
        PyObject *device = current == Py_None ? Py_NewRef(Py_None)
            : PyObject_TypeCheck(current, &StepBaseType) ? Py_XNewRef(((StepObject *)current)->device)
            : PyObject_GetAttr(current, s_device);
        int same = device != NULL && current != Py_None && device == PyTuple_GET_ITEM(marker, 0);
        Py_XDECREF(device);
        if (device == NULL) {
            Py_DECREF(current);
            goto error;
        }
        if (same) {
            Py_SETREF(end_marker, span_marker((PyObject *)rt, current));
        }
        Py_DECREF(current);
        if (end_marker == NULL) {
            goto error;
        }
    }
    {
        /* rt.close_span(name, start, end, attrs, True, marker, end_marker) */
        PyObject *call[8] = {(PyObject *)rt, self->name, self->start, end, self->attrs, Py_True, marker, end_marker};
        PyObject *out = PyObject_VectorcallMethod(s_close_span, call, 8, NULL);
        if (out == NULL) {
            goto error;
        }
        Py_DECREF(out);
    }
    PyObject *current = rt->current;
    if (current != self->opened_in && current != Py_None) {
        int crossed = truth(self->crossed);
        if (crossed < 0) {
            goto error;
        }
        if (!crossed) {
            /* Begun between steps (or in an earlier step), ended in this one: said where it happens. */
            PyObject *out = PyObject_CallMethodOneArg((PyObject *)self, s__crossed_into, current);
            if (out == NULL) {
                goto error;
            }
            Py_DECREF(out);
        }
    }
    Py_DECREF(end);
    Py_DECREF(marker);
    Py_DECREF(end_marker);
    Py_DECREF(rt);
    Py_RETURN_FALSE;
error:
    Py_DECREF(end);
    Py_DECREF(marker);
    Py_XDECREF(end_marker);
    Py_DECREF(rt);
    return NULL;
}

/* -- Runtime.microbatch, MicrobatchHandle --------------------------------------------------------------------- */

/* steptrace.microbatch(index, stage=, chunk=, kind=): a handle inside an open step (not a steps() loop's:
 * that one may have to be followed first) of a known kind; anything else is the Python method's. */
static PyObject *
runtime_microbatch(RuntimeObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (MICROBATCH_SLOW == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "steptrace._hotpath: install() was not called");
        return NULL;
    }
    PyObject *current = self->current;
    PyObject *stage = Py_None, *chunk = Py_None, *kind = FORWARD;
    int plain = nargs == 1 && self->active == Py_True && self->unsettled == Py_None &&
        PyObject_TypeCheck(current, &StepBaseType) && ((StepObject *)current)->loop == Py_None;
    Py_ssize_t count = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; plain && i < count; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i), *value = args[nargs + i];
        if (PyUnicode_CompareWithASCIIString(name, "stage") == 0) {
            stage = value;
        }
        else if (PyUnicode_CompareWithASCIIString(name, "chunk") == 0) {
            chunk = value;
        }
        else if (PyUnicode_CompareWithASCIIString(name, "kind") == 0) {
            kind = value;
        }
        else {
            plain = 0; /* an argument the method does not take: its TypeError */
        }
    }
    if (plain && kind != FORWARD && kind != BACKWARD) {
        plain = PyUnicode_CheckExact(kind) && (PyUnicode_Compare(kind, FORWARD) == 0 ||
                                               PyUnicode_Compare(kind, BACKWARD) == 0);
    }
    if (!plain) {
        return forward(MICROBATCH_SLOW, (PyObject *)self, args, nargs, kwnames);
    }
    MicrobatchObject *unit = new_microbatch((PyTypeObject *)MICROBATCH_CLASS);
    if (unit == NULL) {
        return NULL;
    }
    unit->rt = Py_NewRef((PyObject *)self);
    unit->step = Py_NewRef(current);
    unit->index = Py_NewRef(args[0]);
    unit->stage = Py_NewRef(stage);
    unit->chunk = Py_NewRef(chunk);
    unit->kind = Py_NewRef(kind);
    return (PyObject *)unit;
}

static PyObject *
microbatch_enter(MicrobatchObject *self, PyObject *unused)
{
    if (self->rt == NULL || self->step == NULL || !PyObject_TypeCheck(self->step, &StepBaseType)) {
        PyErr_SetString(PyExc_RuntimeError, "a microbatch handle without its step");
        return NULL;
    }
    PyObject *clock = read_clock();
    if (clock == NULL) {
        return NULL;
    }
    Py_XSETREF(self->host_start, Py_NewRef(clock));
    Py_XSETREF(self->dispatch, clock);
    PyObject *step_device = Py_NewRef(((StepObject *)self->step)->device);
    int r = uses_events(step_device);
    PyObject *device = NULL;
    if (r == 1) {
        device = Py_NewRef(step_device);
    }
    else if (r == 0) {
        PyObject *backends = PyObject_GetAttr(self->rt, s_backends);
        device = backends == NULL ? NULL : stream_for_unit(backends);
        Py_XDECREF(backends);
    }
    Py_DECREF(step_device);
    if (device == NULL) {
        return NULL;
    }
    if (device != Py_None) {
        PyObject *rt = Py_NewRef(self->rt);
        int failed = start_markers(rt, (PyObject *)self, device);
        Py_DECREF(rt);
        if (failed) {
            Py_DECREF(device);
            return NULL;
        }
    }
    Py_DECREF(device);
    return Py_NewRef((PyObject *)self);
}

static PyObject *
microbatch_wait_for(MicrobatchObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs == 0) {
        Py_RETURN_NONE;
    }
    PyObject *backends = NULL, *device = NULL, *result = NULL;
    int done = 0;
    if (nargs == 1 && self->rt != NULL && self->start_event == Py_None) {
        backends = PyObject_GetAttr(self->rt, s_backends);
        if (backends == NULL) {
            return NULL;
        }
        device = seen_type_device(backends, args[0]);
        if (device == NULL && PyErr_Occurred()) {
            goto cleanup;
        }
        if (device != NULL && device != TORCH_TENSORS) {
            /* As the Python method: no device, a stream device or a forced stream leave it as it is. */
            int events = uses_events(device);
            int forced = events == 0 ? attr_is_none(backends, s_forced_stream) : 1;
            if (events < 0 || forced < 0) {
                goto cleanup;
            }
            if (device != Py_None && events == 0 && forced == 1) {
                Py_XSETREF(self->device, Py_NewRef(device));
                if (device != HOST) {
                    PyObject *values = PyTuple_New(1);
                    if (values == NULL) {
                        goto cleanup;
                    }
                    PyTuple_SET_ITEM(values, 0, Py_NewRef(args[0]));
                    Py_XSETREF(self->values, values);
                }
            }
            done = 1;
        }
    }
    result = done ? Py_NewRef(Py_None) : forward(MB_WAIT_FOR_SLOW, (PyObject *)self, args, nargs, NULL);
cleanup:
    Py_XDECREF(backends);
    Py_XDECREF(device);
    return result;
}

static PyObject *
microbatch_exit(MicrobatchObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__exit__() takes 3 arguments");
        return NULL;
    }
    int r = self->step == NULL || self->rt == NULL ? -2 : uses_events(self->device);
    if (r == -1) {
        return NULL;
    }
    if (r == -2) {
        PyObject *full[4] = {(PyObject *)self, args[0], args[1], args[2]};
        return PyObject_Vectorcall(MB_EXIT_SLOW, full, 4, NULL);
    }
    if (r == 1 && end_marker(self->rt, (PyObject *)self, self->device) < 0) {
        return NULL; /* the end marker first, as the Python method (a pipeline rank's hundreds a step) */
    }
    PyObject *end = read_clock();
    if (end == NULL) {
        return NULL;
    }
    Py_XSETREF(self->host_end, end);
    PyObject *step = Py_NewRef(self->step);
    PyObject *microbatches = PyObject_GetAttr(step, s_microbatches);
    int failed = microbatches == NULL;
    if (!failed && PyList_Check(microbatches)) {
        failed = PyList_Append(microbatches, (PyObject *)self) < 0;
    }
    else if (!failed) {
        PyObject *fresh = PyList_New(1);
        failed = fresh == NULL;
        if (!failed) {
            PyList_SET_ITEM(fresh, 0, Py_NewRef((PyObject *)self));
            failed = PyObject_SetAttr(step, s_microbatches, fresh) < 0;
            Py_DECREF(fresh);
        }
    }
    Py_XDECREF(microbatches);
    Py_DECREF(step);
    if (failed) {
        return NULL;
    }
    Py_RETURN_FALSE;
}

/* -- type objects ------------------------------------------------------------------------------------------- */

#define RUNTIME_MEMBER(name, attr) {attr, T_OBJECT_EX, offsetof(RuntimeObject, name), 0, NULL},
static PyMemberDef runtime_members[] = {
    RUNTIME_MEMBER(current, "current")
    RUNTIME_MEMBER(last_step, "last_step")
    RUNTIME_MEMBER(last_step_end, "last_step_end")
    RUNTIME_MEMBER(closed_spans, "closed_spans")
    RUNTIME_MEMBER(open_spans, "open_spans")
    RUNTIME_MEMBER(capture, "capture")
    RUNTIME_MEMBER(annotate, "annotate")
    RUNTIME_MEMBER(annotate_enabled, "annotate_enabled")
    RUNTIME_MEMBER(backends, "backends")
    RUNTIME_MEMBER(resolver, "resolver")
    RUNTIME_MEMBER(hot, "_hot")
    RUNTIME_MEMBER(unsettled, "unsettled")
    RUNTIME_MEMBER(step_extras, "_step_extras")
    RUNTIME_MEMBER(active, "active")
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef runtime_methods[] = {
    {"step", (PyCFunction)(void (*)(void))runtime_step, METH_FASTCALL | METH_KEYWORDS,
     "Time training step n (a context manager; see steptrace.step)."},
    {"span", (PyCFunction)(void (*)(void))runtime_span, METH_FASTCALL | METH_KEYWORDS,
     "Time a host span (see steptrace.span)."},
    {"microbatch", (PyCFunction)(void (*)(void))runtime_microbatch, METH_FASTCALL | METH_KEYWORDS,
     "Time a pipeline microbatch (see steptrace.microbatch)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RuntimeBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "steptrace._hotpath.RuntimeBase",
    .tp_doc = PyDoc_STR("The training-thread state of steptrace._runtime.Runtime, kept where C reads it."),
    .tp_basicsize = sizeof(RuntimeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = runtime_new,
    .tp_dealloc = (destructor)runtime_dealloc,
    .tp_traverse = (traverseproc)runtime_traverse,
    .tp_clear = (inquiry)runtime_clear,
    .tp_members = runtime_members,
    .tp_methods = runtime_methods,
};

#define STEP_MEMBER(name, attr) {attr, T_OBJECT_EX, offsetof(StepObject, name), 0, NULL},
static PyMemberDef step_members[] = {
    STEP_MEMBER(rt, "_rt")
    STEP_MEMBER(step, "step")
    STEP_MEMBER(attrs, "attrs")
    STEP_MEMBER(host_start, "host_start")
    STEP_MEMBER(dispatch, "dispatch")
    STEP_MEMBER(host_end, "host_end")
    STEP_MEMBER(device, "device")
    STEP_MEMBER(waited, "waited")
    STEP_MEMBER(submitted, "submitted")
    STEP_MEMBER(values, "values")
    STEP_MEMBER(annotation, "_annotation")
    STEP_MEMBER(auto_flops, "auto_flops")
    STEP_MEMBER(start_event, "start_event")
    STEP_MEMBER(spans, "spans")
    STEP_MEMBER(scalars, "scalars")
    STEP_MEMBER(loop, "loop")
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef step_methods[] = {
    {"__enter__", (PyCFunction)step_enter, METH_NOARGS, "Open the step (StepHandle.__enter__)."},
    {"wait_for", (PyCFunction)(void (*)(void))step_wait_for, METH_FASTCALL,
     "Mark values (arrays, pytrees) as this step's device outputs; the step ends, on the device, when they "
     "are ready. The resolver waits for them on a background thread; this call returns at once."},
    {"__exit__", (PyCFunction)(void (*)(void))step_exit, METH_FASTCALL, "Close the step (StepHandle.__exit__)."},
    {"log", (PyCFunction)(void (*)(void))step_log, METH_FASTCALL | METH_KEYWORDS,
     "Record named scalars of this step, e.g. s.log(loss=loss, grad_norm=g) (StepHandle.log)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StepBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "steptrace._hotpath.StepBase",
    .tp_doc = PyDoc_STR("The hot fields and calls of steptrace._handles.StepHandle."),
    .tp_basicsize = sizeof(StepObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = step_new,
    .tp_dealloc = (destructor)step_dealloc,
    .tp_traverse = (traverseproc)step_traverse,
    .tp_clear = (inquiry)step_clear,
    .tp_members = step_members,
    .tp_methods = step_methods,
};

#define SPAN_MEMBER(name, attr) {attr, T_OBJECT_EX, offsetof(SpanObject, name), 0, NULL},
static PyMemberDef span_members[] = {
    SPAN_MEMBER(rt, "_rt")
    SPAN_MEMBER(name, "name")
    SPAN_MEMBER(attrs, "attrs")
    SPAN_MEMBER(start, "start")
    SPAN_MEMBER(marker, "marker")
    SPAN_MEMBER(opened_in, "opened_in")
    SPAN_MEMBER(crossed, "crossed")
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef span_methods[] = {
    {"__enter__", (PyCFunction)span_enter, METH_NOARGS, "Open the span (SpanHandle.__enter__)."},
    {"__exit__", (PyCFunction)(void (*)(void))span_exit, METH_FASTCALL, "Close the span (SpanHandle.__exit__)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SpanBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "steptrace._hotpath.SpanBase",
    .tp_doc = PyDoc_STR("The hot fields and calls of steptrace._handles.SpanHandle."),
    .tp_basicsize = sizeof(SpanObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = span_new,
    .tp_dealloc = (destructor)span_dealloc,
    .tp_traverse = (traverseproc)span_traverse,
    .tp_clear = (inquiry)span_clear,
    .tp_members = span_members,
    .tp_methods = span_methods,
};

#define MICROBATCH_MEMBER(name, attr) {attr, T_OBJECT_EX, offsetof(MicrobatchObject, name), 0, NULL},
static PyMemberDef microbatch_members[] = {
    MICROBATCH_MEMBER(rt, "_rt")
    MICROBATCH_MEMBER(step, "_step")
    MICROBATCH_MEMBER(index, "index")
    MICROBATCH_MEMBER(stage, "stage")
    MICROBATCH_MEMBER(chunk, "chunk")
    MICROBATCH_MEMBER(kind, "kind")
    MICROBATCH_MEMBER(host_start, "host_start")
    MICROBATCH_MEMBER(dispatch, "dispatch")
    MICROBATCH_MEMBER(host_end, "host_end")
    MICROBATCH_MEMBER(device, "device")
    MICROBATCH_MEMBER(values, "values")
    MICROBATCH_MEMBER(start_event, "start_event")
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef microbatch_methods[] = {
    {"__enter__", (PyCFunction)microbatch_enter, METH_NOARGS, "Open the microbatch (MicrobatchHandle.__enter__)."},
    {"wait_for", (PyCFunction)(void (*)(void))microbatch_wait_for, METH_FASTCALL,
     "The microbatch's device work ends when values are ready (JAX)."},
    {"__exit__", (PyCFunction)(void (*)(void))microbatch_exit, METH_FASTCALL,
     "Close the microbatch (MicrobatchHandle.__exit__)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MicrobatchBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "steptrace._hotpath.MicrobatchBase",
    .tp_doc = PyDoc_STR("The hot fields and calls of steptrace._handles.MicrobatchHandle."),
    .tp_basicsize = sizeof(MicrobatchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = microbatch_new,
    .tp_dealloc = (destructor)microbatch_dealloc,
    .tp_traverse = (traverseproc)microbatch_traverse,
    .tp_clear = (inquiry)microbatch_clear,
    .tp_members = microbatch_members,
    .tp_methods = microbatch_methods,
};

/* -- the no-op handles (steptrace off, before init(), misuse) ---------------------------------------------- */

/* NullBase: the base of steptrace._handles._NullContext, whose shared instances every call returns while
 * steptrace is off. Disabled means free: these cost what a call of a C method does, below a do-nothing
 * Python `with` (bench_overhead's "steptrace disabled" row). */
static PyObject *
null_enter(PyObject *self, PyObject *unused)
{
    return Py_NewRef(self);
}

static PyObject *
null_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_RETURN_FALSE; /* never swallow the user's exception */
}

static PyObject *
null_any(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    Py_RETURN_NONE;
}

static PyObject *
null_none(PyObject *self, PyObject *unused)
{
    Py_RETURN_NONE;
}

static PyMethodDef null_methods[] = {
    {"__enter__", (PyCFunction)null_enter, METH_NOARGS, "Does nothing."},
    {"__exit__", (PyCFunction)(void (*)(void))null_exit, METH_FASTCALL, "Does nothing; never swallows an exception."},
    {"wait_for", (PyCFunction)(void (*)(void))null_any, METH_FASTCALL | METH_KEYWORDS, "Does nothing."},
    {"log", (PyCFunction)(void (*)(void))null_any, METH_FASTCALL | METH_KEYWORDS, "Does nothing."},
    {"async_done", (PyCFunction)null_none, METH_NOARGS, "Does nothing."},
    {"track", (PyCFunction)(void (*)(void))null_any, METH_FASTCALL | METH_KEYWORDS, "Does nothing."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NullBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "steptrace._hotpath.NullBase",
    .tp_doc = PyDoc_STR("The methods of steptrace._handles._NullContext: each does nothing."),
    .tp_basicsize = sizeof(PyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_methods = null_methods,
};

/* steptrace.step while steptrace is off (init(enabled=False)): the shared no-op step, whatever it is given. */
static PyObject *NULL_STEP_OBJECT;

static PyObject *
off_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    /* What `def step(n, **attrs)` accepts: n once, by position or by name. */
    int named = 0;
    for (Py_ssize_t i = 0; kwnames != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, i), "n") == 0) {
            named = 1;
        }
    }
    if (nargs + named != 1) {
        PyErr_SetString(PyExc_TypeError, "step() takes the step number n, once");
        return NULL;
    }
    if (NULL_STEP_OBJECT == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "steptrace._hotpath: set_null_step() was not called");
        return NULL;
    }
    return Py_NewRef(NULL_STEP_OBJECT);
}

static PyObject *
set_null_step(PyObject *module, PyObject *null_step)
{
    Py_XSETREF(NULL_STEP_OBJECT, Py_NewRef(null_step));
    Py_RETURN_NONE;
}

/* -- install ------------------------------------------------------------------------------------------------ */

static PyObject *
install(PyObject *module, PyObject *args)
{
    PyObject *host, *torch_tensors, *step_class, *step_slow, *enter_slow, *wait_for_slow, *exit_slow, *log_slow,
        *span_class, *span_slow, *span_enter_slow, *span_exit_slow, *microbatch_class, *microbatch_slow,
        *mb_wait_for_slow, *mb_exit_slow, *globals;
    if (!PyArg_ParseTuple(args, "OOO!OOOOOO!OOOO!OOOO!:install", &host, &torch_tensors, &PyType_Type, &step_class,
                          &step_slow, &enter_slow, &wait_for_slow, &exit_slow, &log_slow, &PyType_Type, &span_class,
                          &span_slow, &span_enter_slow, &span_exit_slow, &PyType_Type, &microbatch_class,
                          &microbatch_slow, &mb_wait_for_slow, &mb_exit_slow, &PyDict_Type, &globals)) {
        return NULL;
    }
    if (!PyType_IsSubtype((PyTypeObject *)step_class, &StepBaseType) ||
            !PyType_IsSubtype((PyTypeObject *)span_class, &SpanBaseType) ||
            !PyType_IsSubtype((PyTypeObject *)microbatch_class, &MicrobatchBaseType)) {
        PyErr_SetString(PyExc_TypeError, "install(): the handle classes must derive from StepBase and SpanBase");
        return NULL;
    }
    Py_XSETREF(HOST, Py_NewRef(host));
    Py_XSETREF(TORCH_TENSORS, Py_NewRef(torch_tensors));
    Py_XSETREF(STEP_CLASS, Py_NewRef(step_class));
    Py_XSETREF(STEP_SLOW, Py_NewRef(step_slow));
    Py_XSETREF(ENTER_SLOW, Py_NewRef(enter_slow));
    Py_XSETREF(WAIT_FOR_SLOW, Py_NewRef(wait_for_slow));
    Py_XSETREF(EXIT_SLOW, Py_NewRef(exit_slow));
    Py_XSETREF(LOG_SLOW, Py_NewRef(log_slow));
    Py_XSETREF(SPAN_CLASS, Py_NewRef(span_class));
    Py_XSETREF(SPAN_SLOW, Py_NewRef(span_slow));
    Py_XSETREF(SPAN_ENTER_SLOW, Py_NewRef(span_enter_slow));
    Py_XSETREF(SPAN_EXIT_SLOW, Py_NewRef(span_exit_slow));
    Py_XSETREF(MICROBATCH_CLASS, Py_NewRef(microbatch_class));
    Py_XSETREF(MICROBATCH_SLOW, Py_NewRef(microbatch_slow));
    Py_XSETREF(MB_WAIT_FOR_SLOW, Py_NewRef(mb_wait_for_slow));
    Py_XSETREF(MB_EXIT_SLOW, Py_NewRef(mb_exit_slow));
    Py_XSETREF(GLOBALS, Py_NewRef(globals));
    Py_RETURN_NONE;
}


/* -- GcWatch: the training thread's garbage-collection pauses (issue 50) ------------------------------------
 *
 * A gc.callbacks entry (steptrace/_pauses.py installs it): CPython calls it with ("start", info) before and
 * ("stop", info) after every collection, on the thread that triggered it. A loop that allocates much runs
 * ~100 young collections a step, so the callback is C: it reads the perf counter (time.perf_counter's clock)
 * and, at "stop", keeps (start, end, generation, collected) in a ring the resolver drains. Collections on
 * other threads are counted, not kept: they did not pause the training thread. A full ring drops the oldest
 * pause and counts it (`dropped`).
 */
typedef struct {
    double start;
    double end;
    long generation;
    Py_ssize_t collected;
} GcPause;

typedef struct {
    PyObject_HEAD
    unsigned long thread;   /* PyThread_get_thread_ident() of the training thread; 0: none yet */
    double started;         /* the collection under way on it: its start, or -1 */
    GcPause *ring;
    Py_ssize_t capacity;
    Py_ssize_t head;        /* the oldest kept pause */
    Py_ssize_t count;
    unsigned long long dropped;
    unsigned long long other_threads;
} GcWatchObject;

static PyObject *s_generation, *s_collected;

static double
perf_seconds(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyTime_t t;
    (void)PyTime_PerfCounterRaw(&t);
    return PyTime_AsSecondsDouble(t);
#else
    return _PyTime_AsSecondsDouble(_PyTime_GetPerfCounter());
#endif
}

static PyObject *
gcwatch_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Py_ssize_t capacity = 4096;
    static char *kwlist[] = {"capacity", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n", kwlist, &capacity)) {
        return NULL;
    }
    if (capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "GcWatch capacity must be >= 1");
        return NULL;
    }
    GcWatchObject *self = (GcWatchObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->ring = PyMem_Calloc((size_t)capacity, sizeof(GcPause));
    if (self->ring == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->capacity = capacity;
    self->started = -1.0;
    return (PyObject *)self;
}

static void
gcwatch_dealloc(GcWatchObject *self)
{
    PyMem_Free(self->ring);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
gcwatch_call(GcWatchObject *self, PyObject *args, PyObject *kwds)
{
    /* Never raises: an exception here would be printed by the collector as unraisable, in the loop. */
    if (PyTuple_GET_SIZE(args) != 2 || self->thread == 0) {
        Py_RETURN_NONE;
    }
    if (PyThread_get_thread_ident() != self->thread) {
        self->other_threads += PyUnicode_Check(PyTuple_GET_ITEM(args, 0)) &&
            PyUnicode_GET_LENGTH(PyTuple_GET_ITEM(args, 0)) == 4;  /* each "stop" */
        Py_RETURN_NONE;
    }
    PyObject *phase = PyTuple_GET_ITEM(args, 0);
    if (!PyUnicode_Check(phase)) {
        Py_RETURN_NONE;
    }
    if (PyUnicode_GET_LENGTH(phase) == 5) { /* "start" */
        self->started = perf_seconds();
        Py_RETURN_NONE;
    }
    if (self->started < 0) {
        Py_RETURN_NONE; /* a "stop" whose start was before the watch was armed */
    }
    double end = perf_seconds();
    long generation = -1;
    Py_ssize_t collected = 0;
    PyObject *info = PyTuple_GET_ITEM(args, 1);
    if (PyDict_Check(info)) {
        PyObject *value = PyDict_GetItemWithError(info, s_generation);
        if (value != NULL && PyLong_Check(value)) {
            generation = PyLong_AsLong(value);
        }
        value = PyDict_GetItemWithError(info, s_collected);
        if (value != NULL && PyLong_Check(value)) {
            collected = PyLong_AsSsize_t(value);
        }
        PyErr_Clear();
    }
    Py_ssize_t slot;
    if (self->count == self->capacity) {
        slot = self->head; /* overwrite the oldest */
        self->head = (self->head + 1) % self->capacity;
        self->dropped++;
    } else {
        slot = (self->head + self->count) % self->capacity;
        self->count++;
    }
    self->ring[slot].start = self->started;
    self->ring[slot].end = end;
    self->ring[slot].generation = generation;
    self->ring[slot].collected = collected;
    self->started = -1.0;
    Py_RETURN_NONE;
}

static PyObject *
gcwatch_take(GcWatchObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(self->count);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->count; i++) {
        GcPause *p = &self->ring[(self->head + i) % self->capacity];
        PyObject *item = Py_BuildValue("(ddln)", p->start, p->end, p->generation, p->collected);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    self->head = 0;
    self->count = 0;
    return out;
}

static PyObject *
gcwatch_arm(GcWatchObject *self, PyObject *Py_UNUSED(ignored))
{
    self->thread = PyThread_get_thread_ident();
    self->started = -1.0;
    Py_RETURN_NONE;
}

static PyObject *
gcwatch_disarm(GcWatchObject *self, PyObject *Py_UNUSED(ignored))
{
    self->thread = 0;
    self->started = -1.0;
    Py_RETURN_NONE;
}

static PyObject *
gcwatch_get_dropped(GcWatchObject *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(self->dropped);
}

static PyObject *
gcwatch_get_other_threads(GcWatchObject *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(self->other_threads);
}

static PyObject *
gcwatch_get_armed(GcWatchObject *self, void *closure)
{
    return PyBool_FromLong(self->thread != 0);
}

static PyMethodDef gcwatch_methods[] = {
    {"take", (PyCFunction)gcwatch_take, METH_NOARGS,
     "take(): the pauses kept since the last take, oldest first, as (start, end, generation, collected)"},
    {"arm", (PyCFunction)gcwatch_arm, METH_NOARGS, "arm(): watch the calling thread's collections"},
    {"disarm", (PyCFunction)gcwatch_disarm, METH_NOARGS, "disarm(): keep nothing more"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef gcwatch_getset[] = {
    {"dropped", (getter)gcwatch_get_dropped, NULL, "pauses overwritten before they were taken", NULL},
    {"other_threads", (getter)gcwatch_get_other_threads, NULL, "collections seen on other threads", NULL},
    {"armed", (getter)gcwatch_get_armed, NULL, "whether a thread is watched", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GcWatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "steptrace._hotpath.GcWatch",
    .tp_basicsize = sizeof(GcWatchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "GcWatch(capacity=4096): a gc.callbacks entry keeping the armed thread's collection pauses",
    .tp_new = gcwatch_new,
    .tp_dealloc = (destructor)gcwatch_dealloc,
    .tp_call = (ternaryfunc)gcwatch_call,
    .tp_methods = gcwatch_methods,
    .tp_getset = gcwatch_getset,
};

static PyMethodDef functions[] = {
    {"off_step", (PyCFunction)(void (*)(void))off_step, METH_FASTCALL | METH_KEYWORDS,
     "steptrace.step while steptrace is off: accepts what the real one accepts, records nothing."},
    {"set_null_step", set_null_step, METH_O, "set_null_step(NULL_STEP): what off_step returns"},
    {"install", install, METH_VARARGS,
     "install(HOST, TORCH_TENSORS, StepHandle, Runtime.step, StepHandle.__enter__, StepHandle.wait_for, "
     "StepHandle.__exit__, StepHandle.log, SpanHandle, Runtime.span, SpanHandle.__enter__, SpanHandle.__exit__, "
     "MicrobatchHandle, Runtime.microbatch, MicrobatchHandle.wait_for, MicrobatchHandle.__exit__, "
     "steptrace._handles.__dict__): the Python definitions the fast path hands the "
     "rest to"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT, "steptrace._hotpath",
    "The training thread's per-step calls in C (optional; the Python classes hold their full definition).",
    -1, functions,
};

#define INTERN(var, text)                           \
    do {                                            \
        var = PyUnicode_InternFromString(text);     \
        if (var == NULL) {                          \
            return NULL;                            \
        }                                           \
    } while (0)

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    INTERN(s_pending, "pending");
    INTERN(s_active, "active");
    INTERN(s_may_stream, "may_stream");
    INTERN(s_stream_for_unit, "stream_for_unit");
    INTERN(s_start_markers, "start_markers");
    INTERN(s_end_marker, "end_marker");
    INTERN(s_start_unit, "start_unit");
    INTERN(s_end_unit, "end_unit");
    INTERN(s_auto, "auto");
    INTERN(s_device, "device");
    INTERN(s_compiled_markers, "compiled_markers");
    INTERN(s__capturing, "_capturing");
    INTERN(s__get_device, "_get_device");
    INTERN(s_tensor_device, "tensor_device");
    INTERN(s__timed, "_timed");
    INTERN(s__checks_left, "_checks_left");
    INTERN(s__raw_stream, "_raw_stream");
    INTERN(s__placements, "_placements");
    INTERN(s_steptrace_device, "steptrace_device");
    INTERN(s__free, "_free");
    INTERN(s__record_raw, "_record_raw");
    INTERN(s_memory_due, "memory_due");
    INTERN(s_steptrace_handle, "steptrace_handle");
    INTERN(s_handle, "handle");
    INTERN(s__last, "_last");
    INTERN(s__last_stream_handle, "_last_stream_handle");
    INTERN(s_stream, "stream");
    INTERN(s_start_recorded_after, "start_recorded_after");
    INTERN(s_end_recorded_after, "end_recorded_after");
    INTERN(s_host_start, "host_start");
    INTERN(s_device_failed, "device_failed");
    INTERN(s_drop_markers, "drop_markers");
    INTERN(s__owner, "_owner");
    INTERN(s_index, "index");
    INTERN(s_checked, "checked");
    INTERN(s_end_event, "end_event");
    INTERN(s__cuda, "_cuda");
    INTERN(s_span_marker, "span_marker");
    INTERN(s_close_span, "close_span");
    INTERN(s__crossed_into, "_crossed_into");
    INTERN(s_start_event, "start_event");
    INTERN(s_microbatches, "microbatches");
    INTERN(s_backends, "backends");
    FORWARD = PyUnicode_InternFromString("forward");
    BACKWARD = PyUnicode_InternFromString("backward");
    if (FORWARD == NULL || BACKWARD == NULL) {
        return NULL;
    }
    INTERN(s_torch, "torch");
    INTERN(s_forced_values, "forced_values");
    INTERN(s_by_type, "by_type");
    INTERN(s_uses_events, "uses_events");
    INTERN(s_forced_stream, "forced_stream");
    INTERN(s_timed_by_values, "timed_by_values");
    INTERN(s_submit, "submit");
    INTERN(s__perf, "_perf");
    INTERN(s__stopping, "_stopping");
    INTERN(s__queue, "_queue");
    INTERN(s__max_queue, "_max_queue");
    INTERN(s_append, "append");
    INTERN(s_generation, "generation");
    INTERN(s_collected, "collected");
    ZERO = PyFloat_FromDouble(0.0);
    if (ZERO == NULL || PyType_Ready(&RuntimeBaseType) < 0 || PyType_Ready(&StepBaseType) < 0 ||
            PyType_Ready(&SpanBaseType) < 0 || PyType_Ready(&NullBaseType) < 0 ||
            PyType_Ready(&MicrobatchBaseType) < 0 || PyType_Ready(&GcWatchType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&hotpath_module);
    if (module == NULL) {
        return NULL;
    }
#ifndef STEPTRACE_HOTPATH_SHA256
#define STEPTRACE_HOTPATH_SHA256 ""
#endif
    if (PyModule_AddStringConstant(module, "SOURCE_SHA256", STEPTRACE_HOTPATH_SHA256) < 0 ||
            PyModule_AddObjectRef(module, "RuntimeBase", (PyObject *)&RuntimeBaseType) < 0 ||
            PyModule_AddObjectRef(module, "StepBase", (PyObject *)&StepBaseType) < 0 ||
            PyModule_AddObjectRef(module, "SpanBase", (PyObject *)&SpanBaseType) < 0 ||
            PyModule_AddObjectRef(module, "NullBase", (PyObject *)&NullBaseType) < 0 ||
            PyModule_AddObjectRef(module, "MicrobatchBase", (PyObject *)&MicrobatchBaseType) < 0 ||
            PyModule_AddObjectRef(module, "GcWatch", (PyObject *)&GcWatchType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
