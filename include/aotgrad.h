/* aotgrad: capture a model's training step as a joint forward+backward graph with descriptors,
 * transform it, and compile it back into a fast differentiable callable. Pure C, no Python.
 *
 * This umbrella header is the whole public API; every symbol starts with ag_ or AG_.
 *
 * Threads. The library may be called from several threads at once, from the very first call
 * (the op table is built once, whichever thread gets there first). What is process-wide is
 * safe to use concurrently: the op registry (lookups, ag_op_register), the with_effects
 * wrappers, the zoo (building models) and its effects log. What a thread sets is its own:
 * the error message (ag_last_error), grad mode, autorelease scopes, meta mode and trace
 * sessions (two threads may trace or export different or identical models at once), call
 * sites and annotations, the random generator (core.h: one per thread, unlike torch's one per
 * process) and the OpenMP thread count (ag_set_num_threads). Objects are not locked: a tensor,
 * ag_module, ag_joint, ag_graph, ag_plan, ag_compiled or ag_optim is used by one thread at a
 * time, and objects that share tensors count as one object (a module, its parameters and
 * their gradients, views of them, and the joint, compiled callable and optimizer made from
 * it). Different objects may be used from different threads at once; an object may move to
 * another thread when the threads synchronize (a join, a mutex). Only two calls are not
 * thread-safe: ag_set_allocator (core.h) must run while no other thread is inside the library,
 * and nothing may be called while exit() runs the library's destructors. Kernels run on the
 * OpenMP pool of the calling thread, so n threads each running kernels with m OpenMP threads
 * keep n x m busy: call ag_set_num_threads(cores / n) in each. */
#ifndef AOTGRAD_H
#define AOTGRAD_H

#include "aotgrad/core.h"
#include "aotgrad/optable.h"
#include "aotgrad/ops.h"
#include "aotgrad/autograd.h"
#include "aotgrad/nn.h"
#include "aotgrad/flex_attention.h"
#include "aotgrad/desc.h"
#include "aotgrad/graph.h"
#include "aotgrad/trace.h"
#include "aotgrad/export.h"
#include "aotgrad/compile.h"
#include "aotgrad/data.h"
#include "aotgrad/zoo.h"
#include "aotgrad/subclass.h"
#include "aotgrad/dist.h"
#include "aotgrad/parallel.h"

/* Last: the call-site macros wrap the functions declared above. */
#include "aotgrad/sites.h"

#endif
