/* Safetensors files (https://github.com/huggingface/safetensors): files of named tensors
 * (ag_safetensors_save / ag_safetensors_load) and module state (ag_module_save / ag_module_load,
 * users of the same reader and writer). The format: an 8-byte little-endian header length N,
 * N bytes of JSON header
 *   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
 *    "__metadata__": {"format": "pt"}}
 * (padded with spaces to a multiple of 8), then the raw little-endian tensor bytes, offsets
 * relative to the end of the header.
 *
 * Module state: named_parameters (deduplicated, so a tied weight is stored once under its
 * first name) then the persistent buffers, each written contiguously. Saving writes a
 * temporary file next to the target and renames it over the target, so a crash never leaves a
 * half written checkpoint. Loading treats the file as untrusted: the header is parsed and every
 * entry checked (dtype, shape, offsets inside the data, the offsets of all entries tiling the
 * data exactly, __metadata__ a map of strings) before any tensor is read, and when loading a
 * module every module tensor is matched by name, dtype and shape before any is written, so a
 * bad file changes nothing. Strict loading (the default, as PyTorch's) refuses names in the
 * file that the module lacks (except the other names of a tied tensor) and module tensors the
 * file lacks; non-strict loading reports both. A dtype conversion on load (ag_load_opts) reads
 * the file's tensor into a staging tensor of its own dtype and converts it.
 *
 * jansson's allocations are routed through ag__malloc for the duration of each call (its
 * allocator is process-global: do not use jansson from another thread during a save or
 * load). */
#include "nn_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c writes tensor bytes as they are in memory: little-endian hosts only"
#endif

/* The format's cap on the header size (safetensors refuses larger headers too). */
#define ST_MAX_HEADER (100u << 20)

static const char *const st_dtype[AG_NDTYPES] = {"F32", "F64", "I64", "BOOL", "I8"};

/* ---- jansson through the library's allocator ---- */

static _Thread_local bool json_oom;

/* Once an allocation has failed, every later one of the same save or load fails too. jansson
 * 2.14's lexer ignores a failure to grow its token buffer (the byte is dropped) and then
 * copies the token by scanning for its closing quote, past the end of the copy's buffer;
 * with this, the copy's own allocation fails first and the parse stops. */
static void *json_alloc(size_t n) {
    if (json_oom)
        return NULL;
    void *p = ag__malloc(n);
    if (!p)
        json_oom = true;
    return p;
}

static void json_release(void *p) {
    ag__free(p);
}

typedef struct json_hooks {
    json_malloc_t alloc;
    json_free_t free;
} json_hooks;

static json_hooks json_enter(void) {
    json_hooks h;
    json_get_alloc_funcs(&h.alloc, &h.free);
    json_set_alloc_funcs(json_alloc, json_release);
    json_oom = false;
    return h;
}

static void json_leave(json_hooks h) {
    json_set_alloc_funcs(h.alloc, h.free);
}

/* ---- save ---- */

/* The JSON header for n tensors laid out back to back in list order, with the metadata pairs
 * (NULL: {"format": "pt"}). Returns a string from ag__malloc (space-padded to a multiple of 8,
 * length in *len) or NULL. */
static char *build_header(const char *const *names, ag_tensor *const *tensors, int n,
                          const char *const *metadata, size_t *len) {
    json_hooks h = json_enter();
    json_t *root = json_object();
    int bad = root ? 0 : -1;
    int64_t off = 0;
    for (int i = 0; i < n && !bad; i++) {
        const ag_tensor *t = tensors[i];
        int64_t nbytes = ag_tensor_numel(t) * (int64_t)ag_dtype_size(t->dtype);
        json_t *e = json_object(), *shape = json_array(), *offs = json_array();
        for (int d = 0; d < t->ndim; d++)
            bad |= json_array_append_new(shape, json_integer(t->sizes[d]));
        bad |= json_array_append_new(offs, json_integer(off));
        bad |= json_array_append_new(offs, json_integer(off + nbytes));
        bad |= json_object_set_new(e, "dtype", json_string(st_dtype[t->dtype]));
        bad |= json_object_set_new(e, "shape", shape);
        bad |= json_object_set_new(e, "data_offsets", offs);
        bad |= json_object_set_new(root, names[i], e);
        off += nbytes;
    }
    json_t *meta = json_object();
    if (metadata)
        for (int k = 0; metadata[k]; k += 2)
            bad |= json_object_set_new(meta, metadata[k], json_string(metadata[k + 1]));
    else
        bad |= json_object_set_new(meta, "format", json_string("pt"));
    bad |= json_object_set_new(root, "__metadata__", meta);
    char *s = bad ? NULL : json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    /* jansson does not report every failed allocation (some string appends are unchecked
     * and silently drop text), so any failure at all voids the result. */
    bool oom = json_oom;
    if (oom) {
        ag__free(s);
        s = NULL;
    }
    json_leave(h);
    if (!s) {
        if (oom)
            ag__err(AG_ENOMEM, "save: out of memory building the header");
        else
            ag__err(AG_EINVAL, "save: cannot encode the header (a name or metadata string is not "
                               "UTF-8?)");
        return NULL;
    }
    size_t len0 = strlen(s), padded = (len0 + 7) / 8 * 8;
    char *out = ag__malloc(padded + 1);
    if (out) {
        memcpy(out, s, len0);
        memset(out + len0, ' ', padded - len0);
        out[padded] = 0;
        *len = padded;
    }
    ag__free(s); /* json_dumps allocated it through json_alloc */
    return out;
}

static int write_tensor(FILE *f, const ag_tensor *t) {
    size_t nbytes = (size_t)ag_tensor_numel(t) * ag_dtype_size(t->dtype);
    if (nbytes == 0)
        return 0;
    if (ag_tensor_is_contiguous(t))
        return fwrite(ag_tensor_data(t), 1, nbytes, f) == nbytes ? 0 : -1;
    ag_tensor *c = ag__tensor_new(t->dtype, t->ndim, t->sizes, false);
    if (!c)
        return AG_ENOMEM;
    int rc = ag__copy_into(c, t);
    if (!rc && fwrite(ag_tensor_data(c), 1, nbytes, f) != nbytes)
        rc = -1;
    ag_tensor_free(c);
    return rc;
}

/* Writes header and data to the stream; -1 for an I/O error (errno), else a status. */
static int write_file(FILE *f, ag_tensor *const *tensors, int n, const char *hdr, size_t hlen) {
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    if (fwrite(len8, 1, 8, f) != 8 || fwrite(hdr, 1, hlen, f) != hlen)
        return -1;
    for (int i = 0; i < n; i++) {
        int rc = write_tensor(f, tensors[i]);
        if (rc)
            return rc;
    }
    if (fflush(f) || fsync(fileno(f)))
        return -1;
    return 0;
}

/* Creates "<path>.tmp.<pid>.<k>" exclusively (mode 0666 less the umask, as fopen would). */
static FILE *open_temp(const char *path, char **tmp_out) {
    size_t n = strlen(path) + 48;
    char *tmp = ag__malloc(n);
    if (!tmp)
        return NULL;
    static _Atomic unsigned counter;
    for (int attempt = 0; attempt < 100; attempt++) {
        snprintf(tmp, n, "%s.tmp.%ld.%u", path, (long)getpid(), counter++);
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd < 0 && errno == EEXIST)
            continue;
        if (fd < 0)
            break;
        FILE *f = fdopen(fd, "wb");
        if (!f) {
            close(fd);
            unlink(tmp);
            break;
        }
        *tmp_out = tmp;
        return f;
    }
    ag__err(AG_EIO, "save: cannot create a temporary file next to '%s': %s", path, strerror(errno));
    ag__free(tmp);
    return NULL;
}

/* Checks the arguments of a save (what would make a file that cannot be read back). */
static int check_save_args(const char *const *names, ag_tensor *const *tensors, int n,
                           const char *const *metadata) {
    if (n < 0 || (n > 0 && (!names || !tensors)))
        return ag__err(AG_EINVAL, "safetensors_save: %s (n = %d)",
                       n < 0 ? "negative count" : "names or tensors is NULL", n);
    for (int i = 0; i < n; i++) {
        if (!names[i] || !names[i][0] || !strcmp(names[i], "__metadata__"))
            return ag__err(AG_EINVAL, "safetensors_save: name %d is %s", i,
                           !names[i]      ? "NULL"
                           : !names[i][0] ? "empty"
                                          : "'__metadata__' (reserved)");
        if (!tensors[i])
            return ag__err(AG_EINVAL, "safetensors_save: tensor '%s' is NULL", names[i]);
        if (!tensors[i]->storage->data)
            return ag__err(AG_EINVAL, "save: '%s' is a meta tensor (it has no data)", names[i]);
        if (ag_tensor_subclass(tensors[i]))
            return ag__err(AG_EINVAL, "safetensors_save: '%s' is a %s, not a plain tensor",
                           names[i], ag_tensor_subclass(tensors[i])->name);
        for (int j = 0; j < i; j++)
            if (!strcmp(names[i], names[j]))
                return ag__err(AG_EINVAL, "safetensors_save: name '%s' is given twice", names[i]);
    }
    for (int k = 0; metadata && metadata[k]; k += 2)
        if (!metadata[k + 1])
            return ag__err(AG_EINVAL, "safetensors_save: metadata key '%s' has no value",
                           metadata[k]);
    return 0;
}

/* Writes the file through a temporary renamed over path. */
static int save_tensors(const char *path, const char *const *names, ag_tensor *const *tensors,
                        int n, const char *const *metadata) {
    size_t hlen = 0;
    char *hdr = build_header(names, tensors, n, metadata, &hlen);
    char *tmp = NULL;
    FILE *f = hdr ? open_temp(path, &tmp) : NULL;
    if (!f) {
        ag__free(hdr);
        return ag__nn_status();
    }
    int rc = write_file(f, tensors, n, hdr, hlen);
    int err = errno;
    if (fclose(f) && !rc) {
        rc = -1;
        err = errno;
    }
    if (!rc && rename(tmp, path)) {
        rc = -1;
        err = errno;
    }
    if (rc == -1)
        rc = ag__err(AG_EIO, "save: cannot write '%s': %s", path, strerror(err));
    if (rc)
        unlink(tmp);
    ag__free(tmp);
    ag__free(hdr);
    return rc;
}

int ag_safetensors_save(const char *path, const char *const *names, ag_tensor *const *tensors,
                        int n, const char *const *metadata) {
    AG__CHECK_NULL("safetensors_save", path);
    int rc = check_save_args(names, tensors, n, metadata);
    return rc ? rc : save_tensors(path, names, tensors, n, metadata);
}

int ag_module_save(const ag_module *m, const char *path) {
    AG__CHECK_NULL("module_save", m);
    AG__CHECK_NULL("module_save", path);
    ag_named_tensors nt;
    int rc = ag__nn_state_tensors(m, true, &nt);
    if (rc)
        return rc;
    for (int i = 0; i < nt.n && !rc; i++)
        if (!nt.tensors[i]->storage->data)
            rc = ag__err(AG_EINVAL, "save: '%s' is a meta tensor (it has no data)", nt.names[i]);
    if (!rc)
        rc = save_tensors(path, (const char *const *)nt.names, nt.tensors, nt.n, NULL);
    ag_named_tensors_free(&nt);
    return rc;
}

/* ---- load ---- */

/* The format's dtypes (upstream's Dtype enum) and their sizes in bits. */
static const struct {
    const char *name;
    int bits;
} st_formats[] = {
    {"BOOL", 8}, {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"U8", 8},
    {"I8", 8},   {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"I16", 16},
    {"U16", 16}, {"F16", 16},    {"BF16", 16},   {"I32", 32},    {"U32", 32},
    {"F32", 32}, {"C64", 64},    {"F64", 64},    {"I64", 64},    {"U64", 64},
};

/* One checked header entry. */
typedef struct st_entry {
    int dtype;              /* ag_dtype, or -1 for a dtype aotgrad does not have (F16, ...) */
    const char *dtype_name; /* the format's name (static) */
    int ndim;               /* AG_MAX_DIMS + 1 for a shape with more dims than aotgrad has */
    int64_t sizes[AG_MAX_DIMS];
    int64_t begin, end;
    const char *name; /* the entry's key (owned by the parsed header, then by its st_file) */
    ag_tensor *src;   /* the tensor of a dictionary entry (module loading from memory) */
} st_entry;

static int fmt_err(const char *path, const char *name, const char *what) {
    return ag__err(AG_EFORMAT, "load: '%s': bad header entry '%s': %s", path, name, what);
}

/* Validates an entry of the header against the data size: a known dtype, a shape whose
 * element count times the dtype's size is exactly end - begin, offsets inside the data. */
static int parse_entry(const char *path, const char *name, json_t *v, int64_t data_len,
                       st_entry *e) {
    json_t *dt = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape");
    json_t *offs = json_object_get(v, "data_offsets");
    if (!json_is_object(v) || !json_is_string(dt) || !json_is_array(shape) ||
        !json_is_array(offs) || json_array_size(offs) != 2)
        return fmt_err(path, name,
                       "expected {\"dtype\": str, \"shape\": [int...], "
                       "\"data_offsets\": [begin, end]}");
    e->name = name;
    e->dtype_name = json_string_value(dt);
    e->dtype = -1;
    for (int d = 0; d < AG_NDTYPES; d++)
        if (!strcmp(e->dtype_name, st_dtype[d]))
            e->dtype = d;
    int bits = 0;
    for (size_t k = 0; k < sizeof st_formats / sizeof st_formats[0]; k++)
        if (!strcmp(e->dtype_name, st_formats[k].name)) {
            bits = st_formats[k].bits;
            e->dtype_name = st_formats[k].name;
        }
    if (!bits) {
        char msg[200];
        snprintf(msg, sizeof msg, "unknown dtype '%.64s' (not a safetensors dtype)", e->dtype_name);
        return fmt_err(path, name, msg);
    }
    size_t nd = json_array_size(shape);
    /* Shapes with more dims than aotgrad supports can still be skipped if unused; they can
     * never match a module tensor, so only their first AG_MAX_DIMS sizes are kept. */
    e->ndim = nd > AG_MAX_DIMS ? AG_MAX_DIMS + 1 : (int)nd;
    int64_t numel = 1;
    bool overflow = false;
    for (size_t d = 0; d < nd; d++) {
        json_t *s = json_array_get(shape, d);
        if (!json_is_integer(s) || json_integer_value(s) < 0)
            return fmt_err(path, name, "shape entries must be non-negative integers");
        int64_t sz = json_integer_value(s);
        if (d < AG_MAX_DIMS)
            e->sizes[d] = sz;
        if (sz && numel > INT64_MAX / sz)
            overflow = true;
        else
            numel *= sz;
    }
    json_t *b = json_array_get(offs, 0), *en = json_array_get(offs, 1);
    if (!json_is_integer(b) || !json_is_integer(en))
        return fmt_err(path, name, "data_offsets must be integers");
    e->begin = json_integer_value(b);
    e->end = json_integer_value(en);
    if (e->begin < 0 || e->end < e->begin || e->end > data_len) {
        char msg[160];
        snprintf(msg, sizeof msg, "data_offsets [%lld, %lld] are outside the %lld data bytes",
                 (long long)e->begin, (long long)e->end, (long long)data_len);
        return fmt_err(path, name, msg);
    }
    /* Bytes the shape needs: numel * bits / 8, a whole number of bytes (upstream refuses a
     * sub-byte dtype's tensor that ends inside a byte). Computed only when it fits. */
    overflow = overflow || numel > INT64_MAX / bits;
    int64_t nbits = overflow ? 0 : numel * bits;
    if (overflow || nbits % 8 || nbits / 8 != e->end - e->begin) {
        char msg[200];
        if (overflow)
            snprintf(msg, sizeof msg,
                     "data_offsets span %lld bytes; its shape of %s needs more than %lld",
                     (long long)(e->end - e->begin), e->dtype_name, (long long)INT64_MAX);
        else if (nbits % 8)
            snprintf(msg, sizeof msg, "%lld elements of %s do not fill whole bytes",
                     (long long)numel, e->dtype_name);
        else
            snprintf(msg, sizeof msg, "data_offsets span %lld bytes; %lld elements of %s need %lld",
                     (long long)(e->end - e->begin), (long long)numel, e->dtype_name,
                     (long long)(nbits / 8));
        return fmt_err(path, name, msg);
    }
    return 0;
}

static int by_offsets(const void *pa, const void *pb) {
    const st_entry *a = pa, *b = pb;
    if (a->begin != b->begin)
        return a->begin < b->begin ? -1 : 1;
    return (a->end > b->end) - (a->end < b->end);
}

/* The entries' data_offsets must tile the data exactly, as upstream requires: sorted by
 * offset, each begins where the previous one ended, the first at 0 and the last at the end of
 * the file. Sorts e[0..n). */
static int check_tiling(const char *path, st_entry *e, int64_t n, int64_t data_len) {
    qsort(e, (size_t)n, sizeof *e, by_offsets);
    int64_t pos = 0;
    for (int64_t i = 0; i < n; i++) {
        if (e[i].begin < pos)
            return ag__err(AG_EFORMAT,
                           "load: '%s': the data of '%s' (data_offsets [%lld, %lld]) overlaps "
                           "that of '%s' ([%lld, %lld])",
                           path, e[i].name, (long long)e[i].begin, (long long)e[i].end,
                           e[i - 1].name, (long long)e[i - 1].begin, (long long)e[i - 1].end);
        if (e[i].begin > pos)
            return ag__err(AG_EFORMAT,
                           "load: '%s': data bytes [%lld, %lld) belong to no tensor (the next, "
                           "'%s', begins at %lld)",
                           path, (long long)pos, (long long)e[i].begin, e[i].name,
                           (long long)e[i].begin);
        pos = e[i].end;
    }
    if (pos != data_len)
        return ag__err(AG_EFORMAT,
                       "load: '%s': %lld trailing bytes after the tensors' data (the tensors "
                       "end at data offset %lld, the file's data is %lld bytes)",
                       path, (long long)(data_len - pos), (long long)pos, (long long)data_len);
    return 0;
}

/* __metadata__, when present, maps names to strings (upstream's HashMap<String, String>). */
static int check_metadata(const char *path, json_t *meta) {
    if (!json_is_object(meta))
        return ag__err(AG_EFORMAT, "load: '%s': __metadata__ must be an object of strings", path);
    const char *key;
    json_t *v;
    json_object_foreach(meta, key, v) {
        if (!json_is_string(v))
            return ag__err(AG_EFORMAT,
                           "load: '%s': __metadata__ entry '%s' is not a string; __metadata__ "
                           "maps names to strings",
                           path, key);
    }
    return 0;
}

/* Reads the header: returns the parsed root object or NULL (error set). */
static json_t *read_header(FILE *f, const char *path, int64_t fsize, int64_t *hlen_out) {
    unsigned char len8[8];
    if (fsize < 8 || fread(len8, 1, 8, f) != 8) {
        ag__err(AG_EFORMAT, "load: '%s' is too short to be a safetensors file (%lld bytes)", path,
                (long long)fsize);
        return NULL;
    }
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)len8[i] << (8 * i);
    if (hlen > ST_MAX_HEADER || hlen > (uint64_t)(fsize - 8)) {
        ag__err(AG_EFORMAT,
                "load: '%s': header length %llu exceeds the file (%lld bytes) or "
                "the format's limit",
                path, (unsigned long long)hlen, (long long)fsize);
        return NULL;
    }
    char *hdr = ag__malloc((size_t)hlen + 1);
    if (!hdr)
        return NULL;
    if (fread(hdr, 1, (size_t)hlen, f) != hlen) {
        ag__free(hdr);
        ag__err(AG_EIO, "load: cannot read the header of '%s'", path);
        return NULL;
    }
    json_hooks h = json_enter();
    json_error_t jerr;
    json_t *root = json_loadb(hdr, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    bool oom = json_oom; /* as in build_header: a parse that saw a failed allocation is void */
    if (root && (oom || !json_is_object(root))) {
        json_decref(root);
        root = NULL;
        snprintf(jerr.text, sizeof jerr.text, "the header is not a JSON object");
        jerr.line = jerr.column = 0;
    }
    json_leave(h);
    ag__free(hdr);
    if (!root) {
        if (oom)
            ag__err(AG_ENOMEM, "load: out of memory parsing the header of '%s'", path);
        else
            ag__err(AG_EFORMAT, "load: '%s': malformed header (line %d, column %d): %s", path,
                    jerr.line, jerr.column, jerr.text);
        return NULL;
    }
    *hlen_out = (int64_t)hlen;
    return root;
}

/* A checked safetensors file, open for reading the tensors' bytes. */
typedef struct st_file {
    FILE *f;
    const char *path; /* borrowed */
    int64_t data_start, data_len;
    int64_t n;
    st_entry *e; /* in data order; names owned (ag__strdup) */
    int nmeta;
    char **meta; /* key, value, ... (owned) */
} st_file;

static void st_close(st_file *sf) {
    if (sf->f)
        fclose(sf->f);
    for (int64_t i = 0; i < sf->n; i++)
        ag__free((char *)sf->e[i].name);
    ag__free(sf->e);
    for (int k = 0; k < 2 * sf->nmeta; k++)
        ag__free(sf->meta[k]);
    ag__free(sf->meta);
    memset(sf, 0, sizeof *sf);
}

/* Checks the parsed header (every entry, __metadata__, the offsets tiling the data) and copies
 * what later steps need out of it. */
static int st_index(st_file *sf, json_t *root) {
    size_t nfile = json_object_size(root);
    st_entry *fe = ag__calloc(nfile ? nfile : 1, sizeof *fe);
    if (!fe)
        return AG_ENOMEM;
    sf->e = fe;
    int64_t n = 0;
    int rc = 0;
    const char *key;
    json_t *v, *meta = NULL;
    json_object_foreach(root, key, v) {
        if (!strcmp(key, "__metadata__")) {
            rc = check_metadata(sf->path, v);
            meta = v;
        } else {
            rc = parse_entry(sf->path, key, v, sf->data_len, &fe[n++]);
        }
        if (rc)
            break;
    }
    if (!rc)
        rc = check_tiling(sf->path, fe, n, sf->data_len);
    /* The names now point into the header: own copies (freed by st_close from sf->n on). */
    for (int64_t i = 0; i < n; i++)
        fe[i].name = rc ? NULL : ag__strdup(fe[i].name);
    sf->n = rc ? 0 : n;
    for (int64_t i = 0; i < sf->n && !rc; i++)
        if (!fe[i].name)
            rc = AG_ENOMEM;
    if (!rc && meta && json_object_size(meta)) {
        size_t nm = json_object_size(meta);
        if (!(sf->meta = ag__calloc(2 * nm, sizeof *sf->meta)))
            return AG_ENOMEM;
        json_object_foreach(meta, key, v) {
            int k = sf->nmeta++;
            sf->meta[2 * k] = ag__strdup(key);
            sf->meta[2 * k + 1] = ag__strdup(json_string_value(v));
            if (!sf->meta[2 * k] || !sf->meta[2 * k + 1])
                return AG_ENOMEM;
        }
    }
    return rc;
}

/* Opens and checks path: the header and every entry (no tensor data is read yet). 0, or a
 * status with nothing left open. */
static int st_open(const char *path, st_file *sf) {
    memset(sf, 0, sizeof *sf);
    sf->path = path;
    FILE *f = fopen(path, "rb");
    if (!f)
        return ag__err(AG_EIO, "load: cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) || !S_ISREG(st.st_mode)) {
        fclose(f);
        return ag__err(AG_EIO, "load: '%s' is not a regular file", path);
    }
    sf->f = f;
    int64_t fsize = (int64_t)st.st_size, hlen = 0;
    json_t *root = read_header(f, path, fsize, &hlen);
    if (!root) {
        st_close(sf);
        return ag__nn_status();
    }
    sf->data_start = 8 + hlen;
    sf->data_len = fsize - 8 - hlen;
    json_hooks h = json_enter(); /* json_object_foreach may not allocate, but decref frees */
    int rc = st_index(sf, root);
    json_decref(root);
    json_leave(h);
    if (rc) {
        st_close(sf);
        return rc < 0 ? rc : AG_ENOMEM;
    }
    return 0;
}

/* Reads entry e's bytes into dst (contiguous, e's dtype and size). */
static int st_read(st_file *sf, const st_entry *e, ag_tensor *dst) {
    size_t nbytes = (size_t)(e->end - e->begin);
    if (!nbytes)
        return 0;
    if (fseeko(sf->f, (off_t)(sf->data_start + e->begin), SEEK_SET) ||
        fread(ag_tensor_data(dst), 1, nbytes, sf->f) != nbytes)
        return ag__err(AG_EIO, "load: cannot read '%s' from '%s'", e->name, sf->path);
    if (dst->dtype == AG_BOOL) {
        /* Any nonzero byte is true; a C bool must hold exactly 0 or 1. */
        unsigned char *u = ag_tensor_data(dst);
        for (size_t k = 0; k < nbytes; k++)
            u[k] = u[k] != 0;
    }
    return 0;
}

/* ---- named tensors ---- */

void ag_tensor_dict_free(ag_tensor_dict *d) {
    if (!d)
        return;
    for (int i = 0; i < d->n; i++) {
        ag__free(d->names ? d->names[i] : NULL);
        ag_tensor_free(d->tensors ? d->tensors[i] : NULL);
    }
    for (int k = 0; k < d->nmeta; k++) {
        ag__free(d->meta_keys ? d->meta_keys[k] : NULL);
        ag__free(d->meta_values ? d->meta_values[k] : NULL);
    }
    ag__free(d->names);
    ag__free(d->tensors);
    ag__free(d->meta_keys);
    ag__free(d->meta_values);
    memset(d, 0, sizeof *d);
}

ag_tensor *ag_tensor_dict_get(const ag_tensor_dict *d, const char *name) {
    for (int i = 0; d && name && i < d->n; i++)
        if (!strcmp(d->names[i], name))
            return d->tensors[i];
    return NULL;
}

const char *ag_tensor_dict_meta(const ag_tensor_dict *d, const char *key) {
    for (int k = 0; d && key && k < d->nmeta; k++)
        if (!strcmp(d->meta_keys[k], key))
            return d->meta_values[k];
    return NULL;
}

static char *entry_shape_str(const st_entry *e, char *buf, size_t n) {
    if (e->ndim > AG_MAX_DIMS)
        snprintf(buf, n, "(more than %d dims)", AG_MAX_DIMS);
    else
        ag__fmt_sizes(buf, n, e->ndim, e->sizes);
    return buf;
}

int ag_safetensors_load(const char *path, ag_tensor_dict *out) {
    AG__CHECK_NULL("safetensors_load", out);
    memset(out, 0, sizeof *out);
    AG__CHECK_NULL("safetensors_load", path);
    st_file sf;
    int rc = st_open(path, &sf);
    if (rc)
        return rc;
    ag_tensor_dict d = {0};
    for (int64_t i = 0; i < sf.n && !rc; i++) {
        char b[160];
        if (sf.e[i].dtype < 0)
            rc = ag__err(AG_ENOTSUP, "load: '%s' in '%s' has dtype %s, which aotgrad does not have",
                         sf.e[i].name, path, sf.e[i].dtype_name);
        else if (sf.e[i].ndim > AG_MAX_DIMS)
            rc = ag__err(AG_ENOTSUP, "load: '%s' in '%s' has shape %s", sf.e[i].name, path,
                         entry_shape_str(&sf.e[i], b, sizeof b));
        else if (sf.n > INT32_MAX)
            rc = ag__err(AG_ENOTSUP, "load: '%s' holds more than %d tensors", path, INT32_MAX);
    }
    if (!rc && sf.n) {
        d.names = ag__calloc((size_t)sf.n, sizeof *d.names);
        d.tensors = ag__calloc((size_t)sf.n, sizeof *d.tensors);
        rc = d.names && d.tensors ? 0 : AG_ENOMEM;
    }
    for (int64_t i = 0; i < sf.n && !rc; i++) {
        const st_entry *e = &sf.e[i];
        d.n++;
        d.names[i] = ag__strdup(e->name);
        d.tensors[i] = ag__tensor_new((ag_dtype)e->dtype, e->ndim, e->sizes, false);
        if (!d.names[i] || !d.tensors[i])
            rc = AG_ENOMEM;
        else
            rc = st_read(&sf, e, d.tensors[i]);
    }
    if (!rc && sf.nmeta) {
        d.meta_keys = ag__calloc((size_t)sf.nmeta, sizeof *d.meta_keys);
        d.meta_values = ag__calloc((size_t)sf.nmeta, sizeof *d.meta_values);
        if (!d.meta_keys || !d.meta_values) {
            rc = AG_ENOMEM;
        } else { /* moved from sf */
            d.nmeta = sf.nmeta;
            for (int k = 0; k < sf.nmeta; k++) {
                d.meta_keys[k] = sf.meta[2 * k];
                d.meta_values[k] = sf.meta[2 * k + 1];
            }
            sf.nmeta = 0;
        }
    }
    st_close(&sf);
    if (rc) {
        ag_tensor_dict_free(&d);
        return rc < 0 ? rc : AG_ENOMEM;
    }
    *out = d;
    return 0;
}

/* ---- module state ---- */

void ag_load_report_free(ag_load_report *r) {
    if (!r)
        return;
    for (int i = 0; i < r->nmissing; i++)
        ag__free(r->missing[i]);
    for (int i = 0; i < r->nunexpected; i++)
        ag__free(r->unexpected[i]);
    ag__free(r->missing);
    ag__free(r->unexpected);
    memset(r, 0, sizeof *r);
}

static const st_entry *find_entry(const st_entry *src, int64_t n, const char *name) {
    for (int64_t i = 0; i < n; i++)
        if (!strcmp(src[i].name, name))
            return &src[i];
    return NULL;
}

static int report_add(char ***list, int *n, const char *name) {
    char **grown = ag__malloc(sizeof *grown * (size_t)(*n + 1));
    char *s = ag__strdup(name);
    if (!grown || !s) {
        ag__free(grown);
        ag__free(s);
        return AG_ENOMEM;
    }
    if (*n)
        memcpy(grown, *list, sizeof *grown * (size_t)*n);
    ag__free(*list);
    *list = grown;
    (*list)[(*n)++] = s;
    return 0;
}

/* Matches the state dict's entries src[0..nsrc) (from `where`: a path or "the state dict")
 * against the module: keep holds the module's state tensors (deduplicated), all every name they
 * are reachable under. Sets ents[i] to keep tensor i's entry (NULL when missing and
 * non-strict) and fills rep. Every check happens here, before any tensor is written. */
static int match(const char *where, const st_entry *src, int64_t nsrc, const ag_named_tensors *keep,
                 const ag_named_tensors *all, const ag_load_opts *opts, const st_entry **ents,
                 ag_load_report *rep) {
    for (int64_t i = 0; i < nsrc; i++) {
        bool known = false;
        for (int k = 0; k < all->n && !known; k++)
            known = !strcmp(all->names[k], src[i].name);
        if (known)
            continue;
        if (!opts->non_strict)
            return ag__err(AG_EINVAL, "load: '%s' holds '%s', which the module does not have",
                           where, src[i].name);
        if (report_add(&rep->unexpected, &rep->nunexpected, src[i].name))
            return AG_ENOMEM;
    }
    for (int i = 0; i < keep->n; i++) {
        const char *name = keep->names[i];
        ag_tensor *t = keep->tensors[i];
        const st_entry *e = ents[i] = find_entry(src, nsrc, name);
        if (!e) {
            if (!opts->non_strict)
                return ag__err(AG_EINVAL, "load: '%s' is missing from '%s'", name, where);
            if (report_add(&rep->missing, &rep->nmissing, name))
                return AG_ENOMEM;
            continue;
        }
        bool convert = opts->convert_dtype && ag_dtype_is_float(t->dtype) && e->dtype >= 0;
        if (e->dtype != (int)t->dtype && !convert)
            return ag__err(
                AG_EINVAL, "load: '%s' has dtype %s in '%s', the module's is %s%s", name,
                e->dtype_name, where, st_dtype[t->dtype],
                e->dtype >= 0 && ag_dtype_is_float(t->dtype) ? " (convert_dtype converts it)" : "");
        if (!(e->ndim == t->ndim &&
              !memcmp(e->sizes, t->sizes, sizeof(int64_t) * (size_t)t->ndim))) {
            char a[160], b[160];
            return ag__err(AG_EINVAL, "load: '%s' has shape %s in '%s', the module's is %s", name,
                           entry_shape_str(e, a, sizeof a), where,
                           ag__fmt_sizes(b, sizeof b, t->ndim, t->sizes));
        }
        if (!t->storage->data)
            return ag__err(AG_EINVAL, "load: '%s' is a meta tensor (it has no data)", name);
    }
    return 0;
}

/* Staging tensors, made before anything is written: from a file, one of the file's dtype for
 * a module tensor that is not contiguous or has another dtype. */
static int make_stages(const ag_named_tensors *keep, const st_entry **ents, ag_tensor **stage) {
    for (int i = 0; i < keep->n; i++) {
        ag_tensor *t = keep->tensors[i];
        if (!ents[i] || (ents[i]->dtype == (int)t->dtype && ag_tensor_is_contiguous(t)))
            continue;
        if (!(stage[i] = ag__tensor_new((ag_dtype)ents[i]->dtype, t->ndim, t->sizes, false)))
            return AG_ENOMEM;
    }
    return 0;
}

/* Loads the entries src (a file's when sf is given, else the dict's tensors) into m. */
static int load_entries(ag_module *m, const char *where, st_file *sf, const st_entry *src,
                        int64_t nsrc, const ag_load_opts *opts, ag_load_report *report) {
    ag_load_opts strict = {0};
    ag_load_report rep = {0};
    if (!opts)
        opts = &strict;
    ag_named_tensors keep = {0}, all = {0};
    const st_entry **ents = NULL;
    ag_tensor **stage = NULL;
    int rc = ag__nn_state_tensors(m, true, &keep);
    if (!rc)
        rc = ag__nn_state_tensors(m, false, &all);
    if (!rc) {
        ents = ag__calloc(keep.n ? (size_t)keep.n : 1, sizeof *ents);
        stage = ag__calloc(keep.n ? (size_t)keep.n : 1, sizeof *stage);
        if (!ents || !stage)
            rc = AG_ENOMEM;
    }
    if (!rc)
        rc = match(where, src, nsrc, &keep, &all, opts, ents, &rep);
    if (!rc && sf)
        rc = make_stages(&keep, ents, stage);
    /* From here on only a failed read (the file changed under us, or an I/O error) can fail. */
    for (int i = 0; i < keep.n && !rc; i++) {
        ag_tensor *t = keep.tensors[i];
        if (!ents[i])
            continue;
        if (sf) {
            rc = st_read(sf, ents[i], stage[i] ? stage[i] : t);
            if (!rc && stage[i])
                rc = ag__copy_into(t, stage[i]);
        } else {
            rc = ag__copy_into(t, ents[i]->src);
        }
        ag_tensor_bump_version(t);
    }
    for (int i = 0; stage && i < keep.n; i++)
        ag_tensor_free(stage[i]);
    ag__free(stage);
    ag__free(ents);
    ag_named_tensors_free(&keep);
    ag_named_tensors_free(&all);
    if (rc || !report)
        ag_load_report_free(&rep);
    else
        *report = rep;
    return rc;
}

int ag_module_load_ex(ag_module *m, const char *path, const ag_load_opts *opts,
                      ag_load_report *report) {
    if (report)
        memset(report, 0, sizeof *report);
    AG__CHECK_NULL("module_load_ex", m);
    AG__CHECK_NULL("module_load_ex", path);
    st_file sf;
    int rc = st_open(path, &sf);
    if (!rc)
        rc = load_entries(m, path, &sf, sf.e, sf.n, opts, report);
    st_close(&sf);
    return rc;
}

int ag_module_load(ag_module *m, const char *path) {
    AG__CHECK_NULL("module_load", m);
    AG__CHECK_NULL("module_load", path);
    return ag_module_load_ex(m, path, NULL, NULL);
}

int ag_module_load_dict(ag_module *m, const ag_tensor_dict *sd, const ag_load_opts *opts,
                        ag_load_report *report) {
    if (report)
        memset(report, 0, sizeof *report);
    AG__CHECK_NULL("module_load_dict", m);
    AG__CHECK_NULL("module_load_dict", sd);
    if (sd->n < 0 || (sd->n > 0 && (!sd->names || !sd->tensors)))
        return ag__err(AG_EINVAL, "module_load_dict: the dict's %s (n = %d)",
                       sd->n < 0 ? "count is negative" : "names or tensors are NULL", sd->n);
    st_entry *src = ag__calloc(sd->n > 0 ? (size_t)sd->n : 1, sizeof *src);
    if (!src)
        return AG_ENOMEM;
    int rc = 0;
    for (int i = 0; i < sd->n && !rc; i++) {
        ag_tensor *t = sd->tensors[i];
        if (!sd->names[i] || !t || !t->storage->data) {
            rc = ag__err(AG_EINVAL, "module_load_dict: entry %d (%s) has %s", i,
                         sd->names[i] ? sd->names[i] : "no name",
                         !sd->names[i] ? "no name"
                         : !t          ? "no tensor"
                                       : "a meta tensor (no data)");
            break;
        }
        src[i] = (st_entry){.dtype = (int)t->dtype,
                            .dtype_name = st_dtype[t->dtype],
                            .ndim = t->ndim,
                            .name = sd->names[i],
                            .src = t};
        memcpy(src[i].sizes, t->sizes, sizeof(int64_t) * (size_t)t->ndim);
    }
    if (!rc)
        rc = load_entries(m, "the state dict", NULL, src, sd->n, opts, report);
    ag__free(src);
    return rc;
}
