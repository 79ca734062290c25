/* Gradcheck sample calls collected from the op table (see samples.c). */
#ifndef AG_SAMPLES_H
#define AG_SAMPLES_H

#include "../core/internal.h"

#define AG__SAMPLE_MAX_LIST 8

typedef struct ag__sample {
    char note[64];
    int nargs;
    ag_arg args[AG_MAX_ARGS];
    ag_tensor *lists[AG_MAX_ARGS][AG__SAMPLE_MAX_LIST];
    int64_t ints[AG_MAX_ARGS][AG__SAMPLE_MAX_LIST];
    char strs[AG_MAX_ARGS][16];
} ag__sample;

/* The op's sample calls (tensors owned by the items); free with ag__samples_free. */
int ag__samples_collect(const ag_op *op, ag__sample **items, int *n);
void ag__samples_free(ag__sample *items, int n);

#endif
