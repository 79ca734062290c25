/* Datasets for the main job: IDX files (MNIST / Fashion-MNIST, gzip or raw) and raw text. */
#ifndef AOTGRAD_DATA_H
#define AOTGRAD_DATA_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reads an IDX file (optionally gzip-compressed). Unsigned-byte data becomes float32 scaled by
 * `scale` (e.g. 1/255) when as_float, else int64. The file must hold exactly the data its
 * header describes (1 to AG_MAX_DIMS dimensions, at most 2^40 elements), with no gzip error.
 * Returns a new tensor of the file's shape (caller frees), or NULL with a message naming the
 * file and what is wrong (AG_EIO: cannot open or read; AG_EFORMAT: not a valid IDX or gzip
 * file; AG_ENOTSUP: an element type other than unsigned bytes). */
AG_API ag_tensor *ag_load_idx(const char *path, bool as_float, double scale);

/* Fashion-MNIST from a directory holding the four standard files (Debian's
 * dataset-fashion-mnist installs them in /usr/share/datasets/fashion-mnist): images
 * (N, 1, 28, 28) float32 normalized to mean 0.2860, std 0.3530, labels (N) int64. The images
 * file must be (N, H, W) and the labels file (N) of class indices 0 to 9, else AG_EFORMAT
 * naming the file. On success *images and *labels are new tensors (caller frees); on failure
 * both are NULL. */
AG_API int ag_fashion_mnist_load(const char *dir, bool train, ag_tensor **images,
                                 ag_tensor **labels);

#ifdef __cplusplus
}
#endif
#endif
