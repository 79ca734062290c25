/* ag_version: the library's version at run time (the header's AG_VERSION_STRING when it was
 * built). */
#include "aotgrad/core.h"

const char *ag_version(void) {
    return AG_VERSION_STRING;
}
