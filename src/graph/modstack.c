/* Module stacks: nn_module_stack and fwd_nn_module_stack (include/aotgrad/graph.h, "module
 * stacks"). A stack's text is the Python repr of upstream's dict,
 * {'L__self__': ('', 'GPT'), 'L__self__lm_head': ('lm_head', 'Linear')}; it is both the stored
 * form and the printed one, so a stack costs a node one metadata entry pointing at a string
 * its graph keeps once (ag__graph_shared_str), and the printer writes it as it is. This file
 * builds that text, checks it (exactly the spelling built here: anything else stored under the
 * keys would not print back to the same graph) and reads frames back out of it. */
#include "text_internal.h"
#include "../core/pystr.h"

#include <stdio.h>

static void put_frame(ag__sbuf *b, const char *key, const char *path, const char *type) {
    ag__sb_pystr(b, key, strlen(key));
    ag__sb_puts(b, ": (");
    ag__sb_pystr(b, path, strlen(path));
    ag__sb_puts(b, ", ");
    ag__sb_pystr(b, type, strlen(type));
    ag__sb_putc(b, ')');
}

char *ag__modstack_push(const char *parent, const char *key, const char *path, const char *type) {
    ag__sbuf b = {0};
    if (parent && strlen(parent) > 2) { /* "{...}": drop the '}' and go on after a comma */
        ag__sb_putn(&b, parent, strlen(parent) - 1);
        ag__sb_puts(&b, ", ");
    } else {
        ag__sb_putc(&b, '{');
    }
    put_frame(&b, key, path, type);
    ag__sb_putc(&b, '}');
    return ag__sb_finish(&b);
}

/* ---- reading ---- */

/* The string literal at *p (ending before end), when it is spelled as ag__sb_pystr spells its
 * value: advances *p past it and stores the value in *out (ag__malloc) unless out is NULL.
 * Returns 0, 1 when the text there is no such literal, or AG_ENOMEM. */
static int literal(const char **p, const char *end, char **out) {
    const char *s = *p;
    size_t used = 0, len = 0;
    char *v = NULL;
    ag__pystr_err e;
    int rc = ag__pystr_parse(s, (size_t)(end - s), 0, NULL, NULL, &used, &v, &len, &e);
    if (rc == AG_ENOMEM)
        return rc;
    if (rc)
        return 1;
    size_t need = ag__pystr_repr(v, len, NULL, 0);
    bool same = need == used;
    if (same) {
        char small[256];
        char *buf = need < sizeof small ? small : ag__malloc(need + 1);
        if (!buf) {
            ag__free(v);
            return AG_ENOMEM;
        }
        ag__pystr_repr(v, len, buf, need + 1);
        same = !memcmp(buf, s, need);
        if (buf != small)
            ag__free(buf);
    }
    if (!same) {
        ag__free(v);
        return 1;
    }
    *p = s + used;
    if (out)
        *out = v;
    else
        ag__free(v);
    return 0;
}

static bool accept(const char **p, const char *end, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(end - *p) < n || memcmp(*p, word, n))
        return false;
    *p += n;
    return true;
}

typedef struct scan_out {
    int count;
    const char *why;  /* when the text is not a stack: what is wrong */
    int dup_a, dup_b; /* frames with the same key, for the message */
    char *f[3];       /* the wanted frame's key, path and type */
} scan_out;

/* Reads text s as a stack: o->count frames, frame `want` (>= 0) decoded into o->f. Returns 0,
 * 1 when s is not a stack's text (o->why says why; nothing decoded is kept), or AG_ENOMEM. */
static int scan(const char *s, int want, scan_out *o) {
    const char *p = s, *end = s + strlen(s);
    struct {
        const char *p;
        size_t n;
    } keys[AG_MODULE_STACK_MAX];
    memset(o, 0, sizeof *o);
    int rc = 0;
    if (!accept(&p, end, "{")) {
        o->why = "it does not start with '{'";
        return 1;
    }
    if (!accept(&p, end, "}")) {
        for (;;) {
            if (o->count == AG_MODULE_STACK_MAX) {
                o->why = "it has too many frames";
                rc = 1;
                break;
            }
            bool mine = o->count == want;
            const char *k0 = p;
            rc = literal(&p, end, mine ? &o->f[0] : NULL);
            keys[o->count].p = k0;
            keys[o->count].n = (size_t)(p - k0);
            if (rc == 0 && !accept(&p, end, ": ("))
                rc = 1;
            if (rc == 0)
                rc = literal(&p, end, mine ? &o->f[1] : NULL);
            if (rc == 0 && !accept(&p, end, ", "))
                rc = 1;
            if (rc == 0)
                rc = literal(&p, end, mine ? &o->f[2] : NULL);
            if (rc == 0 && !accept(&p, end, ")"))
                rc = 1;
            if (rc) {
                o->why = "a frame is not ('KEY': ('PATH', 'TYPE')) in Python's quoting";
                break;
            }
            for (int i = 0; i < o->count && !o->why; i++)
                if (keys[i].n == keys[o->count].n && !memcmp(keys[i].p, k0, keys[i].n)) {
                    o->why = "two frames have the same key";
                    o->dup_a = i;
                    o->dup_b = o->count;
                }
            o->count++;
            if (o->why) {
                rc = 1;
                break;
            }
            if (accept(&p, end, "}"))
                break;
            if (!accept(&p, end, ", ")) {
                o->why = "frames are not separated by ', ' and closed by '}'";
                rc = 1;
                break;
            }
        }
    }
    if (rc == 0 && p != end) {
        o->why = "text follows the closing '}'";
        rc = 1;
    }
    if (rc == 0 && want >= o->count)
        rc = 1; /* no such frame: the caller words it */
    if (rc)
        for (int i = 0; i < 3; i++) {
            ag__free(o->f[i]);
            o->f[i] = NULL;
        }
    return rc;
}

int ag__modstack_check(const char *key, ag_mval v) {
    if (v.kind != AG_MV_STR)
        return ag__err(AG_EINVAL,
                       "%s: expected a module stack string {'KEY': ('PATH', 'TYPE'), "
                       "...}, got a value of another kind",
                       key);
    const char *s = v.u.s ? v.u.s : "";
    scan_out o;
    int rc = scan(s, -1, &o);
    if (rc < 0)
        return rc;
    if (rc == 0 && o.count == 0)
        o.why = "it has no frame (remove the key instead)";
    if (rc == 0 && o.count > 0)
        return 0;
    char dup[64] = "";
    if (o.dup_b)
        snprintf(dup, sizeof dup, " (frames %d and %d)", o.dup_a, o.dup_b);
    return ag__err(AG_EINVAL,
                   "%s: '%.80s%s' is not a module stack {'KEY': ('PATH', 'TYPE'), ...} of 1 to "
                   "%d frames as the printer spells it: %s%s",
                   key, s, strlen(s) > 80 ? "..." : "", AG_MODULE_STACK_MAX, o.why ? o.why : "?",
                   dup);
}

/* ---- the typed accessors ---- */

static int stack_len(const ag_node *n, const char *key) {
    ag_mval v = ag_node_meta_get(n, key);
    if (v.kind != AG_MV_STR)
        return 0;
    scan_out o;
    int rc = scan(v.u.s, -1, &o);
    return rc < 0 ? rc : rc ? 0 : o.count;
}

static int stack_frame(const char *what, const ag_node *n, const char *key, int i, char **k,
                       char **path, char **type) {
    char **outs[3] = {k, path, type};
    for (int j = 0; j < 3; j++)
        if (outs[j])
            *outs[j] = NULL;
    AG__CHECK_NULL(what, n);
    ag_mval v = ag_node_meta_get(n, key);
    scan_out o = {0};
    int rc = i >= 0 && v.kind == AG_MV_STR ? scan(v.u.s, i, &o) : 1;
    if (rc < 0)
        return rc;
    if (rc)
        return ag__err(AG_EINVAL, "%s: %s has no frame %d (its %s has %d)", what, ag_node_name(n),
                       i, key, stack_len(n, key));
    for (int j = 0; j < 3; j++) {
        if (outs[j])
            *outs[j] = o.f[j];
        else
            ag__free(o.f[j]);
    }
    return 0;
}

static int set_stack(const char *what, ag_node *n, const char *key, const ag_module_frame *frames,
                     int count) {
    AG__CHECK_NULL(what, n);
    if (count < 0 || count > AG_MODULE_STACK_MAX)
        return ag__err(AG_EINVAL, "%s: %d frames (a stack has 0 to %d)", what, count,
                       AG_MODULE_STACK_MAX);
    if (count == 0)
        return ag_node_meta_del(n, key), 0;
    AG__CHECK_NULL(what, frames);
    const ag_module_frame *f = frames;
    for (int i = 0; i < count; i++) {
        if (!f[i].key || !f[i].path || !f[i].type)
            return ag__err(AG_EINVAL, "%s: frame %d has a NULL %s", what, i,
                           !f[i].key    ? "key"
                           : !f[i].path ? "path"
                                        : "type");
        for (int j = 0; j < i; j++)
            if (!strcmp(f[j].key, f[i].key))
                return ag__err(AG_EINVAL, "%s: frames %d and %d have the same key '%s'", what, j, i,
                               f[i].key);
    }
    char *text = NULL;
    for (int i = 0; i < count; i++) {
        char *next = ag__modstack_push(text, f[i].key, f[i].path, f[i].type);
        ag__free(text);
        if (!(text = next))
            return AG_ENOMEM;
    }
    const char *shared = ag__graph_shared_str(n->graph, text);
    ag__free(text);
    return shared ? ag__node_meta_set_shared(n, key, shared) : AG_ENOMEM;
}

int ag_node_nn_module_stack_len(const ag_node *n) {
    return n ? stack_len(n, "nn_module_stack") : 0;
}
int ag_node_fwd_nn_module_stack_len(const ag_node *n) {
    return n ? stack_len(n, "fwd_nn_module_stack") : 0;
}
int ag_node_nn_module_stack(const ag_node *n, int i, char **key, char **path, char **type) {
    return stack_frame("node_nn_module_stack", n, "nn_module_stack", i, key, path, type);
}
int ag_node_fwd_nn_module_stack(const ag_node *n, int i, char **key, char **path, char **type) {
    return stack_frame("node_fwd_nn_module_stack", n, "fwd_nn_module_stack", i, key, path, type);
}
int ag_node_set_nn_module_stack(ag_node *n, const ag_module_frame *frames, int count) {
    return set_stack("node_set_nn_module_stack", n, "nn_module_stack", frames, count);
}
int ag_node_set_fwd_nn_module_stack(ag_node *n, const ag_module_frame *frames, int count) {
    return set_stack("node_set_fwd_nn_module_stack", n, "fwd_nn_module_stack", frames, count);
}
