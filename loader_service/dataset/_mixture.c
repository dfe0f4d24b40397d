/*
 * The sources of a mixture's epoch, position by position: the earliest-deadline rule of
 * NOTE [ Mixture order ] (loader_service/dataset/mixture.py), whose ``_choose`` is the reference
 * and the fallback where this is not built. Same integers, same ties, so the same bytes (a test
 * compares the two on random schedules).
 *
 *   choose(chosen, draw, bounds, weights, total, sources)
 *
 * chosen: a writable buffer of uint16, one per position; draw: a writable buffer of int32, one per
 * position, given each position's draw of its source (0 for its first, 1 for its second...);
 * bounds: int64, segment i covers positions [bounds[i], bounds[i + 1]) (its last entry the end);
 * weights: int64, segments x sources, each
 * segment's weights already scaled to sum to total. Deficits are in units of 1 / total.
 *
 * Bounds: a deficit stays within a few totals of 0 (within 2 once the rule runs; NOTE [ Weight
 * schedules ] measures 1.5 after changes), so with total < 2^44 and k <= 256 sources a deadline's
 * numerator, slack * (total - deficit), stays below 2^62 even for deficits of 100 totals, and two
 * of them multiplied fit __int128. The caller sends nothing else; this checks it again.
 * Returns each source's positions (a tuple). The GIL is released while choosing: a caller may choose in a thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>

#define MAX_SOURCES 256
#define MAX_TOTAL ((int64_t)1 << 44)

typedef __int128 wide;

/* a[0] / a[1] < b[0] / b[1], a zero denominator meaning infinitely late (as _earlier). */
static int earlier(int64_t an, int64_t ad, int64_t bn, int64_t bd)
{
    if (ad == 0)
        return 0;
    if (bd == 0)
        return 1;
    return (wide)an * bd < (wide)bn * ad;
}

static void choose_segment(uint16_t *chosen, int32_t *draw, int64_t start, int64_t stop,
                           const int64_t *weights, int64_t *deficit, int32_t *drawn, int64_t total,
                           int sources)
{
    const int64_t slack = 2 * (int64_t)sources - 2;
    for (int64_t j = start; j < stop; j++) {
        int best = -1;
        int64_t key_n = 0, key_d = 0;
        for (int s = 0; s < sources; s++) {
            int64_t before = deficit[s];
            deficit[s] += weights[s];
            if ((wide)deficit[s] * slack < total)
                continue; /* not eligible */
            int64_t mine_n = slack * (total - before) - total, mine_d = slack * weights[s];
            if (best < 0 || earlier(mine_n, mine_d, key_n, key_d)) {
                best = s;
                key_n = mine_n;
                key_d = mine_d;
            }
        }
        deficit[best] -= total;
        chosen[j] = (uint16_t)best;
        draw[j] = drawn[best]++;
    }
}

static PyObject *mixture_choose(PyObject *self, PyObject *args)
{
    Py_buffer chosen, draw, bounds, weights;
    long long total;
    int sources;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*w*y*y*Li", &chosen, &draw, &bounds, &weights, &total, &sources))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t positions = chosen.len / (Py_ssize_t)sizeof(uint16_t);
    Py_ssize_t segments = bounds.len / (Py_ssize_t)sizeof(int64_t) - 1;
    const int64_t *bound = bounds.buf, *weight = weights.buf;
    int64_t *deficit = NULL;
    int32_t *drawn = NULL;
    if (draw.len != positions * (Py_ssize_t)sizeof(int32_t) || positions >= INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "choose: draw must hold one int32 per position");
        goto done;
    }
    if (sources < 2 || sources > MAX_SOURCES || total < 1 || total >= MAX_TOTAL || segments < 1
        || weights.len != segments * sources * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "choose: sources, total or the weights' length out of range");
        goto done;
    }
    for (Py_ssize_t i = 0; i < segments; i++) {
        if (bound[i] < 0 || bound[i] > bound[i + 1] || bound[i + 1] > positions) {
            PyErr_SetString(PyExc_ValueError, "choose: bounds must rise within the positions");
            goto done;
        }
    }
    deficit = calloc((size_t)sources, sizeof(int64_t));
    drawn = calloc((size_t)sources, sizeof(int32_t));
    if (deficit == NULL || drawn == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < segments; i++)
        choose_segment(chosen.buf, draw.buf, bound[i], bound[i + 1], weight + i * sources, deficit, drawn,
                       total, sources);
    Py_END_ALLOW_THREADS
    result = PyTuple_New(sources);
    for (int s = 0; result != NULL && s < sources; s++) {
        PyObject *count = PyLong_FromLong(drawn[s]);
        if (count == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyTuple_SET_ITEM(result, s, count);
    }
done:
    free(deficit);
    free(drawn);
    PyBuffer_Release(&chosen);
    PyBuffer_Release(&draw);
    PyBuffer_Release(&bounds);
    PyBuffer_Release(&weights);
    return result;
}

static PyMethodDef methods[] = {
    {"choose", mixture_choose, METH_VARARGS,
     "choose(chosen, draw, bounds, weights, total, sources): a mixture epoch's sources (NOTE [ Mixture order ])"},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mixture", NULL, -1, methods};

PyMODINIT_FUNC PyInit__mixture(void)
{
    return PyModule_Create(&module);
}
