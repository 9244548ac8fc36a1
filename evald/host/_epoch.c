/* The epoch ticker as a native thread: it never waits for Python's GIL.
 *
 * A Python ticker thread needs the GIL to wake up; a thread that holds it (a pure-Python busy
 * loop, a long C call that keeps it) delays every tick, and every deadline with it, by as
 * long as it holds it (1.44 s over a 100 ms deadline was observed). This thread calls
 * wasmtime's own `wasmtime_engine_increment_epoch` (its address, and the engine's, are passed
 * in as integers by evald.host._engine) on an absolute CLOCK_MONOTONIC schedule, catching up
 * after a late wake-up so the epoch tracks the wall clock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

typedef void (*increment_fn)(void *engine);

/* Ticker threads alive in this process (for tests: a dropped host must stop its thread). */
static atomic_int live_threads;

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    increment_fn increment;
    void *engine;
    int64_t period_ns;
    int64_t start_ns;
    atomic_int stopping;
    atomic_uint_fast64_t done;
    int running;
} Ticker;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void *run(void *arg) {
    Ticker *self = (Ticker *)arg;
    uint64_t done = 0;
    while (!atomic_load(&self->stopping)) {
        int64_t next = self->start_ns + (int64_t)(done + 1) * self->period_ns;
        struct timespec at = {(time_t)(next / 1000000000LL), (long)(next % 1000000000LL)};
        int rc;
        do {
            rc = clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, NULL);
        } while (rc == EINTR && !atomic_load(&self->stopping));
        if (atomic_load(&self->stopping)) {
            break;
        }
        uint64_t due = (uint64_t)((now_ns() - self->start_ns) / self->period_ns);
        /* at most 10,000 increments at once, as the Python ticker */
        uint64_t burst = 0;
        while (done < due && burst < 10000) {
            self->increment(self->engine);
            done++;
            burst++;
        }
        atomic_store(&self->done, done);
    }
    return NULL;
}

static void stop_thread(Ticker *self) {
    if (self->running) {
        atomic_store(&self->stopping, 1);
        pthread_join(self->thread, NULL);
        self->running = 0;
        atomic_fetch_sub(&live_threads, 1);
    }
}

static int Ticker_init(Ticker *self, PyObject *args, PyObject *kwds) {
    static char *keywords[] = {"increment", "engine", "period_ns", NULL};
    unsigned long long increment = 0, engine = 0;
    long long period_ns = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KKL", keywords, &increment, &engine,
                                     &period_ns)) {
        return -1;
    }
    if (increment == 0 || engine == 0 || period_ns <= 0) {
        PyErr_SetString(PyExc_ValueError, "increment and engine must be addresses, period > 0");
        return -1;
    }
    if (self->running) {
        PyErr_SetString(PyExc_RuntimeError, "the ticker is already running");
        return -1;
    }
    self->increment = (increment_fn)(uintptr_t)increment;
    self->engine = (void *)(uintptr_t)engine;
    self->period_ns = period_ns;
    self->start_ns = now_ns();
    atomic_store(&self->stopping, 0);
    atomic_store(&self->done, 0);
    int rc = pthread_create(&self->thread, NULL, run, self);
    if (rc != 0) {
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->running = 1;
    atomic_fetch_add(&live_threads, 1);
    return 0;
}

static PyObject *Ticker_stop(Ticker *self, PyObject *Py_UNUSED(ignored)) {
    Py_BEGIN_ALLOW_THREADS
    stop_thread(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Ticker_done(Ticker *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromUnsignedLongLong((unsigned long long)atomic_load(&self->done));
}

static PyObject *Ticker_lag(Ticker *self, PyObject *Py_UNUSED(ignored)) {
    int64_t due = (now_ns() - self->start_ns) / self->period_ns;
    int64_t lag = due - (int64_t)atomic_load(&self->done);
    return PyLong_FromLongLong(lag > 0 ? lag : 0);
}

static void Ticker_dealloc(Ticker *self) {
    stop_thread(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Ticker_methods[] = {
    {"stop", (PyCFunction)Ticker_stop, METH_NOARGS, "Stops the thread and waits for it."},
    {"done", (PyCFunction)Ticker_done, METH_NOARGS, "Increments made so far."},
    {"lag_ticks", (PyCFunction)Ticker_lag, METH_NOARGS,
     "Ticks the epoch is behind the wall clock right now."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TickerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "evald.host._epoch.Ticker",
    .tp_doc = "Increments a wasmtime engine's epoch every period_ns from a native thread.",
    .tp_basicsize = sizeof(Ticker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ticker_init,
    .tp_dealloc = (destructor)Ticker_dealloc,
    .tp_methods = Ticker_methods,
};

static PyObject *live(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(atomic_load(&live_threads));
}

static PyMethodDef module_methods[] = {
    {"live", (PyCFunction)live, METH_NOARGS, "Ticker threads running in this process."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "evald.host._epoch",
    "The GIL-free epoch ticker thread (see evald.host._engine.EpochTicker).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__epoch(void) {
    if (PyType_Ready(&TickerType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&TickerType);
    if (PyModule_AddObject(m, "Ticker", (PyObject *)&TickerType) < 0) {
        Py_DECREF(&TickerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
