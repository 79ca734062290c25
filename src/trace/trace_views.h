/* View-aware functionalization for the tracer (trace_views.c): what trace.c and the joint
 * export share. Internal to the library. */
#ifndef AG_TRACE_VIEWS_H
#define AG_TRACE_VIEWS_H

#include "../graph/graph_internal.h"

/* The storages a functionalizing session saw data mutations on (or that the export registered
 * as input bases): per storage the base geometry, the node holding the base's current value
 * and a generation that every data mutation bumps. A tensor whose trace_ver is older than its
 * storage's generation is stale: its node is regenerated from the base. */
typedef struct ag__alias_table ag__alias_table;

/* trace.c: a call node of op in T's graph with the session's node metadata (seq_nr, tag,
 * annotations, stack trace). NULL with the error set. */
ag_node *ag__tracer_call(ag__tracer *T, const ag_op *op, const ag_garg *args, int nargs);
/* trace.c: the session's alias table (created on first use), NULL when out of memory. */
ag__alias_table *ag__tracer_aliases(ag__tracer *T, bool create);

/* trace_views.c */
ag__alias_table *ag__alias_table_new(void); /* NULL with AG_ENOMEM */
void ag__alias_table_free(ag__alias_table *a);
/* The generation t's node must carry to be current (0 when t's storage has no entry). */
uint64_t ag__alias_current_ver(const ag__alias_table *a, const ag_tensor *t);
/* Called by node_of for a bound tensor: t's node, regenerated from its storage's base (as
 * as_strided of the base's current value, or the base node itself when t has the base's
 * geometry) when t is stale. NULL with the error set. */
ag_node *ag__alias_refresh(ag__tracer *T, ag__alias_table *a, ag_tensor *t);
/* Records that t (bound to its node before the mutation) now holds value v, after a data
 * mutation: the base of t's storage becomes v (t has the base's geometry) or
 * as_strided_scatter(base, v, t's geometry relative to the base); the generation is bumped
 * and t is bound to v. The first mutation of a storage registers its base: t's ._base, or t.
 * 0 or a negative status naming `op`. */
int ag__alias_data_mutation(ag__tracer *T, ag__alias_table *a, const char *op, ag_tensor *t,
                            ag_node *v);
/* Binds t to v after a metadata-only mutation (or any rebinding that keeps the data). */
void ag__alias_bind(ag__tracer *T, ag__alias_table *a, ag_tensor *t, ag_node *v);

/* For the export. Registers `base` (bound already) as the base of its storage before any
 * mutation; an error if the storage has an entry. */
int ag__tracer_alias_register(ag__tracer *T, ag_tensor *base);
/* The number of data mutations seen on t's storage, and the node of the storage's base value
 * (NULL when the storage has no entry). */
uint64_t ag__tracer_storage_mutations(ag__tracer *T, const ag_tensor *t);
ag_node *ag__tracer_storage_base(ag__tracer *T, const ag_tensor *t);

#endif
