/* Poisoning memory the library keeps but nobody may touch (cached tensor data, erased graph
 * nodes), so that AddressSanitizer reports a use after free of it; no-ops in other builds. */
#ifndef AG_CORE_ASAN_H
#define AG_CORE_ASAN_H

#if defined(__SANITIZE_ADDRESS__)
#define AG__ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define AG__ASAN 1
#endif
#endif

#ifdef AG__ASAN
#include <sanitizer/asan_interface.h>
#define AG__POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define AG__UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define AG__POISON(p, n) ((void)(p), (void)(n))
#define AG__UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#endif
