/* CRC-32C (Castagnoli), as TFRecord frames its records with: the SSE4.2 instruction where the CPU
 * has it, else a table, eight bytes a step. The Python side masks it (tfrecord/crc.py). Optional:
 * without it, crc.py computes the same in Python, far slower. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static uint32_t table[8][256];

static void make_table(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++) table[t][n] = (table[t - 1][n] >> 8) ^ table[0][table[t - 1][n] & 0xFF];
}

static uint32_t by_table(uint32_t crc, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        uint32_t lo = (uint32_t)word ^ crc, hi = (uint32_t)(word >> 32);
        crc = table[7][lo & 0xFF] ^ table[6][(lo >> 8) & 0xFF] ^ table[5][(lo >> 16) & 0xFF] ^
              table[4][lo >> 24] ^ table[3][hi & 0xFF] ^ table[2][(hi >> 8) & 0xFF] ^
              table[1][(hi >> 16) & 0xFF] ^ table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xFF];
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_HARDWARE 1
__attribute__((target("sse4.2"))) static uint32_t by_hardware(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = __builtin_ia32_crc32di(c, word);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#endif

static int hardware = 0;

static PyObject *crc32c(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &data, &value)) return NULL;
    uint32_t crc = ~(uint32_t)value;
    const uint8_t *p = data.buf;
    size_t n = (size_t)data.len;
    Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_HARDWARE
    crc = hardware ? by_hardware(crc, p, n) : by_table(crc, p, n);
#else
    crc = by_table(crc, p, n);
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(~crc);
}

static PyMethodDef methods[] = {
    {"crc32c", crc32c, METH_VARARGS, "crc32c(data, value=0) -> the CRC-32C of data, continued from value."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_crc32c", NULL, -1, methods};

PyMODINIT_FUNC PyInit__crc32c(void) {
    make_table();
#ifdef HAVE_HARDWARE
    __builtin_cpu_init();
    hardware = __builtin_cpu_supports("sse4.2");
#endif
    return PyModule_Create(&module);
}
