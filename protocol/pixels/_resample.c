/*
 * Anti-aliased bilinear resize of 8-bit, 3-channel, row-major images: the arithmetic of torch's
 * uint8 CPU kernel for interpolate(mode="bilinear", antialias=True), which torchvision's resize
 * calls by default, without importing torch (about 130 MB per decode worker).
 *
 *   resize(src, height, width, dst, out_height, out_width, top=0, left=0, rows=out_height,
 *          cols=out_width)
 *
 * src holds height*width*3 bytes, dst rows*cols*3 (both C-contiguous HWC). The result
 * is computed as torch computes it (aten/src/ATen/native/cpu/UpSampleKernel.cpp and
 * UpSampleKernelAVXAntialias.h, themselves from Pillow-SIMD): per axis, a triangle filter
 * stretched by the scale when shrinking, its weights normalised in double precision, then
 * rounded to int16 at the largest precision that keeps the largest weight below 2^15; a
 * horizontal pass then a vertical pass, each summing in int32 from half a unit, shifting and
 * clamping to 0-255. (torch skips a pass whose side keeps its size; here its weights are then
 * 1 and 0, which gives the same bytes.) Integer sums do not depend on their order, so this code
 * gives torch's SIMD results exactly (tests compare them).
 *
 * Optional arguments top, left, rows, cols compute only that window of the output, each pixel
 * exactly as the whole resize has it: eval keeps only its centre crop (NOTE [ Eval regions ]).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHANNELS 3
#define MAX_SIDE (1 << 20) /* OpenCV decodes no wider image */

struct axis {
    int64_t *start; /* first source index of each output index */
    int64_t *size;  /* taps of each output index */
    int16_t *weight; /* taps * out weights, row-major by output index */
    int64_t taps;   /* the largest size, the weight table's stride */
    unsigned precision;
};

static void axis_free(struct axis *a)
{
    free(a->start);
    free(a->size);
    free(a->weight);
    a->start = NULL; /* safe to call again: a failed axis_make frees, and so does its caller */
    a->size = NULL;
    a->weight = NULL;
}

static double triangle(double x)
{
    x = fabs(x);
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* torch's _compute_indices_min_size_weights_aa with the bilinear filter, then its int16 rounding. */
static int axis_make(struct axis *a, int64_t in, int64_t out)
{
    double scale = (double)in / (double)out;
    double support = scale >= 1.0 ? scale : 1.0;
    double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
    int64_t taps = (int64_t)ceil(support) * 2 + 1;
    double *w = calloc((size_t)(out * taps), sizeof(double));
    a->start = malloc((size_t)out * sizeof(int64_t));
    a->size = malloc((size_t)out * sizeof(int64_t));
    a->weight = calloc((size_t)(out * taps), sizeof(int16_t));
    a->taps = taps;
    if (!w || !a->start || !a->size || !a->weight) {
        free(w);
        axis_free(a);
        return -1;
    }
    double max_weight = 0.0;
    for (int64_t i = 0; i < out; i++) {
        double center = scale * ((double)i + 0.5);
        int64_t lo = (int64_t)(center - support + 0.5);
        int64_t hi = (int64_t)(center + support + 0.5);
        lo = lo < 0 ? 0 : lo;
        hi = hi > in ? in : hi;
        int64_t n = hi - lo;
        if (n > taps)
            n = taps;
        double total = 0.0;
        for (int64_t j = 0; j < n; j++) {
            double v = triangle(((double)(j + lo) - center + 0.5) * invscale);
            w[i * taps + j] = v;
            total += v;
        }
        for (int64_t j = 0; j < n && total != 0.0; j++) {
            w[i * taps + j] /= total;
            if (w[i * taps + j] > max_weight)
                max_weight = w[i * taps + j];
        }
        a->start[i] = lo;
        a->size[i] = n;
    }
    unsigned precision = 0;
    for (; precision < 22; precision++) {
        int next = (int)(0.5 + max_weight * (double)(1 << (precision + 1)));
        if (next >= (1 << 15))
            break;
    }
    a->precision = precision;
    for (int64_t k = 0; k < out * taps; k++) {
        double v = w[k] * (double)(1 << precision);
        a->weight[k] = (int16_t)(v < 0 ? (int)(-0.5 + v) : (int)(0.5 + v));
    }
    free(w);
    return 0;
}

/* The vertical pass runs along contiguous rows, which compilers vectorise; AVX2 where the CPU has
 * it (chosen at load time), SSE2 otherwise. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static void vertical_line(const uint8_t *restrict src, int64_t line, const int64_t *restrict rows,
                          const int16_t *restrict k, int64_t n, unsigned shift, int32_t *restrict sum,
                          uint8_t *restrict o)
{
    const int32_t half = (int32_t)1 << (shift - 1);
    for (int64_t c = 0; c < line; c++)
        sum[c] = half;
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *restrict row = src + (rows[0] + j) * line;
        const int32_t kj = k[j];
        for (int64_t c = 0; c < line; c++)
            sum[c] += row[c] * kj;
    }
    for (int64_t c = 0; c < line; c++) {
        int32_t v = sum[c] >> shift;
        o[c] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
    }
}

/* Output lines [first, first + count) of axis ``a``, from lines of ``line`` bytes whose first one is
 * source line ``offset``. */
static int vertical(const uint8_t *src, int64_t line, const struct axis *a, int64_t first, int64_t count,
                    int64_t offset, uint8_t *dst)
{
    int32_t *sum = malloc((size_t)line * sizeof(int32_t));
    if (!sum)
        return -1;
    for (int64_t y = first; y < first + count; y++) {
        const int64_t at = a->start[y] - offset;
        vertical_line(src, line, &at, a->weight + y * a->taps, a->size[y], a->precision, sum,
                      dst + (y - first) * line);
    }
    free(sum);
    return 0;
}

/* (rows, cols, 3) with rows ``stride`` pixels apart -> (cols, rows, 3), in tiles that stay in cache. */
static void transpose(const uint8_t *restrict src, int64_t rows, int64_t cols, int64_t stride,
                      uint8_t *restrict dst)
{
    enum { TILE = 32 };
    for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
        const int64_t r1 = r0 + TILE < rows ? r0 + TILE : rows;
        for (int64_t c0 = 0; c0 < cols; c0 += TILE) {
            const int64_t c1 = c0 + TILE < cols ? c0 + TILE : cols;
            for (int64_t r = r0; r < r1; r++) {
                const uint8_t *restrict s = src + (r * stride + c0) * CHANNELS;
                for (int64_t c = c0; c < c1; c++, s += CHANNELS) {
                    uint8_t *restrict d = dst + (c * rows + r) * CHANNELS;
                    d[0] = s[0];
                    d[1] = s[1];
                    d[2] = s[2];
                }
            }
        }
    }
}

/* Source lines [lo, hi) that outputs [first, first + count) of axis ``a`` read. */
static void reach(const struct axis *a, int64_t first, int64_t count, int64_t *lo, int64_t *hi)
{
    *lo = a->start[first];
    *hi = *lo;
    for (int64_t i = first; i < first + count; i++) {
        if (a->start[i] < *lo)
            *lo = a->start[i];
        if (a->start[i] + a->size[i] > *hi)
            *hi = a->start[i] + a->size[i];
    }
}

/* Columns [left, left + cols) of the horizontal pass over ``rows`` rows of ``width`` pixels: done
 * as a vertical pass on the transposed block the window reads, the same sums in an order the
 * compiler vectorises (about twice as fast as summing taps pixel by pixel). */
static int horizontal(const uint8_t *src, int64_t rows, int64_t width, const struct axis *a, int64_t left,
                      int64_t cols, uint8_t *dst)
{
    int64_t lo, hi;
    reach(a, left, cols, &lo, &hi);
    uint8_t *across = malloc((size_t)((hi - lo) * rows * CHANNELS));
    uint8_t *resized = malloc((size_t)(cols * rows * CHANNELS));
    int status = -1;
    if (across && resized) {
        transpose(src + lo * CHANNELS, rows, hi - lo, width, across);
        status = vertical(across, rows * CHANNELS, a, left, cols, lo, resized);
        if (status == 0)
            transpose(resized, cols, rows, rows, dst);
    }
    free(across);
    free(resized);
    return status;
}

struct window {
    int64_t top, left, rows, cols;
};

/* Output pixels ``win`` of the (oh, ow) resize of (h, w): each one exactly what the whole resize
 * would hold there, since every output pixel is computed from its own taps alone. */
static int resize_into(const uint8_t *src, int64_t h, int64_t w, int64_t oh, int64_t ow, struct window win,
                       uint8_t *dst)
{
    if (h == oh && w == ow) { /* weights of 1 and 0: the window's own pixels */
        for (int64_t r = 0; r < win.rows; r++)
            memcpy(dst + r * win.cols * CHANNELS, src + ((win.top + r) * w + win.left) * CHANNELS,
                   (size_t)(win.cols * CHANNELS));
        return 0;
    }
    struct axis ax = {0}, ay = {0};
    uint8_t *middle = NULL;
    int status = -1;
    if (axis_make(&ax, w, ow) != 0 || axis_make(&ay, h, oh) != 0)
        goto done;
    int64_t lo, hi;
    reach(&ay, win.top, win.rows, &lo, &hi);
    middle = malloc((size_t)((hi - lo) * win.cols * CHANNELS));
    if (!middle)
        goto done;
    /* Horizontal first, as torch does (the order fixes where the intermediate is rounded). */
    status = horizontal(src + lo * w * CHANNELS, hi - lo, w, &ax, win.left, win.cols, middle);
    if (status == 0)
        status = vertical(middle, win.cols * CHANNELS, &ay, win.top, win.rows, lo, dst);
done:
    free(middle);
    axis_free(&ax);
    axis_free(&ay);
    return status;
}

static int sides_ok(Py_ssize_t a, Py_ssize_t b, Py_ssize_t c, Py_ssize_t d)
{
    return a >= 1 && b >= 1 && c >= 1 && d >= 1 && a <= MAX_SIDE && b <= MAX_SIDE && c <= MAX_SIDE &&
           d <= MAX_SIDE;
}

static PyObject *resample_resize(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer src, dst;
    Py_ssize_t h, w, oh, ow, top = 0, left = 0, rows = -1, cols = -1;
    if (!PyArg_ParseTuple(args, "y*nnw*nn|nnnn", &src, &h, &w, &dst, &oh, &ow, &top, &left, &rows, &cols))
        return NULL;
    rows = rows < 0 ? oh : rows;
    cols = cols < 0 ? ow : cols;
    PyObject *result = NULL;
    if (!sides_ok(h, w, oh, ow) || !sides_ok(rows, cols, 1, 1)) {
        PyErr_SetString(PyExc_ValueError, "sides must be between 1 and 1048576");
    } else if (top < 0 || left < 0 || top > oh - rows || left > ow - cols) {
        PyErr_SetString(PyExc_ValueError, "the window must lie inside the output");
    } else if (src.len != h * w * CHANNELS || dst.len != rows * cols * CHANNELS) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the sides given");
    } else {
        struct window win = {top, left, rows, cols};
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = resize_into((const uint8_t *)src.buf, h, w, oh, ow, win, (uint8_t *)dst.buf);
        Py_END_ALLOW_THREADS
        if (status != 0)
            PyErr_NoMemory();
        else
            result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"resize", resample_resize, METH_VARARGS,
     "resize(src, height, width, dst, out_height, out_width, top=0, left=0, rows=out_height, "
     "cols=out_width): the window of the anti-aliased bilinear resize, as torch's uint8 kernel"},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_resample", NULL, -1, methods};

PyMODINIT_FUNC PyInit__resample(void)
{
    return PyModule_Create(&module);
}
