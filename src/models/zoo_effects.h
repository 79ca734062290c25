/* The `effects` zoo model (models/zoo_effects.c), for zoo.c's table. */
#ifndef AG_ZOO_EFFECTS_H
#define AG_ZOO_EFFECTS_H

#include "aotgrad/zoo.h"

ag_module *ag__zoo_build_effects(int *rc);
int ag__zoo_effects_inputs(const char *config, ag_tensor **in);

#endif
