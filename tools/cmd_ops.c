/* `aotgrad ops [--json]`: the op table as a table or as JSON (name, flags, dtypes with kernels,
 * differentiable, has_backward, has_gradcheck). */
#include "cli.h"
#include "ops/samples.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>

static const char *const flag_names[] = {
    "pointwise",         "reduction",    "view",    "inplace",   "random",
    "compute_intensive", "nondiff",      "factory", "effectful", "backward_helper",
    "composite",         "inplace_view", "fill",
};

static int gradcheck_cases(const ag_op *op) {
    ag__sample *items;
    int n;
    if (ag__samples_collect(op, &items, &n))
        return 0;
    ag__samples_free(items, n);
    return n;
}

/* Views need no kernel; composites run their decomposition: both "have" every dtype the
 * definition lists. */
static json_t *dtypes_json(const ag_opdef *d) {
    json_t *a = json_array();
    for (int dt = 0; dt < AG_NDTYPES; dt++)
        if (d->dtypes & (1u << dt))
            json_array_append_new(a, json_string(ag_dtype_short((ag_dtype)dt)));
    return a;
}

int cli_ops(int argc, char **argv) {
    bool as_json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            as_json = true;
        else {
            fprintf(stderr, "aotgrad ops: unknown option '%s' (usage: aotgrad ops [--json])\n",
                    argv[i]);
            return 2;
        }
    }
    int n = ag_op_count();
    json_t *arr = json_array();
    if (!as_json)
        printf("%-52s %-34s %-16s %-5s %-5s %s\n", "op", "flags", "dtypes", "diff", "bwd",
               "gradcheck");
    int ndiff = 0, nbwd = 0, ngc = 0;
    for (int i = 0; i < n; i++) {
        const ag_op *op = ag_op_at(i);
        const ag_opdef *d = ag_op_def(op);
        bool diff = !(d->flags & AG_OP_NONDIFF);
        bool has_bwd = d->backward != NULL || (d->flags & AG_OP_COMPOSITE);
        int cases = gradcheck_cases(op);
        ndiff += diff;
        nbwd += has_bwd;
        ngc += cases > 0;
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(ag_op_name(op)));
        json_t *fl = json_array();
        char flags[256] = "";
        size_t k = 0;
        for (size_t f = 0; f < sizeof flag_names / sizeof flag_names[0]; f++)
            if (d->flags & (1u << f)) {
                json_array_append_new(fl, json_string(flag_names[f]));
                k += (size_t)snprintf(flags + k, sizeof flags - k, "%s%s", k ? "," : "",
                                      flag_names[f]);
            }
        json_object_set_new(o, "flags", fl);
        json_t *dts = dtypes_json(d);
        json_object_set_new(o, "dtypes", dts);
        json_object_set_new(o, "differentiable", json_boolean(diff));
        json_object_set_new(o, "has_backward", json_boolean(has_bwd));
        json_object_set_new(o, "has_gradcheck", json_boolean(cases > 0));
        json_object_set_new(o, "schema", json_string(d->schema));
        if (as_json) {
            json_array_append_new(arr, o);
        } else {
            char dt[64] = "";
            size_t m = 0;
            for (size_t j = 0; j < json_array_size(dts); j++)
                m += (size_t)snprintf(dt + m, sizeof dt - m, "%s%s", j ? "," : "",
                                      json_string_value(json_array_get(dts, j)));
            printf("%-52s %-34s %-16s %-5s %-5s %s\n", ag_op_name(op), k ? flags : "-", dt,
                   diff ? "yes" : "no", has_bwd ? (d->backward ? "yes" : "decomp") : "no",
                   cases ? "yes" : (diff ? "MISSING" : "-"));
            json_decref(o);
        }
    }
    if (as_json) {
        char *s = json_dumps(arr, JSON_INDENT(2));
        if (!s) {
            fprintf(stderr, "aotgrad ops: out of memory\n");
            json_decref(arr);
            return 1;
        }
        puts(s);
        free(s);
    } else {
        printf("\n%d ops: %d differentiable, %d with a backward rule or decomposition, %d with "
               "gradcheck cases\n",
               n, ndiff, nbwd, ngc);
    }
    json_decref(arr);
    return 0;
}
