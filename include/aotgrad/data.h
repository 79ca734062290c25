/* Datasets for the main job: IDX files (MNIST / Fashion-MNIST, gzip or raw) and raw text. */
#ifndef AOTGRAD_DATA_H
#define AOTGRAD_DATA_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reads an IDX file (optionally gzip-compressed). Unsigned-byte data becomes float32 scaled by
 * `scale` (e.g. 1/255) when as_float, else int64. Returns a new tensor of the file's shape, or
 * NULL with a message naming the file and what is wrong. */
AG_API ag_tensor *ag_load_idx(const char *path, bool as_float, double scale);

/* Fashion-MNIST from a directory holding the four standard files (Debian's
 * dataset-fashion-mnist installs them in /usr/share/datasets/fashion-mnist): images
 * (N, 1, 28, 28) float32 normalized to mean 0.2860, std 0.3530, labels (N) int64. */
AG_API int ag_fashion_mnist_load(const char *dir, bool train, ag_tensor **images,
                                 ag_tensor **labels);

#ifdef __cplusplus
}
#endif
#endif
