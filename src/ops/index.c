/* Placeholder: this family's ops are being written. */
#include "kernel_util.h"
#include "family.h"

const ag_opdef *const ag__ops_index[] = {
    NULL,
};
