/* IDX dataset files (the MNIST family's format): a big-endian header (magic: two zero bytes, a
 * type code, the number of dimensions; then one 32-bit size per dimension) followed by the
 * data. Files may be gzip-compressed; zlib's gzread reads both. The file is untrusted input:
 * the data must be exactly what the header describes (torchvision's reader refuses a size
 * mismatch too), gzip errors (a corrupt stream, a bad CRC) are reported as such, and memory
 * grows with the data actually read, never with what the header claims. */
#include "../core/internal.h"
#include "aotgrad/data.h"

#include <errno.h>
#include <stdio.h>
#include <zlib.h>

/* Elements one file may hold (1 TiB of bytes); a product of sizes beyond it is refused before
 * any data is read. */
#define IDX_MAX_NUMEL ((int64_t)1 << 40)
/* The data buffer starts at this size (or the file's, if smaller) and doubles as data comes. */
#define IDX_FIRST_CHUNK ((int64_t)1 << 20)

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Reads up to n bytes; returns the count read (short only at the end of the data), or -1 after
 * setting an error for a gzip or I/O error. */
static int64_t read_bytes(gzFile f, const char *path, void *buf, int64_t n) {
    int64_t got = 0;
    while (got < n) {
        unsigned chunk = (unsigned)((n - got) > (1 << 30) ? (1 << 30) : (n - got));
        int r = gzread(f, (char *)buf + got, chunk);
        if (r < 0) {
            int zerr;
            const char *msg = gzerror(f, &zerr);
            if (zerr == Z_ERRNO)
                ag__err(AG_EIO, "idx: %s: read error: %s", path, strerror(errno));
            else
                ag__err(AG_EFORMAT, "idx: %s: gzip error: %s", path, msg);
            return -1;
        }
        if (r == 0)
            break;
        got += r;
    }
    return got;
}

/* After a short read: a gzip stream that ended early is a gzip error, not merely short data. */
static bool gzip_failed(gzFile f, const char *path) {
    int zerr;
    const char *msg = gzerror(f, &zerr);
    if (zerr == Z_OK)
        return false;
    ag__err(AG_EFORMAT, "idx: %s: gzip error: %s", path, msg);
    return true;
}

ag_tensor *ag_load_idx(const char *path, bool as_float, double scale) {
    AG__CHECK_NULL_RET("load_idx", path, NULL);
    errno = 0;
    gzFile f = gzopen(path, "rb");
    if (!f) {
        if (!errno)
            return ag__err(AG_ENOMEM, "idx: out of memory opening %s", path), NULL;
        return ag__err(AG_EIO, "idx: cannot open %s: %s", path, strerror(errno)), NULL;
    }
    unsigned char hdr[4];
    ag_tensor *t = NULL;
    unsigned char *raw = NULL;
    int64_t got = read_bytes(f, path, hdr, 4);
    if (got < 0)
        goto done;
    if (got != 4 || hdr[0] || hdr[1]) {
        if (!gzip_failed(f, path))
            ag__err(AG_EFORMAT, "idx: %s: not an IDX file (bad magic)", path);
        goto done;
    }
    if (hdr[2] != 0x08) {
        ag__err(AG_ENOTSUP,
                "idx: %s: element type 0x%02x; only unsigned bytes (0x08) are supported", path,
                hdr[2]);
        goto done;
    }
    int nd = hdr[3];
    if (nd < 1 || nd > AG_MAX_DIMS) {
        ag__err(AG_EFORMAT, "idx: %s: %d dimensions (1 to %d are supported)", path, nd,
                AG_MAX_DIMS);
        goto done;
    }
    /* n is the product of the sizes; bound is that of max(size, 1), so that a zero size does
     * not hide the others (the tensor's strides multiply them). */
    int64_t sizes[AG_MAX_DIMS], n = 1, bound = 1;
    unsigned char b[4 * AG_MAX_DIMS];
    if ((got = read_bytes(f, path, b, 4 * nd)) < 0)
        goto done;
    if (got != 4 * nd) {
        if (!gzip_failed(f, path))
            ag__err(AG_EFORMAT,
                    "idx: %s: truncated header (%d dimensions need %d bytes of sizes, "
                    "%lld present)",
                    path, nd, 4 * nd, (long long)got);
        goto done;
    }
    for (int d = 0; d < nd; d++) {
        sizes[d] = be32(b + 4 * d);
        int64_t s = sizes[d] ? sizes[d] : 1;
        if (bound > IDX_MAX_NUMEL / s) {
            ag__err(AG_EFORMAT,
                    "idx: %s: implausible size %lld in dim %d (more than %lld elements)", path,
                    (long long)sizes[d], d, (long long)IDX_MAX_NUMEL);
            goto done;
        }
        bound *= s;
        n *= sizes[d];
    }
    /* The buffer grows as data arrives, so a header that claims more than the file holds costs
     * no more memory than the file. */
    int64_t cap = n < IDX_FIRST_CHUNK ? n : IDX_FIRST_CHUNK;
    raw = ag__malloc((size_t)(cap ? cap : 1));
    if (!raw)
        goto done;
    got = 0;
    for (;;) {
        int64_t r = read_bytes(f, path, raw + got, cap - got);
        if (r < 0)
            goto done;
        got += r;
        if (got < cap || cap == n)
            break;
        int64_t ncap = cap > n / 2 ? n : 2 * cap;
        unsigned char *nraw = ag__malloc((size_t)ncap);
        if (!nraw)
            goto done;
        memcpy(nraw, raw, (size_t)got);
        ag__free(raw);
        raw = nraw;
        cap = ncap;
    }
    if (got != n) {
        if (!gzip_failed(f, path))
            ag__err(AG_EFORMAT, "idx: %s: truncated data: %lld of %lld data bytes present", path,
                    (long long)got, (long long)n);
        goto done;
    }
    /* Nothing may follow the data; reading on also makes gzip check its trailer (CRC-32 and
     * length), which it does only at the end of the stream. */
    unsigned char extra[1];
    int64_t more = read_bytes(f, path, extra, 1);
    if (more < 0 || gzip_failed(f, path))
        goto done;
    if (more) {
        ag__err(AG_EFORMAT,
                "idx: %s: the file holds more than the %lld data bytes its header "
                "describes",
                path, (long long)n);
        goto done;
    }
    t = ag__tensor_new(as_float ? AG_F32 : AG_I64, nd, sizes, false);
    if (!t)
        goto done;
    if (as_float) {
        float *p = (float *)t->storage->data;
        for (int64_t i = 0; i < n; i++)
            p[i] = (float)(raw[i] * scale);
    } else {
        int64_t *p = (int64_t *)t->storage->data;
        for (int64_t i = 0; i < n; i++)
            p[i] = raw[i];
    }
done:
    ag__free(raw);
    gzclose(f);
    return ag__give(t);
}

/* Checks the pair read from ip (images) and lp (labels): images (N, H, W), labels (N) holding
 * class indices 0..9. Returns 0 or an error. */
static int check_pair(const char *ip, const char *lp, const ag_tensor *img, const ag_tensor *lab) {
    char a[160];
    if (ag_tensor_ndim(img) != 3)
        return ag__err(AG_EFORMAT, "fashion_mnist: %s holds %s; images must be (N, H, W)", ip,
                       ag__fmt_sizes(a, sizeof a, img->ndim, img->sizes));
    if (ag_tensor_ndim(lab) != 1)
        return ag__err(AG_EFORMAT, "fashion_mnist: %s holds %s; labels must be (N)", lp,
                       ag__fmt_sizes(a, sizeof a, lab->ndim, lab->sizes));
    if (lab->sizes[0] != img->sizes[0])
        return ag__err(AG_EFORMAT,
                       "fashion_mnist: %s and %s do not match (images %lldx%lldx%lld, "
                       "labels %lld)",
                       ip, lp, (long long)img->sizes[0], (long long)img->sizes[1],
                       (long long)img->sizes[2], (long long)lab->sizes[0]);
    const int64_t *l = ag_tensor_data(lab);
    for (int64_t i = 0; i < lab->sizes[0]; i++)
        if (l[i] > 9)
            return ag__err(AG_EFORMAT,
                           "fashion_mnist: %s: label %lld at index %lld is not a class (0 to 9)",
                           lp, (long long)l[i], (long long)i);
    return 0;
}

int ag_fashion_mnist_load(const char *dir, bool train, ag_tensor **images, ag_tensor **labels) {
    AG__CHECK_NULL("fashion_mnist_load", dir);
    AG__CHECK_NULL("fashion_mnist_load", images);
    AG__CHECK_NULL("fashion_mnist_load", labels);
    *images = *labels = NULL;
    char ip[4096], lp[4096];
    if (snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte.gz", dir, train ? "train" : "t10k") >=
            (int)sizeof ip ||
        snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte.gz", dir, train ? "train" : "t10k") >=
            (int)sizeof lp)
        return ag__err(AG_EINVAL, "fashion_mnist: directory name too long (%zu bytes)",
                       strlen(dir));
    /* Normalized with the training set's mean and std, as torchvision examples do. */
    const double mean = 0.2860, std = 0.3530;
    bool scoped = ag__in_scope();
    ag_tensor *raw = ag_load_idx(ip, true, 1.0 / 255.0 / std);
    ag_tensor *lab = raw ? ag_load_idx(lp, false, 1.0) : NULL;
    /* The checks read both tensors, so they run before either is released. */
    int rc = raw && lab ? check_pair(ip, lp, raw, lab) : ag_last_status();
    if (rc) {
        if (!scoped) {
            ag_tensor_free(raw);
            ag_tensor_free(lab);
        }
        return rc;
    }
    float *p = ag_tensor_data(raw);
    int64_t n = ag_tensor_numel(raw);
    for (int64_t i = 0; i < n; i++)
        p[i] -= (float)(mean / std);
    /* (N, H, W) -> (N, 1, H, W): a view of the same storage. */
    int64_t sz[4] = {raw->sizes[0], 1, raw->sizes[1], raw->sizes[2]};
    ag_tensor *img = ag_view(raw, 4, sz);
    if (!scoped)
        ag_tensor_free(raw);
    if (!img) {
        if (!scoped)
            ag_tensor_free(lab);
        return ag_last_status();
    }
    *images = img;
    *labels = lab;
    return 0;
}
