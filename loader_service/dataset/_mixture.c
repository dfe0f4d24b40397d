/*
 * A mixture epoch's walk, position by position: the earliest-deadline rule of NOTE [ Mixture order ]
 * (loader_service/dataset/mixture.py), from any state, with the state every ``stride`` positions
 * kept as marks (NOTE [ Epoch marks ], loader_service/dataset/marks.py, whose ``_walk_here`` is the
 * reference and the fallback where this is not built). Same integers, same ties, so the same bytes
 * (a test compares the two on random schedules, marks and resumed windows included).
 *
 *   walk(chosen, draw, marks, stride, first, stop, bounds, weights, total, sources, deficit, drawn)
 *
 * Walks positions [first, stop) of an epoch. chosen: empty, or a writable buffer of uint16, one per
 * position walked, given each position's source; draw: empty, or a writable buffer of int32 given
 * each position's draw of its source in the epoch (0 for its first...); marks: empty, or a writable
 * int8 buffer of ceil(samples / stride) rows of ``sources``: at each position p walked that is a
 * multiple of stride, row p / stride is given floor(deficit / total) of each source, before p is
 * chosen; bounds: int64, segment i covers positions [bounds[i], bounds[i + 1]) (bounds[0] is 0, the
 * last entry the epoch's length, ``samples``); weights: int64, segments x sources, each segment's
 * weights already scaled to sum to total; deficit and drawn: writable int64, one per source, the
 * state at ``first`` (deficits in units of 1 / total, draws so far in the epoch), left as the
 * state at ``stop``.
 *
 * Bounds: a deficit stays within a few totals of 0 (within 2 once the rule runs; NOTE
 * [ Weightings ] measures 1.5 after changes), so with total < 2^44 and k <= 256 sources a deadline's
 * numerator, slack * (total - deficit), stays below 2^62 even for deficits of 100 totals, and two
 * of them multiplied fit __int128; a mark outside int8 is an error, never written. The caller sends
 * nothing else; this checks it again. The GIL is released while walking: a caller may walk in a
 * thread.
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

typedef struct {
    uint16_t *chosen;
    int32_t *draw;
    int8_t *marks;
    int64_t stride, first, stop, total;
    const int64_t *bound, *weight;
    int64_t *deficit, *drawn;
    Py_ssize_t segments;
    int sources;
} walk_t;

/* floor(deficit / total) of each source into row p / stride; 0 where one is outside int8. */
static int mark(const walk_t *w, int64_t p)
{
    int8_t *row = w->marks + (p / w->stride) * w->sources;
    for (int s = 0; s < w->sources; s++) {
        int64_t d = w->deficit[s], q = d / w->total;
        if (d % w->total != 0 && d < 0)
            q -= 1;
        if (q < INT8_MIN || q > INT8_MAX)
            return 0;
        row[s] = (int8_t)q;
    }
    return 1;
}

/* Returns 0 where a mark could not be kept (it stops there). */
static int run(const walk_t *w)
{
    const int64_t slack = 2 * (int64_t)w->sources - 2;
    Py_ssize_t i = 0;
    while (i + 1 < w->segments && w->first >= w->bound[i + 1])
        i++;
    for (int64_t j = w->first; j < w->stop; j++) {
        while (i + 1 < w->segments && j >= w->bound[i + 1])
            i++;
        if (w->marks != NULL && j % w->stride == 0 && !mark(w, j))
            return 0;
        const int64_t *weights = w->weight + i * w->sources;
        int best = -1;
        int64_t key_n = 0, key_d = 0;
        for (int s = 0; s < w->sources; s++) {
            int64_t before = w->deficit[s];
            w->deficit[s] += weights[s];
            if ((wide)w->deficit[s] * slack < w->total)
                continue; /* not eligible */
            int64_t mine_n = slack * (w->total - before) - w->total, mine_d = slack * weights[s];
            if (best < 0 || earlier(mine_n, mine_d, key_n, key_d)) {
                best = s;
                key_n = mine_n;
                key_d = mine_d;
            }
        }
        if (best < 0)
            return 0; /* no source eligible: the deficits were not a walk's (never from check()ed input) */
        w->deficit[best] -= w->total;
        if (w->chosen != NULL) {
            w->chosen[j - w->first] = (uint16_t)best;
            w->draw[j - w->first] = (int32_t)w->drawn[best];
        }
        w->drawn[best]++;
    }
    return 1;
}

static const char *check(const walk_t *w, Py_ssize_t chosen_len, Py_ssize_t draw_len, Py_ssize_t marks_len,
                         Py_ssize_t weights_len, Py_ssize_t deficit_len, Py_ssize_t drawn_len)
{
    if (w->sources < 2 || w->sources > MAX_SOURCES || w->total < 1 || w->total >= MAX_TOTAL || w->segments < 1)
        return "walk: sources, total or segments out of range";
    if (weights_len != w->segments * w->sources * (Py_ssize_t)sizeof(int64_t)
        || deficit_len != w->sources * (Py_ssize_t)sizeof(int64_t)
        || drawn_len != w->sources * (Py_ssize_t)sizeof(int64_t))
        return "walk: weights, deficit or drawn of the wrong length";
    if (w->bound[0] != 0)
        return "walk: the first segment must begin at 0";
    for (Py_ssize_t i = 0; i < w->segments; i++)
        if (w->bound[i] > w->bound[i + 1])
            return "walk: bounds must rise";
    int64_t samples = w->bound[w->segments];
    if (samples >= INT32_MAX || w->first < 0 || w->first > w->stop || w->stop > samples)
        return "walk: positions outside the epoch";
    int64_t walked = w->stop - w->first;
    if ((chosen_len != 0 || draw_len != 0)
        && (chosen_len != walked * (Py_ssize_t)sizeof(uint16_t) || draw_len != walked * (Py_ssize_t)sizeof(int32_t)))
        return "walk: chosen and draw must hold one entry per position walked";
    if (marks_len != 0 && (w->stride < 1 || marks_len < ((samples + w->stride - 1) / w->stride) * w->sources))
        return "walk: marks must hold a row for every stride positions of the epoch";
    return NULL;
}

static PyObject *mixture_walk(PyObject *self, PyObject *args)
{
    Py_buffer chosen, draw, marks, bounds, weights, deficit, drawn;
    long long stride, first, stop, total;
    int sources;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*w*w*LLLy*y*Liw*w*", &chosen, &draw, &marks, &stride, &first, &stop, &bounds,
                          &weights, &total, &sources, &deficit, &drawn))
        return NULL;
    PyObject *result = NULL;
    walk_t w = {
        .chosen = chosen.len ? chosen.buf : NULL,
        .draw = draw.len ? draw.buf : NULL,
        .marks = marks.len ? marks.buf : NULL,
        .stride = stride,
        .first = first,
        .stop = stop,
        .total = total,
        .bound = bounds.buf,
        .weight = weights.buf,
        .deficit = deficit.buf,
        .drawn = drawn.buf,
        .segments = bounds.len / (Py_ssize_t)sizeof(int64_t) - 1,
        .sources = sources,
    };
    const char *wrong = w.segments < 1 ? "walk: no segment"
                                       : check(&w, chosen.len, draw.len, marks.len, weights.len, deficit.len,
                                               drawn.len);
    if (wrong != NULL) {
        PyErr_SetString(PyExc_ValueError, wrong);
        goto done;
    }
    int kept;
    Py_BEGIN_ALLOW_THREADS
    kept = run(&w);
    Py_END_ALLOW_THREADS
    if (!kept) {
        PyErr_SetString(PyExc_ValueError, "walk: a deficit left int8 marks' range, or no source was eligible");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&chosen);
    PyBuffer_Release(&draw);
    PyBuffer_Release(&marks);
    PyBuffer_Release(&bounds);
    PyBuffer_Release(&weights);
    PyBuffer_Release(&deficit);
    PyBuffer_Release(&drawn);
    return result;
}

static PyMethodDef methods[] = {
    {"walk", mixture_walk, METH_VARARGS,
     "walk(chosen, draw, marks, stride, first, stop, bounds, weights, total, sources, deficit, drawn): "
     "a mixture epoch's positions [first, stop) (NOTE [ Mixture order ], NOTE [ Epoch marks ])"},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mixture", NULL, -1, methods};

PyMODINIT_FUNC PyInit__mixture(void)
{
    return PyModule_Create(&module);
}
