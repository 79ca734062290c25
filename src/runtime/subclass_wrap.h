/* The compiled callable's tensor subclass wrapper (runtime/subclass_wrap.c), upstream's
 * AOTDispatchSubclassWrapper, and the parts of compiled.c it builds on. */
#ifndef AG_RUNTIME_SUBCLASS_H
#define AG_RUNTIME_SUBCLASS_H

#include "../export/subclass_flatten.h"
#include "aotgrad/compile.h"

/* compiled.c: the call on the flattened (plain) inputs, returning the flattened outputs; what
 * ag_compiled_call is for a joint without subclasses. */
int ag__compiled_call_flat(ag_compiled *c, ag_tensor *const *inputs, int ninputs, ag_tensor **outs,
                           int max_out);

/* ag_compiled_call for a joint with subclasses: checks and unwraps the outer inputs (a node
 * per subclass input that requires grad turns the inner gradients back into one instance),
 * runs ag__compiled_call_flat, and wraps the outputs (a node per subclass output that carries
 * a gradient takes the incoming instance gradient apart). Returns the outer output count. */
int ag__subx_call(ag_compiled *c, ag__subx_info *info, ag_tensor *const *inputs, int ninputs,
                  ag_tensor **outs, int max_out);


#endif
