/*
 * Anti-aliased bilinear resize of 8-bit, 3-channel, row-major images: the arithmetic of torch's
 * uint8 CPU kernel for interpolate(mode="bilinear", antialias=True), which torchvision's resize
 * calls by default, without importing torch (about 130 MB per decode worker).
 *
 *   resize(src, height, width, dst, out_height, out_width)
 *
 * src holds height*width*3 bytes, dst out_height*out_width*3 (both C-contiguous HWC). The result
 * is computed as torch computes it (aten/src/ATen/native/cpu/UpSampleKernel.cpp and
 * UpSampleKernelAVXAntialias.h, themselves from Pillow-SIMD): per axis, a triangle filter
 * stretched by the scale when shrinking, its weights normalised in double precision, then
 * rounded to int16 at the largest precision that keeps the largest weight below 2^15; a
 * horizontal pass then a vertical pass (either skipped when that side keeps its size), each
 * summing in int32 from half a unit, shifting and clamping to 0-255. Integer sums do not depend
 * on their order, so this scalar code gives torch's SIMD results exactly (tests compare them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHANNELS 3
#define MAX_SIDE (1 << 16)

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

static inline uint8_t clamp8(int32_t v, unsigned shift)
{
    v >>= shift;
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

static void horizontal(const uint8_t *src, int64_t rows, int64_t in_w, const struct axis *a,
                       int64_t out_w, uint8_t *dst)
{
    const int32_t half = (int32_t)1 << (a->precision - 1);
    for (int64_t y = 0; y < rows; y++) {
        const uint8_t *row = src + y * in_w * CHANNELS;
        uint8_t *o = dst + y * out_w * CHANNELS;
        for (int64_t x = 0; x < out_w; x++) {
            const int16_t *k = a->weight + x * a->taps;
            const uint8_t *p = row + a->start[x] * CHANNELS;
            int32_t s0 = half, s1 = half, s2 = half;
            for (int64_t j = 0; j < a->size[x]; j++, p += CHANNELS) {
                s0 += p[0] * k[j];
                s1 += p[1] * k[j];
                s2 += p[2] * k[j];
            }
            o[x * CHANNELS + 0] = clamp8(s0, a->precision);
            o[x * CHANNELS + 1] = clamp8(s1, a->precision);
            o[x * CHANNELS + 2] = clamp8(s2, a->precision);
        }
    }
}

static void vertical(const uint8_t *src, int64_t width, const struct axis *a, int64_t out_h,
                     uint8_t *dst)
{
    const int32_t half = (int32_t)1 << (a->precision - 1);
    const int64_t line = width * CHANNELS;
    int32_t *sum = malloc((size_t)line * sizeof(int32_t));
    if (!sum)
        return;
    for (int64_t y = 0; y < out_h; y++) {
        const int16_t *k = a->weight + y * a->taps;
        for (int64_t c = 0; c < line; c++)
            sum[c] = half;
        for (int64_t j = 0; j < a->size[y]; j++) {
            const uint8_t *row = src + (a->start[y] + j) * line;
            const int32_t kj = k[j];
            for (int64_t c = 0; c < line; c++)
                sum[c] += row[c] * kj;
        }
        uint8_t *o = dst + y * line;
        for (int64_t c = 0; c < line; c++)
            o[c] = clamp8(sum[c], a->precision);
    }
    free(sum);
}

static int resize_into(const uint8_t *src, int64_t h, int64_t w, uint8_t *dst, int64_t oh, int64_t ow)
{
    if (h == oh && w == ow) {
        memcpy(dst, src, (size_t)(h * w * CHANNELS));
        return 0;
    }
    struct axis ax = {0}, ay = {0};
    uint8_t *middle = NULL;
    int status = -1;
    if (w != ow && axis_make(&ax, w, ow) != 0)
        goto done;
    if (h != oh && axis_make(&ay, h, oh) != 0)
        goto done;
    if (w == ow) {
        vertical(src, w, &ay, oh, dst);
    } else if (h == oh) {
        horizontal(src, h, w, &ax, ow, dst);
    } else {
        middle = malloc((size_t)(h * ow * CHANNELS));
        if (!middle)
            goto done;
        horizontal(src, h, w, &ax, ow, middle);
        vertical(middle, ow, &ay, oh, dst);
    }
    status = 0;
done:
    free(middle);
    axis_free(&ax);
    axis_free(&ay);
    return status;
}

static PyObject *resample_resize(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer src, dst;
    Py_ssize_t h, w, oh, ow;
    if (!PyArg_ParseTuple(args, "y*nnw*nn", &src, &h, &w, &dst, &oh, &ow))
        return NULL;
    PyObject *result = NULL;
    if (h < 1 || w < 1 || oh < 1 || ow < 1 || h > MAX_SIDE || w > MAX_SIDE || oh > MAX_SIDE || ow > MAX_SIDE) {
        PyErr_SetString(PyExc_ValueError, "sides must be between 1 and 65536");
    } else if (src.len != h * w * CHANNELS || dst.len != oh * ow * CHANNELS) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the sides given");
    } else {
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = resize_into((const uint8_t *)src.buf, h, w, (uint8_t *)dst.buf, oh, ow);
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
     "resize(src, height, width, dst, out_height, out_width): anti-aliased bilinear, as torch's uint8 kernel"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_resample", NULL, -1, methods};

PyMODINIT_FUNC PyInit__resample(void)
{
    return PyModule_Create(&module);
}
