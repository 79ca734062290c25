/* The thread's call sites (call_sites.h): ag_site records the caller of a public entry point,
 * ag_site_push / ag_site_pop keep it as an outer frame around a module call or an annotated
 * function. Nothing here allocates or fails. */
#include "call_sites.h"

static _Thread_local ag__sites sites;

ag__sites *ag__sites_tls(void) {
    return &sites;
}

void ag_site(const char *file, int line, const char *func) {
    ag__site *c = &sites.cur;
    if (c->line != line || c->file != file || c->func != func) {
        *c = (ag__site){file, line, func};
        sites.gen++;
    }
}

void ag_site_push(void) {
    if (sites.nframes < AG__MAX_FRAMES)
        sites.frames[sites.nframes] = sites.cur;
    sites.nframes++;
    sites.gen++;
}

void ag_site_pop(void) {
    if (sites.nframes > 0) {
        sites.nframes--;
        if (sites.nframes < AG__MAX_FRAMES)
            sites.cur = sites.frames[sites.nframes];
    }
    sites.gen++;
}
