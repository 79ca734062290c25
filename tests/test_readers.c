/* File readers fed hostile files: IDX datasets (src/data/idx.c: ag_load_idx and the
 * Fashion-MNIST loader) and safetensors module state (src/nn/safetensors.c: ag_module_load).
 *
 * Every file is written by the test itself into a fresh temporary directory, byte by byte
 * from the format's description (IDX: big-endian magic 0x00 0x00 TYPE NDIM, one 32-bit size
 * per dimension, then the data; safetensors: an 8-byte little-endian header length, a JSON
 * header, then the data, which the entries' data_offsets must tile exactly). Expected values
 * come from the bytes written, never from the reader. Covered: valid files (raw and gzip),
 * then each way a file can be wrong, which must give an error naming the file and the
 * problem, never a crash, an allocation sized by a lie in the header, or a partial load. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "testutil.h"

/* ---- a temporary directory ---- */

static char tmpdir[64];

static const char *tmp_path(const char *name) {
    static char buf[4][256];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, sizeof buf[0], "%s/%s", tmpdir, name);
    return p;
}

static void write_raw(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static void write_gz(const char *path, const void *data, size_t n) {
    gzFile f = gzopen(path, "wb");
    assert_non_null(f);
    if (n)
        assert_int_equal(gzwrite(f, data, (unsigned)n), (int)n);
    assert_int_equal(gzclose(f), Z_OK);
}

static unsigned char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long sz = ftell(f);
    assert_true(sz >= 0);
    rewind(f);
    unsigned char *b = malloc((size_t)sz + 1);
    assert_int_equal(fread(b, 1, (size_t)sz, f), (size_t)sz);
    fclose(f);
    *n = (size_t)sz;
    return b;
}

/* ---- IDX ---- */

/* An IDX file image: magic 0 0 type nd, the sizes big-endian, then ndata data bytes (data may
 * be NULL: bytes i % 251). Returns a malloc'd buffer of *n bytes. */
static unsigned char *idx_image(unsigned char type, int nd, const uint32_t *sizes,
                                const unsigned char *data, size_t ndata, size_t *n) {
    *n = 4 + 4 * (size_t)nd + ndata;
    unsigned char *b = malloc(*n + 1);
    b[0] = 0, b[1] = 0, b[2] = type, b[3] = (unsigned char)nd;
    for (int d = 0; d < nd; d++)
        for (int k = 0; k < 4; k++)
            b[4 + 4 * d + k] = (unsigned char)(sizes[d] >> (24 - 8 * k));
    for (size_t i = 0; i < ndata; i++)
        b[4 + 4 * nd + i] = data ? data[i] : (unsigned char)(i % 251);
    return b;
}

static void write_idx(const char *path, bool gz, int nd, const uint32_t *sizes,
                      const unsigned char *data, size_t ndata) {
    size_t n;
    unsigned char *b = idx_image(0x08, nd, sizes, data, ndata, &n);
    if (gz)
        write_gz(path, b, n);
    else
        write_raw(path, b, n);
    free(b);
}

static void test_idx_valid(void **state) {
    (void)state;
    unsigned char px[12] = {0, 255, 1, 2, 3, 4, 5, 6, 7, 8, 9, 128};
    for (int gz = 0; gz < 2; gz++) {
        const char *p = tmp_path(gz ? "ok.idx.gz" : "ok.idx");
        write_idx(p, gz, 3, (uint32_t[]){3, 2, 2}, px, 12);
        ag_tensor *f = ag_load_idx(p, true, 0.5);
        assert_non_null(f);
        assert_int_equal(ag_tensor_dtype(f), AG_F32);
        double want[12];
        for (int i = 0; i < 12; i++)
            want[i] = px[i] * 0.5;
        tu_assert_values(f, 3, (int64_t[]){3, 2, 2}, want, 0);
        ag_tensor_free(f);
        ag_tensor *l = ag_load_idx(p, false, 1.0);
        assert_non_null(l);
        assert_int_equal(ag_tensor_dtype(l), AG_I64);
        for (int i = 0; i < 12; i++)
            want[i] = px[i];
        tu_assert_values(l, 3, (int64_t[]){3, 2, 2}, want, 0);
        ag_tensor_free(l);
        unlink(p);
    }
    /* An empty dataset (0 images) is a valid file. */
    const char *p = tmp_path("empty.idx");
    write_idx(p, false, 3, (uint32_t[]){0, 28, 28}, NULL, 0);
    ag_tensor *e = ag_load_idx(p, true, 1.0);
    assert_non_null(e);
    tu_assert_shape(e, 3, (int64_t[]){0, 28, 28});
    ag_tensor_free(e);
    unlink(p);
}

/* ag_load_idx on `path` fails with `code` and a message holding the path and `needle`. */
static void idx_refused(const char *path, int code, const char *needle) {
    ag_tensor *t = ag_load_idx(path, true, 1.0);
    if (t)
        fail_msg("%s loaded; expected an error with '%s'", path, needle);
    assert_int_equal(ag_last_status(), code);
    tu_assert_error_contains(path);
    tu_assert_error_contains(needle);
}

static void test_idx_bad_files(void **state) {
    (void)state;
    const char *p = tmp_path("bad.idx");
    size_t n;
    unsigned char *b;

    /* Missing file: errno's words. */
    idx_refused(tmp_path("nonexistent.idx"), AG_EIO, "No such file");
    /* Empty, and shorter than the magic. */
    write_raw(p, "", 0);
    idx_refused(p, AG_EFORMAT, "bad magic");
    write_raw(p, "\0\0", 2);
    idx_refused(p, AG_EFORMAT, "bad magic");
    /* Wrong magic: a text file, a nonzero first byte. */
    write_raw(p, "hello world\n", 12);
    idx_refused(p, AG_EFORMAT, "bad magic");
    b = idx_image(0x08, 1, (uint32_t[]){2}, NULL, 2, &n);
    b[1] = 1;
    write_raw(p, b, n);
    idx_refused(p, AG_EFORMAT, "bad magic");
    free(b);
    /* Element types IDX has but the reader does not (0x0D float), and one IDX lacks. */
    b = idx_image(0x0D, 1, (uint32_t[]){2}, NULL, 8, &n);
    write_raw(p, b, n);
    idx_refused(p, AG_ENOTSUP, "element type 0x0d");
    free(b);
    b = idx_image(0x42, 1, (uint32_t[]){2}, NULL, 2, &n);
    write_raw(p, b, n);
    idx_refused(p, AG_ENOTSUP, "element type 0x42");
    free(b);
    /* No dimensions, more than AG_MAX_DIMS, 255. */
    b = idx_image(0x08, 0, NULL, NULL, 1, &n);
    write_raw(p, b, n);
    idx_refused(p, AG_EFORMAT, "0 dimensions");
    free(b);
    uint32_t ones[255];
    for (int i = 0; i < 255; i++)
        ones[i] = 1;
    b = idx_image(0x08, AG_MAX_DIMS + 1, ones, NULL, 1, &n);
    write_raw(p, b, n);
    idx_refused(p, AG_EFORMAT, "9 dimensions");
    free(b);
    b = idx_image(0x08, 255, ones, NULL, 1, &n);
    write_raw(p, b, n);
    idx_refused(p, AG_EFORMAT, "255 dimensions");
    free(b);
    /* The header cut inside the sizes. */
    b = idx_image(0x08, 3, (uint32_t[]){2, 2, 2}, NULL, 8, &n);
    write_raw(p, b, 10);
    idx_refused(p, AG_EFORMAT, "truncated header");
    /* Data cut short, at every length: the message counts the bytes. */
    for (size_t k = 16; k < n; k++) {
        write_raw(p, b, k);
        char want[64];
        snprintf(want, sizeof want, "%zu of 8 data bytes", k - 16);
        idx_refused(p, AG_EFORMAT, want);
    }
    /* Bytes after the data the header describes (torchvision refuses these too). */
    write_raw(p, b, n);
    ag_tensor *ok = ag_load_idx(p, true, 1.0);
    assert_non_null(ok);
    ag_tensor_free(ok);
    unsigned char *longer = malloc(n + 3);
    memcpy(longer, b, n);
    memcpy(longer + n, "abc", 3);
    write_raw(p, longer, n + 3);
    idx_refused(p, AG_EFORMAT, "more than the 8 data bytes");
    free(longer);
    free(b);
    unlink(p);
}

/* Sizes whose product no file backs: the reader must not allocate what the header claims
 * before the data is there (a 2^40-byte allocation fails outright, or aborts under ASan). */
static void test_idx_huge_sizes(void **state) {
    (void)state;
    const char *p = tmp_path("huge.idx");
    for (int gz = 0; gz < 2; gz++) {
        /* 2^40 bytes claimed, 5 present. */
        write_idx(p, gz, 2, (uint32_t[]){1u << 20, 1u << 20}, NULL, 5);
        idx_refused(p, AG_EFORMAT, "5 of 1099511627776 data bytes");
        /* Products beyond 2^40 and beyond 64 bits are implausible before any data is read. */
        write_idx(p, gz, 3, (uint32_t[]){0xffffffffu, 0xffffffffu, 0xffffffffu}, NULL, 5);
        idx_refused(p, AG_EFORMAT, "implausible");
        write_idx(p, gz, 4, (uint32_t[]){0, 0xffffffffu, 0xffffffffu, 0xffffffffu}, NULL, 0);
        idx_refused(p, AG_EFORMAT, "implausible");
    }
    unlink(p);
}

static void test_idx_gzip_errors(void **state) {
    (void)state;
    const char *p = tmp_path("bad.idx.gz");
    size_t n;
    unsigned char px[64];
    for (int i = 0; i < 64; i++)
        px[i] = (unsigned char)(i * 7);
    write_idx(p, true, 2, (uint32_t[]){8, 8}, px, 64);
    unsigned char *gz = read_all(p, &n);
    /* The gzip trailer's CRC-32 (bytes n-8..n-5) flipped: the data decompresses, the check
     * fails. */
    unsigned char *bad = malloc(n);
    memcpy(bad, gz, n);
    bad[n - 8] ^= 0xff;
    write_raw(p, bad, n);
    idx_refused(p, AG_EFORMAT, "gzip");
    /* The trailer's length field wrong. */
    memcpy(bad, gz, n);
    bad[n - 4] ^= 0x01;
    write_raw(p, bad, n);
    idx_refused(p, AG_EFORMAT, "gzip");
    /* Cut inside the compressed stream and inside the trailer. */
    for (size_t k = 11; k < n; k++) {
        write_raw(p, gz, k);
        ag_tensor *t = ag_load_idx(p, true, 1.0);
        if (t)
            fail_msg("a gzip file cut at %zu of %zu bytes loaded", k, n);
        assert_int_equal(ag_last_status(), AG_EFORMAT);
        tu_assert_error_contains(p);
    }
    /* Garbage after the gzip header: a corrupt deflate stream. */
    memcpy(bad, gz, n);
    for (size_t k = 10; k < n - 8; k++)
        bad[k] = 0xff;
    write_raw(p, bad, n);
    idx_refused(p, AG_EFORMAT, "gzip");
    free(bad);
    free(gz);
    unlink(p);
}

/* ---- Fashion-MNIST ---- */

/* Writes dir/<split>-images-idx3-ubyte.gz with n images of h x w and dir/<split>-labels-...
 * with the given labels. */
static void write_fashion(const char *split, uint32_t n, uint32_t h, uint32_t w,
                          const unsigned char *labels, uint32_t nlab) {
    char ip[256], lp[256];
    snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte.gz", tmpdir, split);
    snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte.gz", tmpdir, split);
    write_idx(ip, true, 3, (uint32_t[]){n, h, w}, NULL, (size_t)n * h * w);
    write_idx(lp, true, 1, (uint32_t[]){nlab}, labels, nlab);
}

static void remove_fashion(const char *split) {
    char p[256];
    snprintf(p, sizeof p, "%s/%s-images-idx3-ubyte.gz", tmpdir, split);
    unlink(p);
    snprintf(p, sizeof p, "%s/%s-labels-idx1-ubyte.gz", tmpdir, split);
    unlink(p);
}

static void fashion_refused(bool train, const char *needle, const char *needle2) {
    ag_tensor *im = (ag_tensor *)1, *lb = (ag_tensor *)1;
    assert_int_equal(ag_fashion_mnist_load(tmpdir, train, &im, &lb), AG_EFORMAT);
    assert_null(im);
    assert_null(lb);
    tu_assert_error_contains(needle);
    if (needle2)
        tu_assert_error_contains(needle2);
}

static void test_fashion_mnist(void **state) {
    (void)state;
    /* A valid test split: 3 images of 28 x 28, labels 0..9. */
    write_fashion("t10k", 3, 28, 28, (unsigned char[]){9, 0, 3}, 3);
    ag_tensor *im = NULL, *lb = NULL;
    assert_int_equal(ag_fashion_mnist_load(tmpdir, false, &im, &lb), 0);
    tu_assert_shape(im, 4, (int64_t[]){3, 1, 28, 28});
    tu_assert_values(lb, 1, (int64_t[]){3}, (double[]){9, 0, 3}, 0);
    /* Pixel k of the file is k % 251; normalized as (x / 255 - 0.2860) / 0.3530. */
    const float *px = ag_tensor_data(im);
    for (int k = 0; k < 3 * 28 * 28; k += 97)
        tu_assert_near(px[k], ((k % 251) / 255.0 - 0.2860) / 0.3530, 1e-5, "pixel", k);
    ag_tensor_free(im);
    ag_tensor_free(lb);

    /* Images and labels that disagree on the count: the message names both files and both
     * counts (it used to read the tensors it had just freed). */
    write_fashion("train", 4, 28, 28, (unsigned char[]){1, 2, 3}, 3);
    fashion_refused(true, "train-images-idx3-ubyte.gz", "images 4x28x28, labels 3");
    tu_assert_error_contains("train-labels-idx1-ubyte.gz");
    /* Images that are not (N, H, W): a 1-d images file. */
    char ip[256];
    snprintf(ip, sizeof ip, "%s/train-images-idx3-ubyte.gz", tmpdir);
    write_idx(ip, true, 1, (uint32_t[]){3}, NULL, 3);
    fashion_refused(true, "train-images-idx3-ubyte.gz", "[3]");
    /* Labels that are not 1-d. */
    write_fashion("train", 2, 28, 28, NULL, 0);
    char lp[256];
    snprintf(lp, sizeof lp, "%s/train-labels-idx1-ubyte.gz", tmpdir);
    write_idx(lp, true, 2, (uint32_t[]){2, 1}, (unsigned char[]){1, 2}, 2);
    fashion_refused(true, "train-labels-idx1-ubyte.gz", "[2, 1]");
    /* A label that is not one of the 10 classes. */
    write_fashion("train", 3, 28, 28, (unsigned char[]){1, 10, 3}, 3);
    fashion_refused(true, "train-labels-idx1-ubyte.gz", "label 10 at index 1");
    /* A missing labels file: the images are read, then released. */
    write_fashion("train", 2, 28, 28, (unsigned char[]){1, 2}, 2);
    unlink(lp);
    assert_int_equal(ag_fashion_mnist_load(tmpdir, true, &im, &lb), AG_EIO);
    tu_assert_error_contains(lp);
    /* Inside an autorelease scope the same failures leave nothing behind either. */
    write_fashion("train", 4, 28, 28, (unsigned char[]){1, 2, 3}, 3);
    ag_scope_begin();
    fashion_refused(true, "images 4x28x28, labels 3", NULL);
    ag_scope_end();
    remove_fashion("train");
    remove_fashion("t10k");
}

/* Every allocation of a load failing in turn: AG_ENOMEM, nothing leaked (the sweep checks). */
static int idx_load_run(void *ud) {
    ag_tensor *t = ag_load_idx((const char *)ud, true, 1.0);
    if (!t)
        return ag_last_status();
    ag_tensor_free(t);
    return 0;
}

static int fashion_load_run(void *ud) {
    (void)ud;
    ag_tensor *im, *lb;
    int rc = ag_fashion_mnist_load(tmpdir, false, &im, &lb);
    if (rc)
        return rc;
    ag_tensor_free(im);
    ag_tensor_free(lb);
    return 0;
}

static void test_idx_alloc_failures(void **state) {
    (void)state;
    const char *p = tmp_path("sweep.idx.gz");
    write_idx(p, true, 2, (uint32_t[]){3, 5}, NULL, 15);
    tu_sweep_opts o = {.what = "ag_load_idx", .one_thread = true};
    assert_true(tu_alloc_failure_sweep(idx_load_run, (void *)p, &o) >= 2);
    unlink(p);
    write_fashion("t10k", 2, 28, 28, (unsigned char[]){4, 5}, 2);
    o.what = "ag_fashion_mnist_load";
    assert_true(tu_alloc_failure_sweep(fashion_load_run, NULL, &o) >= 5);
    remove_fashion("t10k");
}

/* ---- safetensors ---- */

/* Writes path: the 8-byte length of json, json, then ndata data bytes (byte i is i % 256). */
static void write_st(const char *path, const char *json, size_t ndata) {
    size_t h = strlen(json), n = 8 + h + ndata;
    unsigned char *b = malloc(n);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(b + 8, json, h);
    for (size_t i = 0; i < ndata; i++)
        b[8 + h + i] = (unsigned char)i;
    write_raw(path, b, n);
    free(b);
}

/* Linear(3, 4): weight f32[4, 3] (48 bytes) and bias f32[4] (16 bytes). */
#define W_F32(b, e)                                                                                \
    "\"weight\":{\"dtype\":\"F32\",\"shape\":[4,3],\"data_offsets\":[" #b "," #e "]}"
#define B_F32(b, e) "\"bias\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[" #b "," #e "]}"

/* The bytes of m's weight and bias, to see that a failed load changed nothing. */
static void lin_bytes(ag_module *m, unsigned char out[64]) {
    memcpy(out, ag_tensor_data(ag_module_param(m, "weight")), 48);
    memcpy(out + 48, ag_tensor_data(ag_module_param(m, "bias")), 16);
}

/* Loading a file of header json and ndata bytes into Linear(3, 4) fails with code, a message
 * holding the path and needle, and the module unchanged. */
static void st_refused(const char *json, size_t ndata, int code, const char *needle) {
    const char *p = tmp_path("bad.safetensors");
    write_st(p, json, ndata);
    ag_module *m = ag_nn_linear(3, 4, true);
    unsigned char before[64], after[64];
    lin_bytes(m, before);
    int rc = ag_module_load(m, p);
    if (rc != code)
        fail_msg("loading %s gave %d (%s), expected %d with '%s'", json, rc,
                 rc ? ag_last_error() : "success", code, needle);
    tu_assert_error_contains(p);
    tu_assert_error_contains(needle);
    lin_bytes(m, after);
    assert_memory_equal(before, after, 64);
    ag_module_free(m);
    unlink(p);
}

static void st_loads(const char *json, size_t ndata, const float *want_w, const float *want_b) {
    const char *p = tmp_path("ok.safetensors");
    write_st(p, json, ndata);
    ag_module *m = ag_nn_linear(3, 4, true);
    if (ag_module_load(m, p))
        fail_msg("loading %s: %s", json, ag_last_error());
    assert_memory_equal(ag_tensor_data(ag_module_param(m, "weight")), want_w, 48);
    assert_memory_equal(ag_tensor_data(ag_module_param(m, "bias")), want_b, 16);
    ag_module_free(m);
    unlink(p);
}

static void test_safetensors_valid(void **state) {
    (void)state;
    /* Data bytes are i % 256: weight's floats are the bytes at their offsets. */
    unsigned char data[64];
    for (int i = 0; i < 64; i++)
        data[i] = (unsigned char)i;
    float w[12], b[4];
    memcpy(w, data, 48);
    memcpy(b, data + 48, 16);
    st_loads("{" W_F32(0, 48) "," B_F32(48, 64) "}", 64, w, b);
    /* Any key order, any data order, with string metadata. */
    memcpy(b, data, 16);
    memcpy(w, data + 16, 48);
    st_loads(
        "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"x\"}," W_F32(16, 64) "," B_F32(0, 16) "}",
        64, w, b);
}

static void test_safetensors_offsets(void **state) {
    (void)state;
    /* The data must be tiled exactly: overlaps, shared bytes, gaps and trailing bytes are
     * refused (the loader used to take all of them). */
    st_refused("{" W_F32(0, 48) "," B_F32(32, 48) "}", 48, AG_EFORMAT, "overlaps");
    st_refused("{" W_F32(0, 48) "," B_F32(0, 16) "}", 48, AG_EFORMAT,
               "the data of 'weight' (data_offsets [0, 48]) overlaps that of 'bias' ([0, 16])");
    st_refused("{" W_F32(0, 48) "," B_F32(56, 72) "}", 72, AG_EFORMAT,
               "data bytes [48, 56) belong to no tensor");
    st_refused("{" W_F32(8, 56) "," B_F32(56, 72) "}", 72, AG_EFORMAT,
               "data bytes [0, 8) belong to no tensor");
    st_refused("{" W_F32(0, 48) "," B_F32(48, 64) "}", 72, AG_EFORMAT,
               "8 trailing bytes after the tensors' data");
    st_refused("{" W_F32(0, 48) "," B_F32(48, 64) "}", 65, AG_EFORMAT, "1 trailing bytes");
    /* Offsets past the data, reversed, negative. */
    st_refused("{" W_F32(0, 48) "," B_F32(48, 64) "}", 60, AG_EFORMAT,
               "data_offsets [48, 64] are outside the 60 data bytes");
    st_refused("{" W_F32(48, 0) "," B_F32(48, 64) "}", 64, AG_EFORMAT, "[48, 0]");
    st_refused("{" W_F32(-16, 32) "," B_F32(48, 64) "}", 64, AG_EFORMAT, "[-16, 32]");
}

static void test_safetensors_entries(void **state) {
    (void)state;
    /* A shape whose byte count overflows 64 bits: the message says so (it used to compute
     * the product anyway, a signed overflow). */
    st_refused("{\"weight\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],"
               "\"data_offsets\":[0,48]}," B_F32(48, 64) "}",
               64, AG_EFORMAT, "needs more than 9223372036854775807");
    st_refused("{\"weight\":{\"dtype\":\"I64\",\"shape\":[1152921504606846976],"
               "\"data_offsets\":[0,48]}," B_F32(48, 64) "}",
               64, AG_EFORMAT, "needs more than 9223372036854775807");
    st_refused("{\"weight\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],"
               "\"data_offsets\":[0,48]}," B_F32(48, 64) "}",
               64, AG_EFORMAT, "needs more than");
    /* Shape and offsets that disagree. */
    st_refused("{\"weight\":{\"dtype\":\"F32\",\"shape\":[4,2],\"data_offsets\":[0,48]}," B_F32(
                   48, 64) "}",
               64, AG_EFORMAT, "data_offsets span 48 bytes; 8 elements of F32 need 32");
    /* Dtype names: unknown ones are refused, the format's other dtypes are sized by their
     * own width (F16: 2 bytes; F4: half a byte, whole bytes only). */
    st_refused("{\"weight\":{\"dtype\":\"F17\",\"shape\":[4,3],\"data_offsets\":[0,48]}," B_F32(
                   48, 64) "}",
               64, AG_EFORMAT, "unknown dtype 'F17'");
    st_refused("{" W_F32(0, 48) "," B_F32(
                   48, 64) ",\"extra\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[64,68]}}",
               68, AG_EFORMAT, "3 elements of F16 need 6");
    st_refused("{" W_F32(0, 48) "," B_F32(
                   48, 64) ",\"extra\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[64,66]}}",
               66, AG_EFORMAT, "3 elements of F4 do not fill whole bytes");
    /* A well-formed entry the module lacks is PyTorch's strict-loading error. */
    st_refused("{" W_F32(0, 48) "," B_F32(
                   48, 64) ",\"extra\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[64,70]}}",
               70, AG_EINVAL, "holds 'extra', which the module does not have");
    /* The module's dtype, shape. */
    st_refused("{\"weight\":{\"dtype\":\"I32\",\"shape\":[4,3],\"data_offsets\":[0,48]}," B_F32(
                   48, 64) "}",
               64, AG_EINVAL, "'weight' has dtype I32");
    /* __metadata__ maps names to strings. */
    st_refused("{\"__metadata__\":{\"format\":3}," W_F32(0, 48) "," B_F32(48, 64) "}", 64,
               AG_EFORMAT, "__metadata__ entry 'format' is not a string");
    st_refused("{\"__metadata__\":[\"pt\"]," W_F32(0, 48) "," B_F32(48, 64) "}", 64, AG_EFORMAT,
               "__metadata__ must be an object");
    /* Duplicate names. */
    st_refused("{" W_F32(0, 48) "," B_F32(48, 64) "," B_F32(48, 64) "}", 64, AG_EFORMAT,
               "duplicate");
    /* A header that is not an object, and one that is not JSON. */
    st_refused("[1, 2]", 0, AG_EFORMAT, "not a JSON object");
    st_refused("{\"weight\": ", 0, AG_EFORMAT, "malformed header");
}

static void test_safetensors_header_length(void **state) {
    (void)state;
    const char *p = tmp_path("len.safetensors");
    ag_module *m = ag_nn_linear(3, 4, true);
    /* Shorter than the length field. */
    write_raw(p, "\x10\0\0", 3);
    assert_int_equal(ag_module_load(m, p), AG_EFORMAT);
    tu_assert_error_contains("too short");
    /* A length beyond the file, beyond the format's 100 MB cap, and 2^64 - 1. */
    const char *json = "{" W_F32(0, 48) "," B_F32(48, 64) "}";
    size_t h = strlen(json);
    unsigned char *b = calloc(1, 8 + h + 64);
    memcpy(b + 8, json, h);
    uint64_t lens[] = {h + 65, 100u << 20 | 1, UINT64_MAX};
    for (size_t k = 0; k < 3; k++) {
        for (int i = 0; i < 8; i++)
            b[i] = (unsigned char)(lens[k] >> (8 * i));
        write_raw(p, b, 8 + h + 64);
        assert_int_equal(ag_module_load(m, p), AG_EFORMAT);
        tu_assert_error_contains("header length");
    }
    /* A length that cuts the JSON short. */
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)(h - 1) >> (8 * i));
    write_raw(p, b, 8 + h + 64);
    assert_int_equal(ag_module_load(m, p), AG_EFORMAT);
    free(b);
    ag_module_free(m);
    unlink(p);
}

int main(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/ag_test_readers_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_idx_valid),
        cmocka_unit_test(test_idx_bad_files),
        cmocka_unit_test(test_idx_huge_sizes),
        cmocka_unit_test(test_idx_gzip_errors),
        cmocka_unit_test(test_fashion_mnist),
        cmocka_unit_test(test_idx_alloc_failures),
        cmocka_unit_test(test_safetensors_valid),
        cmocka_unit_test(test_safetensors_offsets),
        cmocka_unit_test(test_safetensors_entries),
        cmocka_unit_test(test_safetensors_header_length),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    rmdir(tmpdir);
    return rc;
}
