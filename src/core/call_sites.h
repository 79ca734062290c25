/* Call sites (include/aotgrad/trace.h, "Call sites"): the thread's current site, recorded by
 * the entry-point macros of aotgrad/sites.h, and the outer frames that module calls and
 * annotated functions push. Kept here, below every layer that pushes frames (src/nn's module
 * calls, src/trace's annotated functions); the tracer reads them to build stack traces. */
#ifndef AG_CALL_SITES_H
#define AG_CALL_SITES_H

#include "internal.h"

typedef struct ag__site {
    const char *file; /* __FILE__ pointers: compared by address */
    int line;
    const char *func;
} ag__site;

#define AG__MAX_FRAMES 32

typedef struct ag__sites {
    ag__site cur;                    /* the last site recorded */
    ag__site frames[AG__MAX_FRAMES]; /* outer frames, outermost first */
    int nframes;                     /* may exceed AG__MAX_FRAMES: deeper ones are counted */
    uint64_t gen;                    /* bumped whenever the frames or cur change */
} ag__sites;

/* The calling thread's sites (never NULL). Whoever changes them bumps gen. */
ag__sites *ag__sites_tls(void);

#endif
