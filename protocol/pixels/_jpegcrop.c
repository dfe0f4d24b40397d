/*
 * Region-of-interest JPEG decoding with libjpeg-turbo, for the train transform's random crop.
 *
 * RandomResizedCrop keeps about half of an image on average, yet a full decode pays the inverse
 * DCT, upsampling and colour conversion for every pixel. libjpeg-turbo (>= 1.5) can skip whole
 * rows (jpeg_skip_scanlines: rows above the crop are only entropy-decoded, rows below are never
 * read) and restrict the inverse DCT to the crop's columns (jpeg_crop_scanline), and it can scale
 * by 1/2, 1/4 or 1/8 inside the inverse DCT. This module exposes exactly that and nothing more:
 *
 *   header(data) -> (height, width, orientation, usable)
 *   decode(data, top, left, height, width, num) -> (pixels, rows, row_width, skip)
 *
 * decode returns the BGR rows of the region, scaled by num/8, in a bytearray: rows from
 * floor(top * num / 8) to ceil((top + height) * num / 8), each of row_width pixels, of which the
 * region's columns (from floor(left * num / 8) to ceil((left + width) * num / 8)) start at `skip`:
 * libjpeg-turbo widens a cropped row to the left, to an iMCU boundary. Only num 8, 4, 2 and 1 run
 * on libjpeg-turbo's SIMD inverse DCTs; other scales are slow and are not used by the service.
 * Decoding settings match OpenCV's (integer slow DCT, fancy upsampling), so at num 8 the pixels
 * equal cv2.imdecode's inside the region, up to libjpeg-turbo version differences.
 *
 * Errors never call exit(): libjpeg's error_exit longjmps back here and becomes a ValueError.
 * Warnings (corrupt but recoverable data) are ignored, as OpenCV ignores them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

/* The caller's pixel limit normally applies first; this only keeps the function safe on its own. */
#define MAX_REGION_BYTES ((uint64_t)1 << 31)

struct error_mgr {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo)
{
    struct error_mgr *err = (struct error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level)
{
    (void)cinfo;
    (void)level;
}

/* EXIF orientation (tag 0x0112 of IFD0) from a saved APP1 marker; 1 when absent or unreadable. */
static int exif_orientation(const JOCTET *p, unsigned int n)
{
    if (n < 14 || memcmp(p, "Exif\0\0", 6) != 0)
        return 1;
    const JOCTET *t = p + 6;
    uint64_t len = n - 6;
    int little;
    if (t[0] == 'I' && t[1] == 'I')
        little = 1;
    else if (t[0] == 'M' && t[1] == 'M')
        little = 0;
    else
        return 1;
#define U16(q) (little ? (unsigned int)((q)[0] | ((q)[1] << 8)) : (unsigned int)(((q)[0] << 8) | (q)[1]))
#define U32(q) (little ? ((uint64_t)(q)[0] | ((uint64_t)(q)[1] << 8) | ((uint64_t)(q)[2] << 16) | ((uint64_t)(q)[3] << 24)) \
                       : (((uint64_t)(q)[0] << 24) | ((uint64_t)(q)[1] << 16) | ((uint64_t)(q)[2] << 8) | (uint64_t)(q)[3]))
    uint64_t ifd = U32(t + 4);
    if (ifd + 2 > len)
        return 1;
    unsigned int entries = U16(t + ifd);
    for (unsigned int i = 0; i < entries; i++) {
        uint64_t at = ifd + 2 + 12u * (uint64_t)i;
        if (at + 12 > len)
            return 1;
        if (U16(t + at) == 0x0112) {
            unsigned int value = U16(t + at + 8);
            return (value >= 1 && value <= 8) ? (int)value : 1;
        }
    }
#undef U16
#undef U32
    return 1;
}

struct session {
    struct jpeg_decompress_struct cinfo;
    struct error_mgr err;
};

/* Set up the error manager and read the header. The caller has called setjmp on s->err.jump. */
static void begin(struct session *s, const Py_buffer *data, int save_app1)
{
    s->cinfo.err = jpeg_std_error(&s->err.pub);
    s->err.pub.error_exit = on_error;
    s->err.pub.emit_message = on_message;
    s->err.message[0] = '\0';
    jpeg_create_decompress(&s->cinfo);
    jpeg_mem_src(&s->cinfo, (const unsigned char *)data->buf, (unsigned long)data->len);
    if (save_app1)
        jpeg_save_markers(&s->cinfo, JPEG_APP0 + 1, 0xFFFF);
    jpeg_read_header(&s->cinfo, TRUE);
}

static PyObject *fail(struct session *s)
{
    PyErr_Format(PyExc_ValueError, "jpeg: %s", s->err.message[0] ? s->err.message : "decode failed");
    jpeg_destroy_decompress(&s->cinfo);
    return NULL;
}

static PyObject *header(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*:header", &data))
        return NULL;
    struct session s;
    memset(&s, 0, sizeof s);
    /* NOTE: setjmp must run in the frame that stays alive while libjpeg may longjmp. */
    if (setjmp(s.err.jump)) {
        PyBuffer_Release(&data);
        return fail(&s);
    }
    begin(&s, &data, 1);
    /* OpenCV looks at every APP1 (XMP may come first, or a second EXIF block may carry the tag):
     * any rotation anywhere sends the file to OpenCV. */
    int orientation = 1;
    for (jpeg_saved_marker_ptr m = s.cinfo.marker_list; m != NULL && orientation == 1; m = m->next) {
        if (m->marker == JPEG_APP0 + 1)
            orientation = exif_orientation(m->data, m->data_length);
    }
    /* Only YCbCr and greyscale (and plain RGB) convert to BGR in libjpeg-turbo; CMYK/YCCK do not. */
    J_COLOR_SPACE cs = s.cinfo.jpeg_color_space;
    int usable = (cs == JCS_YCbCr || cs == JCS_GRAYSCALE || cs == JCS_RGB) &&
                 s.cinfo.data_precision == 8;
    PyObject *result = Py_BuildValue("(IIii)", s.cinfo.image_height, s.cinfo.image_width,
                                     orientation, usable);
    jpeg_destroy_decompress(&s.cinfo);
    PyBuffer_Release(&data);
    return result;
}

static PyObject *decode(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer data;
    Py_ssize_t args_in[5];
    if (!PyArg_ParseTuple(args, "y*nnnnn:decode", &data, &args_in[0], &args_in[1], &args_in[2],
                          &args_in[3], &args_in[4]))
        return NULL;
    for (int i = 0; i < 4; i++) {
        if (args_in[i] < 0 || args_in[i] > JPEG_MAX_DIMENSION) {
            PyBuffer_Release(&data);
            PyErr_SetString(PyExc_ValueError, "region outside the image");
            return NULL;
        }
    }
    if (args_in[4] < 1 || args_in[4] > 8) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "scale must be 1/8 to 8/8");
        return NULL;
    }
    const unsigned int top = (unsigned int)args_in[0], left = (unsigned int)args_in[1];
    const unsigned int height = (unsigned int)args_in[2], width = (unsigned int)args_in[3];
    const unsigned int num = (unsigned int)args_in[4];
    struct session s;
    memset(&s, 0, sizeof s);
    PyObject *volatile out = NULL;
    if (setjmp(s.err.jump)) {
        Py_XDECREF(out);
        PyBuffer_Release(&data);
        return fail(&s);
    }
    begin(&s, &data, 0);
    if (height == 0 || width == 0 || (uint64_t)top + height > s.cinfo.image_height ||
        (uint64_t)left + width > s.cinfo.image_width) {
        jpeg_destroy_decompress(&s.cinfo);
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "region outside the image");
        return NULL;
    }
    s.cinfo.out_color_space = JCS_EXT_BGR;
    s.cinfo.dct_method = JDCT_ISLOW;
    s.cinfo.do_fancy_upsampling = TRUE;
    s.cinfo.scale_num = num;
    s.cinfo.scale_denom = 8;
    jpeg_start_decompress(&s.cinfo);

    /* The region in output (scaled) pixels: floor of its start, ceiling of its end. */
    JDIMENSION y0 = (JDIMENSION)((uint64_t)top * num / 8);
    JDIMENSION x0 = (JDIMENSION)((uint64_t)left * num / 8);
    JDIMENSION y1 = (JDIMENSION)((((uint64_t)top + height) * num + 7) / 8);
    JDIMENSION x1 = (JDIMENSION)((((uint64_t)left + width) * num + 7) / 8);
    if (y1 > s.cinfo.output_height)
        y1 = s.cinfo.output_height;
    if (x1 > s.cinfo.output_width)
        x1 = s.cinfo.output_width;
    /* A cropped row ends like an image edge, so fancy upsampling would replicate chroma there
     * instead of interpolating; asking for two more columns on the right and one on the left gives
     * the region's own edge columns their neighbours, and so OpenCV's pixels. */
    JDIMENSION pad = 1;
    if (s.cinfo.progressive_mode) {
        /* Block smoothing (progressive files with missing coefficients) reads neighbouring
         * blocks, and a cropped row's left edge looks like the image edge to it. */
        pad += 2u * (JDIMENSION)(s.cinfo.max_h_samp_factor * s.cinfo.min_DCT_scaled_size);
    }
    JDIMENSION xoff = x0 > pad ? x0 - pad : 0;
    JDIMENSION xend = x1 + 2 < s.cinfo.output_width ? x1 + 2 : s.cinfo.output_width;
    JDIMENSION cols = xend - xoff;
    if (cols < s.cinfo.output_width)
        jpeg_crop_scanline(&s.cinfo, &xoff, &cols);
    else
        xoff = 0;
    JDIMENSION rows = y1 - y0;
    /* jpeg_crop_scanline has narrowed output_width to the widened region. */
    size_t row_bytes = (size_t)s.cinfo.output_width * 3;
    if ((uint64_t)row_bytes * rows > MAX_REGION_BYTES) {
        jpeg_destroy_decompress(&s.cinfo);
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "region too large");
        return NULL;
    }
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(row_bytes * rows));
    if (out == NULL) {
        jpeg_destroy_decompress(&s.cinfo);
        PyBuffer_Release(&data);
        return NULL;
    }
    JSAMPLE *const pixels = (JSAMPLE *)PyByteArray_AS_STRING(out);
    /* NOTE: a longjmp must not leave the GIL released, so the decode loop has its own landing
     * point inside the released section and reports failure through a flag. */
    volatile int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(s.err.jump)) {
        failed = 1;
    } else {
        if (y0 > 0)
            jpeg_skip_scanlines(&s.cinfo, y0);
        while (s.cinfo.output_scanline < y1) {
            JSAMPROW row = pixels + row_bytes * (s.cinfo.output_scanline - y0);
            jpeg_read_scanlines(&s.cinfo, &row, 1);
        }
    }
    Py_END_ALLOW_THREADS
    /* Re-arm before any more libjpeg calls: the landing point above is inside the released
     * section, and a longjmp to it now would run Py_END_ALLOW_THREADS again with the GIL held.
     * C allows setjmp only as a whole condition (not as an operand of ||), so the earlier failure
     * and a later one meet in the flag instead. */
    if (!failed) {
        if (setjmp(s.err.jump))
            failed = 1;
    }
    if (failed) {
        Py_DECREF(out);
        PyBuffer_Release(&data);
        return fail(&s);
    }
    JDIMENSION row_width = s.cinfo.output_width;
    jpeg_abort_decompress(&s.cinfo);
    jpeg_destroy_decompress(&s.cinfo);
    PyBuffer_Release(&data);
    PyObject *result = Py_BuildValue("(OIII)", out, rows, row_width, x0 - xoff);
    Py_DECREF(out);
    return result;
}

static PyMethodDef methods[] = {
    {"header", header, METH_VARARGS, "header(data) -> (height, width, exif_orientation, usable)"},
    {"decode", decode, METH_VARARGS,
     "decode(data, top, left, height, width, num) -> (bgr_bytes, rows, row_width, skip)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpegcrop", "Region-of-interest JPEG decoding (libjpeg-turbo).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jpegcrop(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
#ifdef LIBJPEG_TURBO_VERSION_NUMBER
    /* e.g. 2001005 for 2.1.5: the headers this module was built against. */
    if (PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION_NUMBER", LIBJPEG_TURBO_VERSION_NUMBER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
