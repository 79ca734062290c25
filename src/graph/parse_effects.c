/* The parser's reading of a with_effects line (see ag_op_with_effects in optable.h):
 *     %with_effects = with_effects(%token, 'ns::op', <the op's arguments>)  # (f32[0], ...)
 * Every with_effects op is named `with_effects` and none is in the registry, so the op of the
 * line is found from its `op` argument: this looks ahead over the first two arguments (the
 * token, given positionally or as token=..., and the wrapped op's name, positionally or as
 * op='...'), picks the with_effects op wrapping that op, and leaves the cursor where it was,
 * so the arguments are then read as any call's. */
#include "parse_internal.h"

/* Accepts `word=` when it is next (after blanks). */
static bool accept_key(ag__tcur *c, const char *word) {
    lx_skip_ws(c);
    size_t n = strlen(word);
    const char *p = c->p + n;
    if (strncmp(c->p, word, n) || lx_ident_char(*p))
        return false;
    while (*p == ' ' || *p == '\t')
        p++;
    if (*p != '=')
        return false;
    c->p = p + 1;
    return true;
}

int ag__lx_with_effects_op(ag__tcur *c, const ag_op **op) {
    const char *save = c->p;
    accept_key(c, "token");
    lx_skip_ws(c);
    if (*c->p != '%')
        return ag__lx_expected(c, "the token ('%name') as with_effects' first argument");
    c->p++;
    char *name;
    int rc = ag__lx_name(c, &name, "a node name");
    if (rc)
        return rc;
    if ((rc = lx_expect(c, ',', "','")))
        return rc;
    accept_key(c, "op");
    lx_skip_ws(c);
    const char *at = c->p;
    if (*c->p != '\'' && *c->p != '"')
        return ag__lx_expected(c, "the wrapped op's name ('ns::op') as with_effects' second "
                                  "argument");
    char *opname;
    if ((rc = ag__lx_str(c, &opname)))
        return rc;
    const ag_op *w = ag_op_find(opname);
    if (!w)
        return ag__lx_err(c, at, "with_effects: unknown op '%s'", opname);
    if (!(*op = ag_op_with_effects(w)))
        return ag_last_status() == AG_ENOMEM ? AG_ENOMEM : ag__lx_err(c, at, "%s", ag_last_error());
    c->p = save;
    return 0;
}
