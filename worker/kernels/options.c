/* options.c: the options every part reads (OPT, declared in pantheon.c), set by pn_init.
 *
 * One struct instead of a setter per knob: worker/kernels_cpu.py builds it once (from its
 * defaults and the environment) and calls pn_init after loading the library; tests and
 * benchmarks re-init with others (kernels_cpu.options) and restore them after. A
 * negative field takes the default below, each justified beside the code that reads it.
 * Call it between products, not during one: the kernels read OPT as they go. */
static PnOptions OPT = {
    .threads = 1, .spin_us = 200,
    .amx_rows = AMX_MIN_ROWS, .amx_rows_k = AMX_MIN_ROWS_K,     /* amx.c */
    .ktile_k = KTILE_K, .ktile_b = KTILE_B,                     /* lanes.c */
    .bgroups = BG_MIN_ROWS,                                     /* b_groups.c */
    .xspan = XSPAN_BYTES,                                       /* k_rows.c */
    .digits = 1,                                                /* digits.c, digits_avx2.c */
    .attn_generic = 0,                                          /* attention.c */
};

/* Set the options (NULL: the defaults) and start the pool (the first call only: its
 * threads run until the process ends); returns the pool's threads, the caller included. */
int pn_init(const PnOptions *options) {
    static const PnOptions defaults = {
        .threads = 1, .spin_us = 200, .amx_rows = AMX_MIN_ROWS, .amx_rows_k = AMX_MIN_ROWS_K,
        .ktile_k = KTILE_K, .ktile_b = KTILE_B, .bgroups = BG_MIN_ROWS, .xspan = XSPAN_BYTES,
        .digits = 1, .attn_generic = 0};
    PnOptions o = options ? *options : defaults;
#define PN_DEFAULT(f) if (o.f < 0) o.f = defaults.f
    PN_DEFAULT(threads); PN_DEFAULT(spin_us); PN_DEFAULT(amx_rows); PN_DEFAULT(amx_rows_k);
    PN_DEFAULT(ktile_k); PN_DEFAULT(ktile_b); PN_DEFAULT(bgroups); PN_DEFAULT(xspan);
    PN_DEFAULT(digits); PN_DEFAULT(attn_generic);
#undef PN_DEFAULT
    OPT = o;
    return pool_start((int)o.threads, o.spin_us);
}
