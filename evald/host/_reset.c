/* Putting a linear memory back to its image: the loop of evald.host._fastcall.MemoryReset in C.
 *
 * The contract, and why the pages it writes are exactly the ones that can differ from a new
 * instance's memory, are in MemoryReset's docstring; this is the same loop without the
 * Python interpreter between the kernel's answer and the writes (a fresh call's reset is then
 * one system call and a few page writes). One call:
 *
 *   reset(fd, base, size, offsets, pages, page_size) -> bytes written
 *
 * fd: /proc/self/pagemap of this process; base, size: the memory (host-page aligned);
 * offsets: the pristine pages' offsets as native uint64 values, sorted; pages: their bytes,
 * page_size each, in the same order. The scan and the writes run without the GIL: the caller
 * keeps the memory, and the two bytes objects, alive and unused by guest code meanwhile.
 * Raises OSError when the scan fails or stops short: the memory is then not known to be reset.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>

/* linux/fs.h (Linux 6.7), spelled out: build machines may have older headers. */
struct evald_page_region {
    uint64_t start, end, categories;
};

struct evald_pm_scan_arg {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages, category_inverted,
        category_mask, category_anyof_mask, return_mask;
};

#define EVALD_PAGEMAP_SCAN _IOWR('f', 16, struct evald_pm_scan_arg)
#define EVALD_PAGE_IS_FILE (1u << 2)
#define EVALD_PAGE_IS_PRESENT (1u << 3)
#define EVALD_PAGE_IS_SWAPPED (1u << 4)
#define EVALD_PAGE_IS_PFNZERO (1u << 5)
#define EVALD_REGIONS 32

/* Copies back the pristine pages inside [start, end) (offsets from base). */
static uint64_t restore(uint8_t *base, uint64_t start, uint64_t end, const uint64_t *offsets,
                        Py_ssize_t count, const uint8_t *pages, uint64_t page) {
    Py_ssize_t low = 0, high = count;
    while (low < high) { /* the first offset >= start */
        Py_ssize_t middle = low + (high - low) / 2;
        if (offsets[middle] < start)
            low = middle + 1;
        else
            high = middle;
    }
    uint64_t written = 0;
    for (Py_ssize_t index = low; index < count && offsets[index] < end; index++) {
        memcpy(base + offsets[index], pages + (uint64_t)index * page, page);
        written += page;
    }
    return written;
}

static PyObject *reset(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "reset(fd, base, size, offsets, pages, page_size)");
        return NULL;
    }
    int fd = (int)PyLong_AsLong(args[0]);
    uint64_t base = PyLong_AsUnsignedLongLong(args[1]);
    uint64_t size = PyLong_AsUnsignedLongLong(args[2]);
    uint64_t page = PyLong_AsUnsignedLongLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(args[3]) || !PyBytes_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "offsets and pages must be bytes");
        return NULL;
    }
    Py_ssize_t count = PyBytes_GET_SIZE(args[3]) / (Py_ssize_t)sizeof(uint64_t);
    if (page == 0 || PyBytes_GET_SIZE(args[4]) != (Py_ssize_t)((uint64_t)count * page)) {
        PyErr_SetString(PyExc_ValueError, "pages must hold one page per offset");
        return NULL;
    }
    const uint64_t *offsets = (const uint64_t *)PyBytes_AS_STRING(args[3]);
    const uint8_t *pages = (const uint8_t *)PyBytes_AS_STRING(args[4]);

    struct evald_page_region regions[EVALD_REGIONS];
    struct evald_pm_scan_arg scan;
    memset(&scan, 0, sizeof scan);
    scan.size = sizeof scan;
    scan.start = base;
    scan.end = base + size;
    scan.vec = (uint64_t)(uintptr_t)regions;
    scan.vec_len = EVALD_REGIONS;
    /* present or swapped out, and not a file page; regions split at the zero page */
    scan.category_inverted = EVALD_PAGE_IS_FILE;
    scan.category_mask = EVALD_PAGE_IS_FILE;
    scan.category_anyof_mask = EVALD_PAGE_IS_PRESENT | EVALD_PAGE_IS_SWAPPED;
    scan.return_mask = EVALD_PAGE_IS_PFNZERO;

    uint64_t written = 0;
    int error = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        int found = ioctl(fd, EVALD_PAGEMAP_SCAN, &scan);
        if (found < 0) {
            error = errno;
            break;
        }
        for (int index = 0; index < found; index++) {
            uint64_t start = regions[index].start - base, end = regions[index].end - base;
            if (!(regions[index].categories & EVALD_PAGE_IS_PFNZERO)) {
                memset((uint8_t *)(uintptr_t)base + start, 0, end - start);
                written += end - start;
            }
            if (count)
                written += restore((uint8_t *)(uintptr_t)base, start, end, offsets, count,
                                   pages, page);
        }
        if (scan.walk_end >= base + size)
            break;
        if (found == 0 && scan.walk_end <= scan.start) {
            error = -1; /* no progress: never report a memory as reset that was not */
            break;
        }
        scan.start = scan.walk_end;
    }
    Py_END_ALLOW_THREADS
    if (error > 0) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (error < 0) {
        PyErr_SetString(PyExc_OSError, "PAGEMAP_SCAN stopped before the end of the memory");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(written);
}

static PyMethodDef methods[] = {
    {"reset", (PyCFunction)(void (*)(void))reset, METH_FASTCALL,
     "Resets a linear memory to its pristine pages (see evald.host._fastcall.MemoryReset)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "evald.host._reset",
    "The reset loop of evald.host._fastcall.MemoryReset, without the interpreter.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__reset(void) { return PyModule_Create(&module); }
