/* The types of the facts a joint keeps beside its graph, shared by the export's wrappers
 * (export_wrappers.h), the joint (joint_internal.h), the aliasing code (alias.h) and the
 * compiled callable: how flat inputs become primals and how aliasing outputs are regenerated.
 * Types only; alias.c has the functions. */
#ifndef AG_EXPORT_JOINT_FACTS_H
#define AG_EXPORT_JOINT_FACTS_H

#include "../graph/graph_internal.h"
#include "aotgrad/export.h"

/* ---- the calling convention's aliasing facts (kept by the joint, copied by the compiled
 * callable) ---- */

typedef enum ag__flat_kind {
    AG__FLAT_PRIMAL = 0, /* the flat input is primal `primal` */
    AG__FLAT_DUP,        /* a duplicate of flat input `dup_of`, dropped (strategy 2) */
    AG__FLAT_VIEW,       /* regenerated in the graph from base primal `primal` */
} ag__flat_kind;

typedef enum ag__base_kind {
    AG__BASE_NONE = 0,  /* an ordinary primal: flat input `flat` itself */
    AG__BASE_VIEW,      /* ViewBaseAOTInput: flat input `flat`'s ._base */
    AG__BASE_SYNTHETIC, /* SyntheticBaseAOTInput: flat input `flat`'s whole storage, 1-d */
} ag__base_kind;

typedef struct ag__flat_info {
    ag__flat_kind kind;
    int primal;    /* PRIMAL: its primal; VIEW: the base primal; DUP: the kept input's primal */
    int dup_of;    /* DUP: the flat input it repeats */
    ag_tmeta geom; /* VIEW: its geometry at export, offset relative to the base's */
    int metadata_mutation; /* VIEW: index of its MetadataMutationAOTOutput, or -1 */
    ag_tmeta new_geom;     /* ... and the geometry the forward leaves it with (relative) */
} ag__flat_info;

typedef struct ag__primal_info {
    ag__base_kind base;
    int flat;          /* the flat input it is, or whose base / storage it is */
    ag_tmeta new_geom; /* mutates_metadata: the geometry the forward leaves it with,
                        * offset relative to the primal's own offset at export */
} ag__primal_info;

typedef struct ag__out_info {
    ag_tmeta geom; /* an aliasing output's geometry, offset relative to its base's */
} ag__out_info;

typedef struct ag__joint_alias {
    int nflat, nprimals, nuser;
    ag__flat_info *flat;     /* nflat */
    ag__primal_info *prim;   /* nprimals */
    ag__out_info *out;       /* nuser */
    int nmetadata_mutations; /* MetadataMutationAOTOutput outputs (after the user outputs) */
    int nintermediate_bases; /* IntermediateBaseAOTOutput outputs (after those) */
} ag__joint_alias;

/* Opaque here: the alias plan (alias.c) and the subclass record (subclass_flatten.h). */
typedef struct ag__alias_plan ag__alias_plan;
typedef struct ag__subx_info ag__subx_info;

#endif
