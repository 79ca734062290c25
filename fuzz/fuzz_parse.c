/* libFuzzer target for the graph text parser (ag_graph_parse).
 *
 * In: any byte string. Checked: the parser returns a graph or NULL with a "line L:C: ..."
 * message (never a crash, hang, leak or undefined behaviour: the build adds ASan and UBSan),
 * and an accepted text is a fixed point after one round: the parsed graph verifies, its
 * printed text parses again and prints identically, and the DOT writer accepts it.
 * Built and run by scripts/fuzz.sh (fuzz/CMakeLists.txt); seeds live in fuzz/corpus/. */
#include <aotgrad.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void fail(const char *what, const char *detail, const char *text) {
    fprintf(stderr, "fuzz_parse: %s: %s\n--- text ---\n%s\n", what, detail, text ? text : "");
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ag_zoo_log_value_op(); /* an effectful user op, so with_effects lines can name one */
    ag_graph *g = ag_graph_parse((const char *)data, size);
    if (!g) {
        const char *e = ag_last_error();
        if (ag_last_status() != AG_ENOMEM && strncmp(e, "line ", 5))
            fail("error message without a position", e, NULL);
        return 0;
    }
    ag_print_opts po = {.seq_nr = true, .stack_trace = true, .module_stack = true};
    char *s1 = ag_graph_to_string(g, &po);
    if (!s1)
        fail("print failed", ag_last_error(), NULL);
    if (ag_graph_verify(g))
        fail("parsed graph does not verify", ag_last_error(), s1);
    ag_graph *g2 = ag_graph_parse(s1, strlen(s1));
    if (!g2)
        fail("printed text does not parse", ag_last_error(), s1);
    char *s2 = ag_graph_to_string(g2, &po);
    if (!s2 || strcmp(s1, s2))
        fail("print(parse(print(g))) != print(g)", s2 ? s2 : "(null)", s1);
    char *dot = ag_graph_to_dot(g2, NULL);
    if (!dot)
        fail("to_dot failed", ag_last_error(), s1);
    ag_free(dot);
    ag_free(s1);
    ag_free(s2);
    ag_graph_free(g2);
    ag_graph_free(g);
    return 0;
}
