/* aotgrad: capture a model's training step as a joint forward+backward graph with descriptors,
 * transform it, and compile it back into a fast differentiable callable. Pure C, no Python.
 *
 * This umbrella header is the whole public API; every symbol starts with ag_ or AG_. */
#ifndef AOTGRAD_H
#define AOTGRAD_H

#define AG_VERSION_MAJOR 0
#define AG_VERSION_MINOR 1
#define AG_VERSION_PATCH 0
#define AG_VERSION_STRING "0.1.0"

#include "aotgrad/core.h"
#include "aotgrad/optable.h"
#include "aotgrad/ops.h"
#include "aotgrad/autograd.h"
#include "aotgrad/nn.h"
#include "aotgrad/desc.h"
#include "aotgrad/graph.h"
#include "aotgrad/trace.h"
#include "aotgrad/export.h"
#include "aotgrad/compile.h"
#include "aotgrad/data.h"
#include "aotgrad/zoo.h"
#include "aotgrad/subclass.h"

/* Last: the call-site macros wrap the functions declared above. */
#include "aotgrad/sites.h"

#endif
