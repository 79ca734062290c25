/* Module stacks' text: nn_module_stack and fwd_nn_module_stack (include/aotgrad/graph.h,
 * "module stacks"; the node accessors are in modstack.c). A stack's text is the Python repr of
 * upstream's dict,
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

/* Reads text s as a stack: o->count frames, frame `want` (>= 0) decoded into o->f. Returns 0,
 * 1 when s is not a stack's text (o->why says why; nothing decoded is kept), or AG_ENOMEM. */
int ag__modstack_scan(const char *s, int want, ag__modstack_scan_out *o) {
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
    ag__modstack_scan_out o;
    int rc = ag__modstack_scan(s, -1, &o);
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
