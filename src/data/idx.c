/* IDX dataset files (the MNIST family's format): a big-endian header (magic: two zero bytes, a
 * type code, the number of dimensions; then one 32-bit size per dimension) followed by the
 * data. Files may be gzip-compressed; zlib's gzread reads both. The file is untrusted input:
 * sizes are checked against what the file holds. */
#include "../core/internal.h"
#include "aotgrad/data.h"

#include <stdio.h>
#include <zlib.h>

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

ag_tensor *ag_load_idx(const char *path, bool as_float, double scale) {
    gzFile f = gzopen(path, "rb");
    if (!f)
        return ag__err(AG_EIO, "idx: cannot open %s", path), NULL;
    unsigned char hdr[4];
    ag_tensor *t = NULL;
    unsigned char *raw = NULL;
    if (gzread(f, hdr, 4) != 4 || hdr[0] || hdr[1]) {
        ag__err(AG_EFORMAT, "idx: %s: not an IDX file (bad magic)", path);
        goto done;
    }
    if (hdr[2] != 0x08) {
        ag__err(AG_ENOTSUP, "idx: %s: element type 0x%02x; only unsigned bytes (0x08) are "
                            "supported", path, hdr[2]);
        goto done;
    }
    int nd = hdr[3];
    if (nd < 1 || nd > AG_MAX_DIMS) {
        ag__err(AG_EFORMAT, "idx: %s: %d dimensions", path, nd);
        goto done;
    }
    int64_t sizes[AG_MAX_DIMS], n = 1;
    for (int d = 0; d < nd; d++) {
        unsigned char b[4];
        if (gzread(f, b, 4) != 4) {
            ag__err(AG_EFORMAT, "idx: %s: truncated header", path);
            goto done;
        }
        sizes[d] = be32(b);
        if (sizes[d] == 0 || n > ((int64_t)1 << 40) / sizes[d]) {
            ag__err(AG_EFORMAT, "idx: %s: implausible size %lld in dim %d", path,
                    (long long)sizes[d], d);
            goto done;
        }
        n *= sizes[d];
    }
    raw = ag__malloc((size_t)n);
    if (!raw)
        goto done;
    int64_t got = 0;
    while (got < n) {
        int chunk = (int)((n - got) > (1 << 30) ? (1 << 30) : (n - got));
        int r = gzread(f, raw + got, (unsigned)chunk);
        if (r <= 0)
            break;
        got += r;
    }
    if (got != n) {
        ag__err(AG_EFORMAT, "idx: %s: %lld of %lld data bytes present", path, (long long)got,
                (long long)n);
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

int ag_fashion_mnist_load(const char *dir, bool train, ag_tensor **images, ag_tensor **labels) {
    AG__CHECK_NULL("fashion_mnist_load", dir);
    AG__CHECK_NULL("fashion_mnist_load", images);
    AG__CHECK_NULL("fashion_mnist_load", labels);
    char ip[4096], lp[4096];
    snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte.gz", dir, train ? "train" : "t10k");
    snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte.gz", dir, train ? "train" : "t10k");
    *images = *labels = NULL;
    /* Normalized with the training set's mean and std, as torchvision examples do. */
    const double mean = 0.2860, std = 0.3530;
    ag_tensor *raw = ag_load_idx(ip, true, 1.0 / 255.0 / std);
    ag_tensor *lab = raw ? ag_load_idx(lp, false, 1.0) : NULL;
    if (!raw || !lab) {
        if (!ag__in_scope()) {
            ag_tensor_free(raw);
            ag_tensor_free(lab);
        }
        return ag_last_status();
    }
    if (ag_tensor_ndim(raw) != 3 || ag_tensor_size(lab, 0) != ag_tensor_size(raw, 0)) {
        if (!ag__in_scope()) {
            ag_tensor_free(raw);
            ag_tensor_free(lab);
        }
        return ag__err(AG_EFORMAT, "fashion_mnist: %s and %s do not match (images %lldx%lldx%lld, "
                                   "labels %lld)", ip, lp, (long long)ag_tensor_size(raw, 0),
                       (long long)ag_tensor_size(raw, 1), (long long)ag_tensor_size(raw, 2),
                       (long long)ag_tensor_size(lab, 0));
    }
    float *p = ag_tensor_data(raw);
    int64_t n = ag_tensor_numel(raw);
    for (int64_t i = 0; i < n; i++)
        p[i] -= (float)(mean / std);
    /* (N, 28, 28) -> (N, 1, 28, 28): a view of the same storage. */
    int64_t sz[4] = {ag_tensor_size(raw, 0), 1, ag_tensor_size(raw, 1), ag_tensor_size(raw, 2)};
    bool scoped = ag__in_scope();
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
