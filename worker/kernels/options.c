/* options.c: pn_init, which hands each part its options (PnOptions, pantheon.h).
 *
 * One struct, passed once, instead of a setter per knob: worker/kernels_cpu.py builds it
 * (from its defaults and the environment) and calls pn_init after loading the library;
 * tests and benchmarks re-init with others (kernels_cpu.options) and restore them after.
 * A negative field takes the default below, each defined and justified beside the code
 * that reads it; each part keeps its value in a static of its own file (amx_min_rows,
 * KTILE_MIN, BG_MIN, XSPAN, DIGITS, attn_generic), written here only. Call it between
 * products, not during one: the kernels read those values as they go. */
#define PN_DEFAULT_OPTIONS {                                                            \
    .threads = 1, .spin_us = 200,                                                       \
    .amx_rows = AMX_MIN_ROWS, .amx_rows_k = AMX_MIN_ROWS_K,     /* amx.c */             \
    .ktile_k = KTILE_K, .ktile_b = KTILE_B,                     /* lanes.c */           \
    .bgroups = BG_MIN_ROWS,                                     /* b_groups.c */        \
    .xspan = XSPAN_BYTES,                                       /* k_rows.c */          \
    .digits = 1,                                                /* digits*.c */         \
    .attn_generic = 0,                                          /* attention.c */       \
}

/* Set the options (NULL: the defaults) and start the pool (the first call only: its
 * threads run until the process ends); returns the pool's threads, the caller included. */
int pn_init(const PnOptions *options) {
    static const PnOptions defaults = PN_DEFAULT_OPTIONS;
    PnOptions o = options ? *options : defaults;
#define PN_DEFAULT(f) if (o.f < 0) o.f = defaults.f
    PN_DEFAULT(threads); PN_DEFAULT(spin_us); PN_DEFAULT(amx_rows); PN_DEFAULT(amx_rows_k);
    PN_DEFAULT(ktile_k); PN_DEFAULT(ktile_b); PN_DEFAULT(bgroups); PN_DEFAULT(xspan);
    PN_DEFAULT(digits); PN_DEFAULT(attn_generic);
#undef PN_DEFAULT
#if defined(PN_AMX)
    amx_min_rows = o.amx_rows, amx_min_rows_k = o.amx_rows_k;
#endif
#if defined(PN_ZMM)
    KTILE_MIN[0] = o.ktile_k, KTILE_MIN[1] = o.ktile_b;
#endif
#if defined(__AVX2__)
    BG_MIN[0] = o.bgroups;
    XSPAN[0] = o.xspan;
    DIGITS[0] = (int)o.digits;
#endif
    attn_generic = (int)o.attn_generic;
    return pn_pool_init((int)o.threads, o.spin_us);
}
