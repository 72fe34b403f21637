/* kvserve.kv_cache._block_keys.chain_keys: `block_keys.chain_keys` in one C call, same keys.

hashlib reaches SHA-256 through OpenSSL 3's EVP layer, whose set-up per call costs about 2.5
times the hashing of one block's ~200 bytes; a router hashes every block of every prompt, 512 for
an 8k-token one. This loop calls OpenSSL's one-context SHA-256 functions instead, from the
libcrypto that Python's own hashlib loads. They are declared here rather than taken from
<openssl/sha.h> so that building needs the library only; their context is opaque to this file
(112 bytes in OpenSSL 1.1 and 3).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

int SHA256_Init(void *ctx);
int SHA256_Update(void *ctx, const void *data, size_t len);
int SHA256_Final(unsigned char *md, void *ctx);

#define KEY_BYTES 32

/* One block's token ids as little-endian int64, as struct.pack("<q") writes them. */
static int pack_block(PyObject **items, Py_ssize_t count, unsigned char *out) {
    for (Py_ssize_t i = 0; i < count; i++) {
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) return -1;
        uint64_t u = (uint64_t)v;
        for (int b = 0; b < 8; b++) out[8 * i + b] = (unsigned char)(u >> (8 * b));
    }
    return 0;
}

static PyObject *chain_keys(PyObject *self, PyObject *args) {
    Py_buffer parent, extra;
    PyObject *token_ids;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "y*Ony*:chain_keys", &parent, &token_ids, &block_size, &extra)) return NULL;
    PyObject *seq = NULL, *keys = NULL;
    unsigned char *packed = NULL;
    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", block_size);
        goto done;
    }
    seq = PySequence_Fast(token_ids, "token_ids must be a sequence of ints");
    if (seq == NULL) goto done;
    Py_ssize_t num_blocks = PySequence_Fast_GET_SIZE(seq) / block_size;
    packed = PyMem_Malloc((size_t)block_size * 8);
    keys = PyList_New(num_blocks);
    if (packed == NULL || keys == NULL) {
        if (packed == NULL) PyErr_NoMemory();
        goto fail;
    }
    _Alignas(64) unsigned char ctx[256];
    const unsigned char *prev = parent.buf;
    size_t prev_len = (size_t)parent.len;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t b = 0; b < num_blocks; b++) {
        if (pack_block(items + b * block_size, block_size, packed) < 0) goto fail;
        PyObject *key = PyBytes_FromStringAndSize(NULL, KEY_BYTES);
        if (key == NULL) goto fail;
        unsigned char *digest = (unsigned char *)PyBytes_AS_STRING(key);
        SHA256_Init(ctx);
        SHA256_Update(ctx, prev, prev_len);
        SHA256_Update(ctx, extra.buf, (size_t)extra.len);
        SHA256_Update(ctx, packed, (size_t)block_size * 8);
        SHA256_Final(digest, ctx);
        PyList_SET_ITEM(keys, b, key);
        prev = digest;
        prev_len = KEY_BYTES;
    }
    goto done;
fail:
    Py_CLEAR(keys);
done:
    PyMem_Free(packed);
    Py_XDECREF(seq);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&extra);
    return keys;
}

static PyMethodDef methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(parent, token_ids, block_size, extra_key) -> list[bytes]: the chained SHA-256 keys "
     "of the full blocks of token_ids, as kvserve.kv_cache.block_keys computes them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_keys", NULL, -1, methods};

PyMODINIT_FUNC PyInit__block_keys(void) { return PyModule_Create(&module); }
