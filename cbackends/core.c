/*
 * core.c - the replay core: context, timer, validation, the per-access loop,
 * latency histograms and step composition. Backends only move bytes.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"

static const struct kv_backend_ops *const kv_registry[] = {
    &kv_dram_ops,
    &kv_numa_ops,
    &kv_mmap_ops,
    &kv_uring_ops,
    &kv_emu_ops,
    &kv_vemu_ops,
    &kv_store_ops,
};
#define KV_N_BACKENDS (sizeof(kv_registry) / sizeof(kv_registry[0]))

/* Staging stands for a GPU-side bounce buffer; 64 MiB keeps it cache-cold yet small. */
#define KV_STAGING_MAX_BYTES (64ull << 20)

/* The overlap model walks every model layer per step; this keeps a bad value from hanging it. */
#define KV_MAX_MODEL_LAYERS 65536u

#define KV_TIMER_CALIBRATION_NS 20000000ull

/* ------------------------------------------------------------------ messages */

int kv_fail(struct kv_ctx *ctx, int rc, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(ctx->msg, sizeof(ctx->msg), fmt, ap);
    va_end(ap);
    return rc;
}

void kv_appendf(char *buf, size_t len, size_t *pos, const char *fmt, ...)
{
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(*pos < len ? buf + *pos : NULL, *pos < len ? len - *pos : 0, fmt, ap);
    va_end(ap);
    if (n > 0)
        *pos += (size_t)n;
}

int kv_cancelled_fail(struct kv_ctx *ctx, const char *what)
{
    return kv_fail(ctx, -EINTR, "%s: cancelled", what);
}

void kv_cancel(struct kv_ctx *ctx)
{
    if (ctx)
        __atomic_store_n(&ctx->cancel, 1, __ATOMIC_RELAXED);
}

const char *kv_errmsg(const struct kv_ctx *ctx)
{
    return ctx ? ctx->msg : "";
}

/* --------------------------------------------------------------------- timer */

static uint64_t kv_raw_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC_RAW, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#if defined(KV_HAVE_TSC)
/* Whole-word match in the cpuinfo flags line, so "constant_tsc" does not match "xconstant_tsc". */
static int kv_has_flag(const char *flags, const char *word)
{
    size_t n = strlen(word);

    for (const char *p = strstr(flags, word); p; p = strstr(p + 1, word)) {
        int starts = p == flags || p[-1] == ' ' || p[-1] == '\t' || p[-1] == ':';
        int ends = p[n] == '\0' || p[n] == ' ' || p[n] == '\n';
        if (starts && ends)
            return 1;
    }
    return 0;
}

/*
 * A TSC is only a clock when it ticks at a constant rate (constant_tsc) and
 * keeps ticking in deep C-states (nonstop_tsc); otherwise its ticks are not ns.
 */
static int kv_tsc_is_invariant(void)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char *line = NULL;
    size_t cap = 0;
    int ok = 0;

    if (!f)
        return 0;
    while (getline(&line, &cap, f) > 0) {
        if (strncmp(line, "flags", 5) == 0) {
            ok = kv_has_flag(line, "constant_tsc") && kv_has_flag(line, "nonstop_tsc");
            break;
        }
    }
    free(line);
    fclose(f);
    return ok;
}
#endif

static void kv_timer_init(struct kv_timer *t)
{
    t->use_tsc = 0;
    t->ns_per_tick = 1.0;
    t->tsc_ghz = 0.0;
#if defined(KV_HAVE_TSC)
    if (!kv_tsc_is_invariant())
        return;
    {
        struct kv_timer tsc = { .use_tsc = 1 };
        uint64_t c0 = kv_raw_ns(), t0 = kv_timer_ticks(&tsc);
        uint64_t c1, t1;
        double ghz;

        /* Busy-wait rather than sleep: a sleep may migrate us to a CPU whose TSC is offset. */
        do
            c1 = kv_raw_ns();
        while (c1 - c0 < KV_TIMER_CALIBRATION_NS);
        t1 = kv_timer_ticks(&tsc);
        ghz = (double)(t1 - t0) / (double)(c1 - c0);
        /* A rate outside any real CPU's means the TSC is virtualised badly; trust the clock. */
        if (!(ghz > 0.1 && ghz < 20.0))
            return;
        t->use_tsc = 1;
        t->tsc_ghz = ghz;
        t->ns_per_tick = 1.0 / ghz;
    }
#endif
}

double kv_timer_ghz(const struct kv_ctx *ctx)
{
    if (!ctx)
        return 0.0;
    return ctx->timer.use_tsc ? ctx->timer.tsc_ghz : 1.0;
}

/* ----------------------------------------------------------------- histogram */

static inline uint32_t kv_hist_bucket(uint64_t v)
{
    uint32_t e;

    if (v < KV_HIST_EXACT)
        return (uint32_t)v;
    e = 63u - (uint32_t)__builtin_clzll(v);
    if (e >= KV_HIST_MAX_EXP)
        return KV_HIST_N_BUCKETS - 1;
    return KV_HIST_EXACT + (e - KV_HIST_SUB_BITS) * KV_HIST_EXACT +
           (uint32_t)((v >> (e - KV_HIST_SUB_BITS)) & (KV_HIST_EXACT - 1));
}

uint32_t kv_hist_n_buckets(void)
{
    return KV_HIST_N_BUCKETS;
}

uint64_t kv_hist_bucket_lower_ns(uint32_t i)
{
    uint32_t k, e, sub;

    if (i >= KV_HIST_N_BUCKETS)
        return UINT64_MAX;
    if (i < KV_HIST_EXACT)
        return i;
    k = i - KV_HIST_EXACT;
    e = KV_HIST_SUB_BITS + k / KV_HIST_EXACT;
    sub = k % KV_HIST_EXACT;
    return (uint64_t)(KV_HIST_EXACT + sub) << (e - KV_HIST_SUB_BITS);
}

int kv_op_stats(const struct kv_ctx *ctx, int op, uint64_t *counts, uint32_t n_buckets,
                uint64_t *totals4)
{
    const struct kv_op_hist *h;

    if (!ctx || op < 0 || op >= KV_N_OPS)
        return -EINVAL;
    h = &ctx->stats[op];
    if (counts) {
        if (n_buckets != KV_HIST_N_BUCKETS)
            return -EINVAL;
        memcpy(counts, h->counts, sizeof(h->counts));
    }
    if (totals4) {
        totals4[0] = h->accesses;
        totals4[1] = h->bytes;
        totals4[2] = h->time_ns;
        totals4[3] = h->busy_ns;
    }
    return 0;
}

void kv_stats_reset(struct kv_ctx *ctx)
{
    if (ctx)
        memset(ctx->stats, 0, sizeof(ctx->stats));
}

/* ------------------------------------------------------------------- context */

struct kv_ctx *kv_ctx_new(void)
{
    struct kv_ctx *ctx = calloc(1, sizeof(*ctx));

    if (!ctx)
        return NULL;
    kv_timer_init(&ctx->timer);
    /* The CPU link and serial stores: KV times are the medium's, composed as before links. */
    ctx->timing.engines = 1;
    ctx->timing.line_bytes = 64;
    ctx->refs = 1;
    return ctx;
}

static void kv_free_scratch(struct kv_ctx *ctx)
{
    for (int op = 0; op < KV_N_OPS; op++) {
        free(ctx->layer_ns[op]);
        ctx->layer_ns[op] = NULL;
    }
    free(ctx->layer_store_bytes);
    ctx->layer_store_bytes = NULL;
}

int kv_set_timing(struct kv_ctx *ctx, const struct kv_timing *t)
{
    const double nums[] = { t ? t->load_gbps : 0, t ? t->store_gbps : 0, t ? t->read_gbps : 0,
                            t ? t->setup_ns : 0, t ? t->read_latency_ns : 0,
                            t ? t->tier_latency_ns : 0 };

    if (!ctx)
        return -EINVAL;
    if (!t)
        return kv_fail(ctx, -EINVAL, "timing: NULL");
    for (size_t i = 0; i < sizeof(nums) / sizeof(nums[0]); i++)
        if (!isfinite(nums[i]) || nums[i] < 0 || nums[i] > 1e15)
            return kv_fail(ctx, -EINVAL, "timing: value %g out of range (finite, 0..1e15)", nums[i]);
    if (t->engines == 0 || t->line_bytes == 0)
        return kv_fail(ctx, -EINVAL, "timing: engines and line_bytes must be at least 1");
    if (t->store_mode > 1)
        return kv_fail(ctx, -EINVAL, "timing: store_mode is %u, must be 0 (serial) or 1 (async)",
                       t->store_mode);
    if (t->store_mode == 1 && t->store_inflight_bytes == 0)
        return kv_fail(ctx, -EINVAL, "timing: async stores need store_inflight_bytes >= 1");
    if (t->staged > 1 || t->reserved != 0)
        return kv_fail(ctx, -EINVAL, "timing: staged must be 0 or 1 and reserved 0");
    ctx->timing = *t;
    return 0;
}

int kv_datapath_stats(const struct kv_ctx *ctx, int op, uint64_t *out6)
{
    const struct kv_op_hist *h;

    if (!ctx || op < 0 || op >= KV_N_OPS || !out6)
        return -EINVAL;
    h = &ctx->stats[op];
    out6[0] = h->accesses;
    out6[1] = h->bytes;
    out6[2] = h->busy_ns;
    out6[3] = h->link_ns;
    out6[4] = h->charged_ns;
    out6[5] = h->medium_bound_ns;
    return 0;
}

int kv_timeline(const struct kv_ctx *ctx, int64_t *clock_ns, int64_t *stores_done_ns,
                uint64_t *inflight_bytes)
{
    uint64_t inflight = 0;

    if (!ctx || !clock_ns || !stores_done_ns || !inflight_bytes)
        return -EINVAL;
    for (uint64_t i = 0; i < ctx->sq_len; i++) {
        const struct kv_store_slot *q = &ctx->sq[(ctx->sq_head + i) % ctx->sq_cap];

        if (q->done_ns > ctx->clock_ns)
            inflight += q->bytes;
    }
    *clock_ns = ctx->clock_ns;
    *stores_done_ns = ctx->store_free_ns > ctx->clock_ns ? ctx->store_free_ns : ctx->clock_ns;
    *inflight_bytes = inflight;
    return 0;
}

static void kv_ctx_unref(struct kv_ctx *ctx);

static void kv_ctx_destroy(struct kv_ctx *ctx)
{
    struct kv_ctx *owner = ctx->arena_owner;

    if (ctx->ops && ctx->ops->close)
        ctx->ops->close(ctx);
    kv_free_scratch(ctx);
    free(ctx->sq);
    free(ctx);
    if (owner)
        kv_ctx_unref(owner);
}

/* The last reference (the caller's, or that of the last context attached to its arena) frees it. */
static void kv_ctx_unref(struct kv_ctx *ctx)
{
    if (__atomic_sub_fetch(&ctx->refs, 1, __ATOMIC_ACQ_REL) == 0)
        kv_ctx_destroy(ctx);
}

void kv_ctx_free(struct kv_ctx *ctx)
{
    if (ctx)
        kv_ctx_unref(ctx);
}

int kv_backend_open(struct kv_ctx *ctx, const char *name, const char *args)
{
    const struct kv_backend_ops *ops = NULL;
    int rc;

    if (!ctx)
        return -EINVAL;
    if (!name)
        return kv_fail(ctx, -EINVAL, "open: backend name is NULL");
    if (ctx->ops)
        return kv_fail(ctx, -EBUSY, "open: backend '%s' is already open on this context",
                       ctx->ops->name);
    for (size_t i = 0; i < KV_N_BACKENDS; i++)
        if (strcmp(kv_registry[i]->name, name) == 0)
            ops = kv_registry[i];
    if (!ops) {
        char known[256];
        size_t pos = 0;

        known[0] = '\0';
        for (size_t i = 0; i < KV_N_BACKENDS; i++)
            kv_appendf(known, sizeof(known), &pos, "%s%s", i ? ", " : "", kv_registry[i]->name);
        return kv_fail(ctx, -ENOENT, "unknown backend '%s' (known: %s)", name, known);
    }
    /* A table compiled against another ops layout would be called through the wrong slots. */
    if (ops->version != KV_OPS_VERSION)
        return kv_fail(ctx, -EPROTO, "open: backend '%s' has ops version %u, core expects %u",
                       ops->name, ops->version, KV_OPS_VERSION);
    if (!ops->open || !ops->prepare || !ops->access)
        return kv_fail(ctx, -EPROTO, "open: backend '%s' lacks a required hook", ops->name);

    rc = ops->open(ctx, args ? args : "");
    if (rc < 0) {
        ctx->backend_data = NULL;
        return rc;
    }
    ctx->ops = ops;
    return 0;
}

/* kv_prepare and kv_prepare_attached: validate, size staging, then the backend's prepare or attach. */
static int kv_prepare_with(struct kv_ctx *ctx, const struct kv_geom *g, const struct kv_ctx *owner)
{
    uint64_t arena_bytes, staging_bytes;
    int rc;

    if (!ctx)
        return -EINVAL;
    if (!g)
        return kv_fail(ctx, -EINVAL, "prepare: geometry is NULL");
    if (!ctx->ops)
        return kv_fail(ctx, -EINVAL, "prepare: no backend is open");
    if (ctx->prepared)
        return kv_fail(ctx, -EBUSY, "prepare: already prepared; a context holds one arena");
    if (kv_cancelled(ctx))
        return kv_cancelled_fail(ctx, "prepare");
    if (g->block_bytes == 0 || g->block_bytes % 64 != 0)
        return kv_fail(ctx, -EINVAL,
                       "prepare: block_bytes %" PRIu64 " must be a positive multiple of 64 "
                       "(reads touch whole cache lines)", g->block_bytes);
    if (g->n_slots == 0)
        return kv_fail(ctx, -EINVAL, "prepare: n_slots must be positive");
    if (g->n_layers_model == 0 || g->n_layers_model > KV_MAX_MODEL_LAYERS)
        return kv_fail(ctx, -EINVAL, "prepare: n_layers_model %u outside 1..%u",
                       g->n_layers_model, KV_MAX_MODEL_LAYERS);
    if (g->n_layers_replay == 0 || g->n_layers_replay > g->n_layers_model)
        return kv_fail(ctx, -EINVAL, "prepare: n_layers_replay %u outside 1..n_layers_model (%u)",
                       g->n_layers_replay, g->n_layers_model);
    if (g->overlap > 1)
        return kv_fail(ctx, -EINVAL, "prepare: overlap is %u, must be 0 (serial) or 1 (pipelined)",
                       g->overlap);
    if (g->reserved != 0)
        return kv_fail(ctx, -EINVAL, "prepare: reserved field is %u, must be 0", g->reserved);
    if (g->layout > KV_LAYOUT_CROSS_LAYER)
        return kv_fail(ctx, -EINVAL, "prepare: layout is %u, must be 0 (per-layer) or 1 (cross-layer)",
                       g->layout);
    if (g->layout == KV_LAYOUT_CROSS_LAYER && g->n_layers_replay != g->n_layers_model)
        return kv_fail(ctx, -EINVAL, "prepare: the cross-layer layout moves all layers of a chunk in one "
                       "transfer; replay every layer (%u of %u replayed)", g->n_layers_replay,
                       g->n_layers_model);
    /* Every arena offset the replay computes is below this product, so checking it once suffices. */
    if (__builtin_mul_overflow(g->n_slots, (uint64_t)g->n_layers_replay, &arena_bytes) ||
        __builtin_mul_overflow(arena_bytes, g->block_bytes, &arena_bytes) ||
        arena_bytes > (uint64_t)SIZE_MAX)
        return kv_fail(ctx, -EINVAL,
                       "prepare: arena of %" PRIu64 " slots x %u layers x %" PRIu64
                       " bytes overflows 64 bits", g->n_slots, g->n_layers_replay,
                       g->block_bytes);

    staging_bytes = arena_bytes < KV_STAGING_MAX_BYTES ? arena_bytes : KV_STAGING_MAX_BYTES;
    staging_bytes -= staging_bytes % g->block_bytes;
    if (staging_bytes == 0)
        staging_bytes = g->block_bytes;
    /* Cross-layer copies stage a block of every layer at once: whole such units. */
    if (g->layout == KV_LAYOUT_CROSS_LAYER) {
        uint64_t unit = g->block_bytes * g->n_layers_replay;

        staging_bytes -= staging_bytes % unit;
        if (staging_bytes == 0)
            staging_bytes = unit;
    }

    kv_free_scratch(ctx);
    for (int op = 0; op < KV_N_OPS; op++)
        ctx->layer_ns[op] = calloc(g->n_layers_replay, sizeof(int64_t));
    ctx->layer_store_bytes = calloc(g->n_layers_replay, sizeof(uint64_t));
    if (!ctx->layer_ns[KV_OP_LOAD] || !ctx->layer_ns[KV_OP_STORE] || !ctx->layer_ns[KV_OP_READ] ||
        !ctx->layer_store_bytes) {
        rc = kv_fail(ctx, -ENOMEM, "prepare: cannot allocate per-layer scratch");
        goto fail;
    }

    /* Backends may check their own rules (O_DIRECT alignment) against the block size. */
    ctx->geom = *g;
    rc = owner ? ctx->ops->attach(ctx, owner, staging_bytes)
               : ctx->ops->prepare(ctx, arena_bytes, staging_bytes);
    if (rc < 0)
        goto fail;
    ctx->arena_bytes = arena_bytes;
    ctx->staging_bytes = staging_bytes;
    ctx->staging_cursor = 0;
    ctx->prepared = 1;
    return 0;

fail:
    memset(&ctx->geom, 0, sizeof(ctx->geom));
    kv_free_scratch(ctx);
    ctx->arena_host = ctx->staging_host = NULL;
    return rc;
}

int kv_prepare(struct kv_ctx *ctx, const struct kv_geom *g)
{
    return kv_prepare_with(ctx, g, NULL);
}

int kv_prepare_attached(struct kv_ctx *ctx, const struct kv_geom *g, const struct kv_ctx *owner)
{
    int rc;

    if (!ctx)
        return -EINVAL;
    if (!owner || owner == ctx || !owner->prepared)
        return kv_fail(ctx, -EINVAL, "prepare: the owner context must be another, prepared context");
    if (!ctx->ops || ctx->ops != owner->ops)
        return kv_fail(ctx, -EINVAL, "prepare: an arena can only be shared on the same backend (%s)",
                       owner->ops->name);
    if (!g || memcmp(g, &owner->geom, sizeof(*g)) != 0)
        return kv_fail(ctx, -EINVAL, "prepare: a shared arena needs the owner's geometry");
    if (!ctx->ops->attach)
        return kv_fail(ctx, -EOPNOTSUPP, "%s: this backend cannot share one arena between instances; "
                       "use replicated tiers", ctx->ops->name);
    rc = kv_prepare_with(ctx, g, owner);
    if (rc == 0) {
        /* Only the count changes: owner's arena stays until ctx, too, is freed. */
        ctx->arena_owner = (struct kv_ctx *)owner;
        __atomic_add_fetch(&ctx->arena_owner->refs, 1, __ATOMIC_ACQ_REL);
    }
    return rc;
}

int kv_describe(struct kv_ctx *ctx, char *buf, size_t len)
{
    size_t pos = 0;

    if (!ctx)
        return -EINVAL;
    if (!buf && len)
        return kv_fail(ctx, -EINVAL, "describe: buffer is NULL");
    if (len)
        buf[0] = '\0';
    kv_appendf(buf, len, &pos, "{\"abi_version\":%d,\"backend\":", KV_ABI_VERSION);
    if (ctx->ops)
        kv_appendf(buf, len, &pos, "\"%s\"", ctx->ops->name);
    else
        kv_appendf(buf, len, &pos, "null");
    kv_appendf(buf, len, &pos, ",\"prepared\":%s", ctx->prepared ? "true" : "false");
    if (ctx->prepared)
        kv_appendf(buf, len, &pos,
                   ",\"block_bytes\":%" PRIu64 ",\"n_slots\":%" PRIu64
                   ",\"n_layers_model\":%u,\"n_layers_replay\":%u,\"overlap\":%s"
                   ",\"chunk_blocks\":%u,\"layout\":\"%s\"",
                   ctx->geom.block_bytes, ctx->geom.n_slots, ctx->geom.n_layers_model,
                   ctx->geom.n_layers_replay, ctx->geom.overlap ? "true" : "false",
                   ctx->geom.chunk_blocks ? ctx->geom.chunk_blocks : 1,
                   ctx->geom.layout == KV_LAYOUT_CROSS_LAYER ? "cross-layer" : "per-layer");
    kv_appendf(buf, len, &pos, ",\"arena_bytes\":%" PRIu64 ",\"staging_bytes\":%" PRIu64,
               ctx->arena_bytes, ctx->staging_bytes);
    kv_appendf(buf, len, &pos, ",\"timer\":\"%s\"", ctx->timer.use_tsc ? "tsc" : "clock_gettime");
    if (ctx->timer.use_tsc)
        kv_appendf(buf, len, &pos, ",\"tsc_ghz\":%.6f", ctx->timer.tsc_ghz);
    else
        kv_appendf(buf, len, &pos, ",\"tsc_ghz\":null");
    if (ctx->ops && ctx->ops->describe) {
        int n = ctx->ops->describe(ctx, pos < len ? buf + pos : NULL, pos < len ? len - pos : 0);
        if (n < 0)
            return n;
        pos += (size_t)n;
    }
    kv_appendf(buf, len, &pos, "}");
    if (pos >= len || pos > INT32_MAX)
        return kv_fail(ctx, -ENOSPC, "describe: buffer of %zu bytes is too small, need %zu",
                       len, pos + 1);
    return (int)pos;
}

/* ------------------------------------------------------------------ debugging */

static int kv_debug_region(struct kv_ctx *ctx, int which, uint64_t off, uint64_t n,
                           uint8_t **p)
{
    uint8_t *base;
    uint64_t size;

    if (!ctx->prepared)
        return kv_fail(ctx, -EINVAL, "debug: context is not prepared");
    if (which == KV_REGION_ARENA) {
        base = ctx->arena_host;
        size = ctx->arena_bytes;
    } else if (which == KV_REGION_STAGING) {
        base = ctx->staging_host;
        size = ctx->staging_bytes;
    } else {
        return kv_fail(ctx, -EINVAL, "debug: unknown region %d", which);
    }
    if (!base)
        return kv_fail(ctx, -EOPNOTSUPP, "debug: backend '%s' memory is not host-addressable",
                       ctx->ops->name);
    if (off > size || n > size - off)
        return kv_fail(ctx, -EINVAL,
                       "debug: %" PRIu64 "+%" PRIu64 " outside region of %" PRIu64 " bytes",
                       off, n, size);
    *p = base + off;
    return 0;
}

int kv_debug_peek(struct kv_ctx *ctx, int which, uint64_t off, void *dst, uint64_t n)
{
    uint8_t *p;
    int rc;

    if (!ctx)
        return -EINVAL;
    if (!dst && n)
        return kv_fail(ctx, -EINVAL, "debug: destination is NULL");
    rc = kv_debug_region(ctx, which, off, n, &p);
    if (rc < 0)
        return rc;
    if (n)
        memcpy(dst, p, n);
    return 0;
}

int kv_debug_poke(struct kv_ctx *ctx, int which, uint64_t off, const void *src, uint64_t n)
{
    uint8_t *p;
    int rc;

    if (!ctx)
        return -EINVAL;
    if (!src && n)
        return kv_fail(ctx, -EINVAL, "debug: source is NULL");
    rc = kv_debug_region(ctx, which, off, n, &p);
    if (rc < 0)
        return rc;
    if (n)
        memcpy(p, src, n);
    return 0;
}

/* ----------------------------------------------------------------- validation */

static void kv_entry_range(const struct kv_entry *en, int op, uint32_t *first, uint32_t *count)
{
    switch (op) {
    case KV_OP_LOAD:
        *first = en->load_first;
        *count = en->load_count;
        break;
    case KV_OP_STORE:
        *first = en->store_first;
        *count = en->store_count;
        break;
    default:
        *first = en->read_first;
        *count = en->read_count;
        break;
    }
}

static const char *const kv_op_names[KV_N_OPS] = { "load", "store", "read" };

struct kv_replay_args {
    const uint64_t *table_off;
    uint32_t n_req;
    const uint32_t *table_slots;
    uint64_t n_table;
    const struct kv_step *steps;
    uint64_t n_steps;
    const struct kv_entry *entries;
    uint64_t n_entries;
    const uint32_t *layer_span;
    const struct kv_layers *kv;
    struct kv_step_out *step_out;
    struct kv_entry_out *entry_out;
};

/* struct kv_layers as kvemu.h documents it, against the prepared geometry. */
static int kv_validate_layers(struct kv_ctx *ctx, const struct kv_replay_args *a)
{
    const struct kv_geom *g = &ctx->geom;
    const struct kv_layers *kv = a->kv;
    const uint64_t region = g->n_slots * g->block_bytes;

    if (!kv->layer || (a->n_req && !kv->req))
        return kv_fail(ctx, -EINVAL, "replay: kv layers or requests are NULL");
    if (kv->reserved)
        return kv_fail(ctx, -EINVAL, "replay: kv reserved field is %u, must be 0", kv->reserved);
    if (kv->store_all > 1)
        return kv_fail(ctx, -EINVAL, "replay: kv store_all is %u, must be 0 or 1", kv->store_all);
    if (g->layout != KV_LAYOUT_PER_LAYER)
        return kv_fail(ctx, -EINVAL, "replay: per-layer KV kinds need the per-layer layout");
    for (uint32_t j = 0; j < g->n_layers_replay; j++) {
        const struct kv_layer *L = &kv->layer[j];

        if (L->kind > KV_LAYER_LINEAR)
            return kv_fail(ctx, -EINVAL, "replay: layer %u has unknown kind %u", j, L->kind);
        if (L->kind == KV_LAYER_LINEAR) {
            if (L->state_bytes == 0 || L->state_bytes % 64 || L->block_bytes != 0 || L->window_tokens != 0)
                return kv_fail(ctx, -EINVAL, "replay: linear layer %u needs state_bytes a positive "
                               "multiple of 64, no blocks and no window", j);
            if (L->state_bytes > region || L->state_bytes > ctx->staging_bytes)
                return kv_fail(ctx, -EINVAL,
                               "replay: layer %u's state of %" PRIu64 " bytes exceeds the layer's "
                               "arena (%" PRIu64 " bytes) or staging (%" PRIu64 " bytes)", j,
                               L->state_bytes, region, ctx->staging_bytes);
            continue;
        }
        /* backends move whole 64-byte lines, as geom.block_bytes is */
        if (L->block_bytes == 0 || L->block_bytes % 64 || L->block_bytes > g->block_bytes || L->state_bytes != 0)
            return kv_fail(ctx, -EINVAL,
                           "replay: layer %u's block_bytes %" PRIu64 " must be a multiple of 64 up to %"
                           PRIu64 " and it holds no state", j, L->block_bytes, g->block_bytes);
        if ((L->kind == KV_LAYER_FULL) != (L->window_tokens == 0))
            return kv_fail(ctx, -EINVAL, "replay: layer %u: a window belongs to sliding and "
                           "chunked layers only, and they need one", j);
        if (L->kind != KV_LAYER_FULL && kv->block_tokens == 0)
            return kv_fail(ctx, -EINVAL, "replay: windowed layers need block_tokens > 0");
    }
    for (uint32_t r = 0; r < a->n_req; r++)
        if (kv->req[r].all_layers > 1)
            return kv_fail(ctx, -EINVAL, "replay: kv request %u: all_layers must be 0 or 1", r);
    for (uint64_t e = 0; e < a->n_entries; e++) {
        const struct kv_entry *en = &a->entries[e];
        const struct kv_req *rq;

        if (en->req >= a->n_req || en->load_count == 0)
            continue;   /* a bad request index is kv_validate's to report */
        rq = &kv->req[en->req];
        if (rq->load_end && rq->load_end < (uint64_t)rq->base_block + en->load_first + en->load_count)
            return kv_fail(ctx, -EINVAL, "replay: entry %" PRIu64 ": load ends at block %" PRIu64
                           ", after its request's load_end %u", e,
                           (uint64_t)rq->base_block + en->load_first + en->load_count, rq->load_end);
    }
    return 0;
}

/* Everything the replay loop relies on, checked up front so a bad batch never moves a byte. */
static int kv_validate(struct kv_ctx *ctx, const struct kv_replay_args *a)
{
    const struct kv_geom *g = &ctx->geom;
    uint64_t span_sum = 0, prev_end = 0;

    if (!a->table_off)
        return kv_fail(ctx, -EINVAL, "replay: table_off is NULL");
    if ((a->n_table && !a->table_slots) || (a->n_steps && !a->steps) ||
        (a->n_entries && !a->entries) || !a->layer_span || (a->n_steps && !a->step_out))
        return kv_fail(ctx, -EINVAL, "replay: NULL array for a non-empty argument");
    if (a->n_steps > (uint64_t)INT64_MAX)
        return kv_fail(ctx, -EINVAL, "replay: %" PRIu64 " steps do not fit the return value",
                       a->n_steps);

    if (a->table_off[0] != 0)
        return kv_fail(ctx, -EINVAL, "replay: table_off[0] is %" PRIu64 ", must be 0",
                       a->table_off[0]);
    for (uint32_t r = 0; r < a->n_req; r++) {
        uint64_t lo = a->table_off[r], hi = a->table_off[r + 1];

        if (hi < lo)
            return kv_fail(ctx, -EINVAL,
                           "replay: table_off decreases at request %u (%" PRIu64 " -> %" PRIu64 ")",
                           r, lo, hi);
        if (hi > a->n_table)
            return kv_fail(ctx, -EINVAL,
                           "replay: table_off[%u] is %" PRIu64 ", beyond n_table %" PRIu64,
                           r + 1, hi, a->n_table);
        for (uint64_t i = lo; i < hi; i++)
            if (a->table_slots[i] >= g->n_slots)
                return kv_fail(ctx, -EINVAL,
                               "replay: request %u position %" PRIu64 " holds slot %u, "
                               "arena has %" PRIu64 " slots", r, i - lo, a->table_slots[i],
                               g->n_slots);
    }
    if (a->table_off[a->n_req] != a->n_table)
        return kv_fail(ctx, -EINVAL,
                       "replay: table_off[%u] is %" PRIu64 ", must equal n_table %" PRIu64,
                       a->n_req, a->table_off[a->n_req], a->n_table);

    for (uint32_t j = 0; j < g->n_layers_replay; j++) {
        if (a->layer_span[j] == 0)
            return kv_fail(ctx, -EINVAL, "replay: layer_span[%u] is 0", j);
        span_sum += a->layer_span[j];
    }
    if (span_sum != g->n_layers_model)
        return kv_fail(ctx, -EINVAL,
                       "replay: layer_span sums to %" PRIu64 ", geometry has %u model layers",
                       span_sum, g->n_layers_model);

    if (a->kv) {
        int rc = kv_validate_layers(ctx, a);

        if (rc < 0)
            return rc;
    }

    for (uint64_t e = 0; e < a->n_entries; e++) {
        const struct kv_entry *en = &a->entries[e];
        uint64_t len;

        if (en->req >= a->n_req)
            return kv_fail(ctx, -EINVAL, "replay: entry %" PRIu64 ": request %u >= n_req %u", e,
                           en->req, a->n_req);
        len = a->table_off[en->req + 1] - a->table_off[en->req];
        for (int op = 0; op < KV_N_OPS; op++) {
            uint32_t first, count;

            kv_entry_range(en, op, &first, &count);
            /* Widened to 64 bits, first + count cannot wrap. */
            if ((uint64_t)first + count > len)
                return kv_fail(ctx, -EINVAL,
                               "replay: entry %" PRIu64 ": %s range %u+%u exceeds block table "
                               "of request %u (%" PRIu64 " blocks)", e, kv_op_names[op], first,
                               count, en->req, len);
        }
    }

    for (uint64_t s = 0; s < a->n_steps; s++) {
        const struct kv_step *st = &a->steps[s];

        if (st->entry_begin > st->entry_end || st->entry_end > a->n_entries)
            return kv_fail(ctx, -EINVAL,
                           "replay: step %" PRIu64 ": entry range [%" PRIu64 ", %" PRIu64
                           ") invalid for %" PRIu64 " entries", s, st->entry_begin,
                           st->entry_end, a->n_entries);
        /* Overlapping steps would replay an entry twice and blur its entry_out. */
        if (st->entry_begin < prev_end)
            return kv_fail(ctx, -EINVAL,
                           "replay: step %" PRIu64 ": entries start at %" PRIu64
                           ", before the previous step's end %" PRIu64, s, st->entry_begin,
                           prev_end);
        if (st->compute_ns < 0)
            return kv_fail(ctx, -EINVAL, "replay: step %" PRIu64 ": compute_ns %" PRId64
                           " is negative", s, st->compute_ns);
        if (st->ready_ns < 0)
            return kv_fail(ctx, -EINVAL, "replay: step %" PRIu64 ": ready_ns %" PRId64
                           " is negative", s, st->ready_ns);
        prev_end = st->entry_end;
    }
    return 0;
}

/* ------------------------------------------------------------------- replay */

static inline int64_t kv_sat_add(int64_t a, int64_t b)
{
    int64_t r;

    return __builtin_add_overflow(a, b, &r) ? INT64_MAX : r;
}

static inline int64_t kv_sat_mul(int64_t a, int64_t b)
{
    int64_t r;

    return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}

static inline int64_t kv_max(int64_t a, int64_t b)
{
    return a > b ? a : b;
}

/* Accesses of one op for one replayed layer, queued until a backend call's worth. */
struct kv_batch {
    int op;
    uint32_t layer;
    int64_t span;           /* model layers the replayed layer stands for */
    uint32_t n;
    int64_t phase_ns;       /* charged time of this op on this layer, unscaled */
    uint64_t phase_bytes;
    struct kv_access acc[KV_BATCH];
    uint64_t owner[KV_BATCH];   /* entry index of each access */
    uint64_t lat_ns[KV_BATCH];
};

static inline int64_t kv_round_ns(double x)
{
    return x <= 0 ? 0 : x >= 9.2e18 ? INT64_MAX : (int64_t)(x + 0.5);
}

/* The link's time for one backend batch of op (struct kv_timing in kvemu.h); 0 without a limit. */
static int64_t kv_link_ns(const struct kv_timing *tm, int op, uint64_t bytes, uint32_t n)
{
    const double gbps = op == KV_OP_LOAD ? tm->load_gbps : op == KV_OP_STORE ? tm->store_gbps
                                                                             : tm->read_gbps;
    double t;

    if (gbps <= 0)
        return 0;
    t = (double)bytes / gbps;
    if (op == KV_OP_READ) {
        if (tm->outstanding) {
            double little = (double)bytes * (tm->read_latency_ns + tm->tier_latency_ns) /
                            ((double)tm->outstanding * (double)tm->line_bytes);
            if (little > t)
                t = little;
        }
    } else {
        t += (double)((n + tm->engines - 1) / tm->engines) * tm->setup_ns;
    }
    return kv_round_ns(t);
}

static int kv_flush(struct kv_ctx *ctx, struct kv_batch *b, struct kv_entry_out *entry_out)
{
    struct kv_op_hist *h = &ctx->stats[b->op];
    uint64_t busy_ns = 0, lat_sum = 0, bytes = 0;
    int64_t busy, link, charged;
    double share;
    int rc;

    if (b->n == 0)
        return 0;
    /* Between batches: a fast tier's batch is short, a slow one's waits poll on their own. */
    if (kv_cancelled(ctx))
        return kv_cancelled_fail(ctx, "replay");
    rc = ctx->ops->access(ctx, b->op, b->acc, b->n, b->lat_ns, &busy_ns);
    if (rc < 0)
        return rc;
    if ((uint32_t)rc != b->n)
        return kv_fail(ctx, -EIO, "replay: backend '%s' performed %d of %u accesses",
                       ctx->ops->name, rc, b->n);
    for (uint32_t k = 0; k < b->n; k++) {
        lat_sum += b->lat_ns[k];
        bytes += b->acc[k].bytes;
    }
    busy = busy_ns > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)busy_ns;
    /* The batch takes what the slower of the tier and the link allows. */
    link = kv_link_ns(&ctx->timing, b->op, bytes, b->n);
    charged = kv_max(busy, link);
    /* Through a host bounce buffer the two hops are in series, pipelined over the transfers. */
    if (ctx->timing.staged && link > 0)
        charged = kv_sat_add(charged, (busy < link ? busy : link) / (int64_t)b->n);
    /* With accesses in flight together, each is charged its share of the batch's time. */
    share = lat_sum ? (double)charged / (double)lat_sum : 0.0;
    b->phase_ns = kv_sat_add(b->phase_ns, charged);
    b->phase_bytes += bytes;
    h->busy_ns += busy_ns;
    h->link_ns += (uint64_t)link;
    h->charged_ns += (uint64_t)charged;
    if (link > 0 && busy > link)
        h->medium_bound_ns += (uint64_t)charged;
    for (uint32_t k = 0; k < b->n; k++) {
        int64_t lat = kv_round_ns((double)b->lat_ns[k] * share);

        h->counts[kv_hist_bucket(b->lat_ns[k])]++;
        h->accesses++;
        h->bytes += b->acc[k].bytes;
        h->time_ns += b->lat_ns[k];
        if (entry_out) {
            struct kv_entry_out *eo = &entry_out[b->owner[k]];
            int64_t *dst = b->op == KV_OP_LOAD ? &eo->load_ns
                         : b->op == KV_OP_STORE ? &eo->store_ns : &eo->read_ns;
            *dst = kv_sat_add(*dst, kv_sat_mul(lat, b->span));
        }
    }
    b->n = 0;
    return 0;
}

/* Byte offset of (replayed layer j, slot s) in the arena, by layout. */
static inline uint64_t kv_arena_off(const struct kv_geom *g, uint32_t j, uint64_t s)
{
    return g->layout == KV_LAYOUT_CROSS_LAYER ? (s * g->n_layers_replay + j) * g->block_bytes
                                              : ((uint64_t)j * g->n_slots + s) * g->block_bytes;
}

static inline uint64_t kv_max_u64(uint64_t a, uint64_t b)
{
    return a > b ? a : b;
}

static inline uint64_t kv_min_u64(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

/* First block a windowed layer needs to go on from block end (exclusive); see struct kv_layer. */
static uint64_t kv_reach_start(const struct kv_layer *L, uint32_t block_tokens, uint64_t end)
{
    if (L->kind == KV_LAYER_SLIDING) {
        uint64_t reach = ((uint64_t)L->window_tokens + block_tokens - 1) / block_tokens;

        return end > reach ? end - reach : 0;
    }
    return end * block_tokens / L->window_tokens * L->window_tokens / block_tokens;
}

/*
 * The part of entry en's op range that replayed layer j moves (struct kv_layer):
 * *first and *count rewritten (local positions), *states the linear states.
 */
static void kv_clip(const struct kv_layers *kv, uint32_t j, const struct kv_entry *en, int op,
                    uint32_t *first, uint32_t *count, uint32_t *states)
{
    const struct kv_layer *L = &kv->layer[j];
    const struct kv_req *rq = &kv->req[en->req];
    const uint64_t base = rq->base_block, f = base + *first, e = f + *count;
    uint64_t lo, hi;

    *states = 0;
    if (rq->all_layers || L->kind == KV_LAYER_FULL || *count == 0)
        return;
    if (L->kind == KV_LAYER_LINEAR) {
        if (op == KV_OP_STORE && kv->checkpoint_blocks)
            *states = (uint32_t)(e / kv->checkpoint_blocks - f / kv->checkpoint_blocks);
        else
            *states = op == KV_OP_LOAD && rq->load_end && rq->load_end != e ? 0 : 1;
        /* the states sit at the range's last block: *first names it, no block moves */
        *first += *count - 1;
        *count = 0;
        return;
    }
    if (op == KV_OP_STORE && kv->store_all)
        return;
    if (op == KV_OP_STORE) {
        hi = rq->prompt_blocks;
        lo = kv_reach_start(L, kv->block_tokens, hi);
    } else {
        hi = e;
        lo = kv_reach_start(L, kv->block_tokens, op == KV_OP_LOAD && rq->load_end ? rq->load_end : e);
    }
    lo = kv_max_u64(lo, f);
    hi = kv_min_u64(hi, e);
    if (hi <= lo) {
        *count = 0;
        return;
    }
    *first = (uint32_t)(lo - base);
    *count = (uint32_t)(hi - lo);
}

static int kv_run_phase(struct kv_ctx *ctx, const struct kv_replay_args *a,
                        const struct kv_step *st, struct kv_batch *b)
{
    const struct kv_geom *g = &ctx->geom;
    /* Cross-layer copies move a block of every layer at once: one unit is block_bytes x layers. */
    const int whole = g->layout == KV_LAYOUT_CROSS_LAYER && b->op != KV_OP_READ;
    const uint64_t unit_bytes = whole ? g->block_bytes * g->n_layers_replay : g->block_bytes;
    const uint32_t chunk = g->chunk_blocks > 1 && b->op != KV_OP_READ ? g->chunk_blocks : 1;
    int rc;

    b->n = 0;
    b->phase_ns = 0;
    b->phase_bytes = 0;
    for (uint64_t e = st->entry_begin; e < st->entry_end; e++) {
        const struct kv_entry *en = &a->entries[e];
        const uint32_t *row;
        uint32_t first, count, states = 0;
        struct kv_access *cur = NULL;   /* the transfer the next block may extend */
        uint64_t block_bytes = unit_bytes;

        kv_entry_range(en, b->op, &first, &count);
        if (a->kv && !a->kv->req[en->req].all_layers) {
            kv_clip(a->kv, b->layer, en, b->op, &first, &count, &states);
            block_bytes = a->kv->layer[b->layer].block_bytes;
        }
        row = a->table_slots + a->table_off[en->req] + first;
        for (uint32_t k = 0; k < states; k++) {
            const uint64_t state = a->kv->layer[b->layer].state_bytes;
            const uint64_t layer_end = ((uint64_t)b->layer + 1) * g->n_slots * g->block_bytes;
            struct kv_access *acc;

            if (b->n == KV_BATCH) {
                rc = kv_flush(ctx, b, a->entry_out);
                if (rc < 0)
                    return rc;
            }
            acc = &b->acc[b->n];
            acc->arena_off = kv_min_u64(kv_arena_off(g, b->layer, row[0]), layer_end - state);
            acc->bytes = state;
            acc->staging_off = 0;
            if (b->op != KV_OP_READ) {
                if (ctx->staging_cursor + state > ctx->staging_bytes)
                    ctx->staging_cursor = 0;
                acc->staging_off = ctx->staging_cursor;
                ctx->staging_cursor += state;
                if (ctx->staging_cursor + g->block_bytes > ctx->staging_bytes)
                    ctx->staging_cursor = 0;
            }
            b->owner[b->n] = e;
            b->n++;
        }
        for (uint32_t p = 0; p < count; p++) {
            struct kv_access *acc;

            /* One transfer per chunk: the next slot of the same chunk, staging still contiguous. */
            if (cur && row[p] == row[p - 1] + 1 && row[p] / chunk == row[p - 1] / chunk &&
                cur->staging_off + cur->bytes == ctx->staging_cursor) {
                cur->bytes += block_bytes;
                ctx->staging_cursor += block_bytes;
                if (ctx->staging_cursor + block_bytes > ctx->staging_bytes)
                    ctx->staging_cursor = 0;
                continue;
            }
            if (b->n == KV_BATCH) {
                rc = kv_flush(ctx, b, a->entry_out);
                if (rc < 0)
                    return rc;
            }
            acc = &b->acc[b->n];
            /* A chunk starts where its whole transfer fits staging, so no wrap ever splits one. */
            if (chunk > 1 && ctx->staging_cursor + chunk * block_bytes > ctx->staging_bytes &&
                chunk * block_bytes <= ctx->staging_bytes)
                ctx->staging_cursor = 0;
            acc->arena_off = kv_arena_off(g, whole ? 0 : b->layer, row[p]);
            acc->bytes = block_bytes;
            if (b->op == KV_OP_READ) {
                acc->staging_off = 0;
            } else {
                /* layers of a model with KV groups move blocks of their own sizes: wrap for this one */
                if (ctx->staging_cursor + block_bytes > ctx->staging_bytes)
                    ctx->staging_cursor = 0;
                acc->staging_off = ctx->staging_cursor;
                ctx->staging_cursor += block_bytes;
                if (ctx->staging_cursor + block_bytes > ctx->staging_bytes)
                    ctx->staging_cursor = 0;
            }
            b->owner[b->n] = e;
            b->n++;
            cur = chunk > 1 ? acc : NULL;
        }
    }
    return kv_flush(ctx, b, a->entry_out);
}

/* Drops async stores that completed by now from the ring. */
static void kv_sq_retire(struct kv_ctx *ctx, int64_t now)
{
    while (ctx->sq_len && ctx->sq[ctx->sq_head].done_ns <= now) {
        ctx->sq_bytes -= ctx->sq[ctx->sq_head].bytes;
        ctx->sq_head = (ctx->sq_head + 1) % ctx->sq_cap;
        ctx->sq_len--;
    }
}

static int kv_sq_push(struct kv_ctx *ctx, int64_t done, uint64_t bytes)
{
    if (ctx->sq_len == ctx->sq_cap) {
        uint64_t cap = ctx->sq_cap ? ctx->sq_cap * 2 : 256;
        struct kv_store_slot *q = malloc(cap * sizeof(*q));

        if (!q)
            return kv_fail(ctx, -ENOMEM, "replay: cannot grow the store queue to %" PRIu64, cap);
        for (uint64_t i = 0; i < ctx->sq_len; i++)
            q[i] = ctx->sq[(ctx->sq_head + i) % ctx->sq_cap];
        free(ctx->sq);
        ctx->sq = q;
        ctx->sq_cap = cap;
        ctx->sq_head = 0;
    }
    ctx->sq[(ctx->sq_head + ctx->sq_len) % ctx->sq_cap] = (struct kv_store_slot){ done, bytes };
    ctx->sq_len++;
    ctx->sq_bytes += bytes;
    return 0;
}

/*
 * Walks the model layers from start; replayed layer j's charged times repeat
 * for its span. Returns the step's end on the timeline (or -errno), *stall
 * the time it waited for async stores.
 */
static int64_t kv_compose_step(struct kv_ctx *ctx, const uint32_t *layer_span, int64_t compute_ns,
                               int64_t start, int64_t *stall)
{
    const struct kv_geom *g = &ctx->geom;
    const int64_t n_layers = g->n_layers_model;
    const int64_t comp_q = compute_ns / n_layers, comp_r = compute_ns % n_layers;
    const uint64_t bound = ctx->timing.store_inflight_bytes;
    const int64_t *load = ctx->layer_ns[KV_OP_LOAD], *read = ctx->layer_ns[KV_OP_READ];
    const int64_t *store = ctx->layer_ns[KV_OP_STORE];
    int64_t fd = 0, ce = 0, se = 0, l = 0;

    *stall = 0;
    if (ctx->timing.store_mode == 0 && !g->overlap) {
        int64_t total = compute_ns;

        for (uint32_t j = 0; j < g->n_layers_replay; j++)
            total = kv_sat_add(total, kv_sat_mul(kv_sat_add(kv_sat_add(load[j], read[j]), store[j]),
                                                 layer_span[j]));
        return kv_sat_add(start, total);
    }
    if (ctx->timing.store_mode == 0) {
        /*
         * Layer-wise pipelining (LMCache, Mooncake): layer l's KV must be fetched
         * before layer l computes, and can be stored once it has; fetches, compute
         * and stores each run as one stream, in layer order.
         */
        for (uint32_t j = 0; j < g->n_layers_replay; j++) {
            for (uint32_t k = 0; k < layer_span[j]; k++, l++) {
                int64_t comp = comp_q + (l < comp_r ? 1 : 0);

                fd = kv_sat_add(fd, kv_sat_add(load[j], read[j]));
                ce = kv_sat_add(kv_max(ce, fd), comp);
                se = kv_sat_add(kv_max(se, ce), store[j]);
            }
        }
        return kv_sat_add(start, kv_max(ce, se));
    }
    /*
     * Async stores: loads before each layer (overlap 0) or in a fetch stream
     * ahead of compute (overlap 1); in-place reads inside the layer's
     * attention; each layer's stores issued when it ends into a store stream
     * that outlives the step, stalling compute only past the in-flight bound.
     */
    fd = ce = start;
    for (uint32_t j = 0; j < g->n_layers_replay; j++) {
        const uint64_t sbytes = ctx->layer_store_bytes[j];
        const int64_t sdur = store[j];

        for (uint32_t k = 0; k < layer_span[j]; k++, l++) {
            int64_t comp = comp_q + (l < comp_r ? 1 : 0);

            if (g->overlap) {
                fd = kv_sat_add(fd, load[j]);
                ce = kv_max(ce, fd);
            } else {
                ce = kv_sat_add(ce, load[j]);
            }
            ce = kv_sat_add(kv_sat_add(ce, comp), read[j]);
            if (sbytes == 0 && sdur == 0)
                continue;
            kv_sq_retire(ctx, ce);
            /* Past the bound the compute stream waits for the oldest stores to complete. */
            while (ctx->sq_len && ctx->sq_bytes + sbytes > bound) {
                int64_t done = ctx->sq[ctx->sq_head].done_ns;

                if (done > ce) {
                    *stall = kv_sat_add(*stall, done - ce);
                    ce = done;
                }
                kv_sq_retire(ctx, ce);
            }
            ctx->store_free_ns = kv_sat_add(kv_max(ctx->store_free_ns, ce), sdur);
            if (kv_sq_push(ctx, ctx->store_free_ns, sbytes) < 0)
                return -ENOMEM;
        }
    }
    return ce;
}

int64_t kv_replay(struct kv_ctx *ctx,
                  const uint64_t *table_off, uint32_t n_req,
                  const uint32_t *table_slots, uint64_t n_table,
                  const struct kv_step *steps, uint64_t n_steps,
                  const struct kv_entry *entries, uint64_t n_entries,
                  const uint32_t *layer_span, const struct kv_layers *kv,
                  struct kv_step_out *step_out, struct kv_entry_out *entry_out)
{
    static const int phase_order[KV_N_OPS] = { KV_OP_LOAD, KV_OP_READ, KV_OP_STORE };
    const struct kv_replay_args a = {
        .table_off = table_off, .n_req = n_req,
        .table_slots = table_slots, .n_table = n_table,
        .steps = steps, .n_steps = n_steps,
        .entries = entries, .n_entries = n_entries,
        .layer_span = layer_span, .kv = kv, .step_out = step_out, .entry_out = entry_out,
    };
    struct kv_batch *b;
    int rc;

    if (!ctx)
        return -EINVAL;
    if (!ctx->prepared)
        return kv_fail(ctx, -EINVAL, "replay: context is not prepared (call kv_prepare first)");
    rc = kv_validate(ctx, &a);
    if (rc < 0)
        return rc;

    /* ~14 KiB: off the stack, which may be a small Python thread stack. */
    b = malloc(sizeof(*b));
    if (!b)
        return kv_fail(ctx, -ENOMEM, "replay: cannot allocate the access batch");
    if (entry_out && n_entries)
        memset(entry_out, 0, n_entries * sizeof(*entry_out));

    for (uint64_t s = 0; s < n_steps; s++) {
        const struct kv_step *st = &steps[s];
        int64_t op_ns[KV_N_OPS] = { 0, 0, 0 }, start, end, stall;

        /* Steps without accesses still compose every model layer: poll once per step too. */
        if (kv_cancelled(ctx)) {
            rc = kv_cancelled_fail(ctx, "replay");
            goto out;
        }

        for (uint32_t j = 0; j < ctx->geom.n_layers_replay; j++) {
            for (int op = 0; op < KV_N_OPS; op++)
                ctx->layer_ns[op][j] = 0;
            ctx->layer_store_bytes[j] = 0;
            b->layer = j;
            b->span = layer_span[j];
            /* Fetch before compute, store after: the order a serving engine issues them. */
            for (int i = 0; i < KV_N_OPS; i++) {
                b->op = phase_order[i];
                /* Cross-layer: a step's loads before its first layer, its stores after its last. */
                if (ctx->geom.layout == KV_LAYOUT_CROSS_LAYER &&
                    ((b->op == KV_OP_LOAD && j != 0) ||
                     (b->op == KV_OP_STORE && j + 1 != ctx->geom.n_layers_replay)))
                    continue;
                rc = kv_run_phase(ctx, &a, st, b);
                if (rc < 0)
                    goto out;
                ctx->layer_ns[b->op][j] = b->phase_ns;
                if (b->op == KV_OP_STORE)
                    ctx->layer_store_bytes[j] = b->phase_bytes;
                op_ns[b->op] = kv_sat_add(op_ns[b->op], kv_sat_mul(b->phase_ns, b->span));
            }
        }
        start = kv_max(ctx->clock_ns, st->ready_ns);
        end = kv_compose_step(ctx, layer_span, st->compute_ns, start, &stall);
        if (end < 0) {
            rc = (int)end;
            goto out;
        }
        ctx->clock_ns = end;
        step_out[s].load_ns = op_ns[KV_OP_LOAD];
        step_out[s].store_ns = op_ns[KV_OP_STORE];
        step_out[s].read_ns = op_ns[KV_OP_READ];
        step_out[s].step_ns = end - start;
        step_out[s].start_ns = start;
        step_out[s].end_ns = end;
        step_out[s].stall_ns = stall;
    }
    rc = 0;
out:
    free(b);
    return rc < 0 ? rc : (int64_t)n_steps;
}

/* -------------------------------------------------------------- pointer chase */

/* Elements of a chase chain, at most: 16 MiB of indices while building it, and still far more lines than any LLC. */
#define KV_CHASE_MAX_ELEMS (1ull << 22)
#define KV_CHASE_LINE_BYTES 64u
/* Hops between polls for a cancel: ~1.6 ms of DRAM misses, 16 ms at 1 us a hop. */
#define KV_CHASE_POLL_HOPS (1u << 14)

/* splitmix64: a fixed seed, so every run chases the same cycle. */
static uint64_t kv_chase_rand(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int64_t kv_chase_chain(struct kv_ctx *ctx, void **head)
{
    uint64_t lines = ctx->arena_bytes / KV_CHASE_LINE_BYTES, stride, n, seed = 42;
    uint8_t *base = ctx->arena_host;
    uint32_t *order;

    if (!base)
        return kv_fail(ctx, -EOPNOTSUPP, "chase: backend '%s' memory is not host-addressable",
                       ctx->ops->name);
    if (lines < 2)
        return kv_fail(ctx, -EINVAL, "chase: an arena of %" PRIu64 " bytes holds fewer than 2 lines",
                       ctx->arena_bytes);
    stride = (lines + KV_CHASE_MAX_ELEMS - 1) / KV_CHASE_MAX_ELEMS;
    n = lines / stride;
    stride *= KV_CHASE_LINE_BYTES;
    order = malloc(n * sizeof(*order));
    if (!order)
        return kv_fail(ctx, -ENOMEM, "chase: cannot allocate %" PRIu64 " chain indices", n);
    for (uint64_t i = 0; i < n; i++)
        order[i] = (uint32_t)i;
    /* Fisher-Yates; linking successive elements of the shuffle gives one cycle through all. */
    for (uint64_t i = n - 1; i > 0; i--) {
        uint64_t j = kv_chase_rand(&seed) % (i + 1);
        uint32_t tmp = order[i];

        order[i] = order[j];
        order[j] = tmp;
    }
    for (uint64_t i = 0; i < n; i++) {
        void *next = base + (uint64_t)order[(i + 1) % n] * stride;

        memcpy(base + (uint64_t)order[i] * stride, &next, sizeof(next));
    }
    *head = base + (uint64_t)order[0] * stride;
    free(order);
    return (int64_t)n;
}

void *kv_chase_walk(void *p, uint64_t hops)
{
    /* memcpy keeps the loads free of aliasing rules; each still depends on the one before. */
    for (uint64_t i = 0; i < hops; i++)
        memcpy(&p, p, sizeof(p));
    return p;
}

int kv_chase(struct kv_ctx *ctx, uint64_t hops, double *ns_per_hop)
{
    const struct kv_timer *t;
    uint64_t t0, t1;
    void *p = NULL;
    int64_t rc;

    if (!ctx)
        return -EINVAL;
    if (!ns_per_hop)
        return kv_fail(ctx, -EINVAL, "chase: ns_per_hop is NULL");
    if (!ctx->prepared)
        return kv_fail(ctx, -EINVAL, "chase: context is not prepared (call kv_prepare first)");
    if (hops == 0)
        return kv_fail(ctx, -EINVAL, "chase: hops must be at least 1");
    if (kv_cancelled(ctx))
        return kv_cancelled_fail(ctx, "chase");
    if (ctx->ops->chase)
        return ctx->ops->chase(ctx, hops, ns_per_hop);

    rc = kv_chase_chain(ctx, &p);
    if (rc < 0)
        return (int)rc;
    p = kv_chase_walk(p, kv_chase_warmup_hops(hops));
    t = &ctx->timer;
    t0 = kv_timer_ticks(t);
    /* In pieces that take milliseconds even on slow memory, polling for a cancel between them. */
    for (uint64_t left = hops; left;) {
        uint64_t piece = left < KV_CHASE_POLL_HOPS ? left : KV_CHASE_POLL_HOPS;

        if (kv_cancelled(ctx))
            return kv_cancelled_fail(ctx, "chase");
        p = kv_chase_walk(p, piece);
        left -= piece;
    }
    t1 = kv_timer_ticks(t);
    ctx->read_sink += (uint64_t)(uintptr_t)p;
    *ns_per_hop = (double)(t1 - t0) * t->ns_per_tick / (double)hops;
    return 0;
}
