/*
 * emu.c - emulated tiers: a tier this host does not have (CXL memory, a pooled
 * memory tier, remote memory over RDMA, an NVMe drive), given as a profile of
 * latency_ns, bandwidth (gbps), concurrency and per-access overhead_ns
 * (kvemu/profiles.py resolves profiles and writes the options; the model is
 * specified in docs/tier-profiles.md).
 *
 * Two backends share the model:
 *  - emu performs every access on host memory with memtier's transfer code
 *    (memcpy for loads and stores, one 8-byte load per cache line for reads;
 *    no write-back, one worker unless workers=N) and then busy-waits on the
 *    timer until the model says the access completes.
 *    Deadlines are absolute timer values, so waiting errors do not add up, and
 *    waits shorter than EMU_PAY_MIN_NS are deferred until the debt reaches it
 *    (sub-microsecond delays stay exact in total; a waiting loop alone is off
 *    by tens of ns); a batch pays what it owes before it returns, and its busy
 *    time is the wall clock. The run really takes the time the profile says.
 *  - vemu (virtual time) moves no data and never waits: latencies and busy
 *    time come from the model alone, for fast sweeps.
 *
 * Caveats:
 *  - The floor. emu cannot be faster than the host: when an access is still
 *    running on the host at its modelled completion, no delay is added, its
 *    time is the host's, and the floor hit is counted (describe: floor_hits of
 *    accesses, floor_ns the host's own mean time per access). A profile faster
 *    than this host (HBM, local DRAM on a VM) is not emulated, and results say so.
 *  - One thread performs the accesses a tier with concurrency > 1 overlaps.
 *    While the model has accesses in flight the host works ahead, so a host
 *    that keeps up on average is no floor hit even when one access is slow.
 *    An access that completes late (a floor hit, or the thread preempted)
 *    moves the rest of its batch's schedule by its lateness, as a stalled
 *    tier would: the accesses after it keep the profile's latencies.
 *  - The model restarts at each backend call (up to 256 accesses of one op):
 *    accesses of different calls never overlap.
 *  - No cache flush (cold=1 is refused): the profile sets the time; a cache
 *    hit only lowers the floor.
 *  - Memory as dram's (memtier.c): huge pages advised (hugepages=1), arena and
 *    staging pre-faulted, refused beyond available memory.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memtier.h"

/* Delay owed is paid once it reaches this: above the waiting loop's error by ~30x. */
#define EMU_PAY_MIN_NS 1000.0
#define EMU_NAME_MAX 64
/* More in flight than any batch holds changes nothing; the cap keeps the number printable. */
#define EMU_MAX_CONCURRENCY (1u << 20)

struct emu_profile {
    char name[EMU_NAME_MAX + 1];
    int storage;                /* kind: 0 memory, 1 storage (reported; the model is the same) */
    double latency_ns, gbps, overhead_ns;
    uint32_t concurrency;
};

struct emu_data {
    struct memtier mt;          /* first: emu's memory is memtier's; vemu leaves it empty */
    int virtual_time;           /* vemu */
    int have_latency, have_gbps, have_concurrency;
    struct emu_profile pr;
    double ticks_per_ns;
    uint64_t pay_min_ticks;
    uint64_t sched_end;         /* timer value at which the last batch completes in the model */
    uint64_t wall_end;          /* timer reading when the last batch returned */

    /* Counters since open; hops of kv_chase apart from block accesses. */
    uint64_t accesses, floor_hits, bytes, host_ticks;
    uint64_t hops, hop_floor_hits, hop_host_ticks;

    /* Model of the current batch, ns from its start. */
    double issue_ns[KV_BATCH], done_ns[KV_BATCH];
};

/* ------------------------------------------------------------------ options */

static const char *emu_name(const struct emu_data *d)
{
    return d->virtual_time ? "vemu" : "emu";
}

static int emu_valid_name(const char *v, size_t n)
{
    if (n == 0 || n > EMU_NAME_MAX)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = v[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                 (i > 0 && (c == '-' || c == '_' || c == '.'));
        if (!ok)
            return 0;
    }
    return 1;
}

static const struct kv_opt_key emu_keys[] = {
    { "latency_ns", "X" },
    { "gbps", "X" },
    { "concurrency", "N" },
    { "overhead_ns", "X" },
    { "name", "S" },
    { "kind", "memory|storage" },
    { NULL, NULL },
};

/* A profile option (memtier_kind.option; vemu's every option): 0, or -errno after kv_fail. */
static int emu_option(struct kv_ctx *ctx, struct memtier *m, const struct kv_opt *o)
{
    struct emu_data *d = memtier_container(m, struct emu_data);
    struct emu_profile *pr = &d->pr;
    uint64_t c;
    int rc;

    if (kv_opt_is(o, "latency_ns")) {
        d->have_latency = 1;
        return kv_opt_double(ctx, o, &pr->latency_ns);
    }
    if (kv_opt_is(o, "gbps")) {
        d->have_gbps = 1;
        rc = kv_opt_double(ctx, o, &pr->gbps);
        return rc == 0 && pr->gbps <= 0 ? kv_opt_bad(ctx, o, "a finite number > 0") : rc;
    }
    if (kv_opt_is(o, "overhead_ns"))
        return kv_opt_double(ctx, o, &pr->overhead_ns);
    if (kv_opt_is(o, "concurrency")) {
        d->have_concurrency = 1;
        rc = kv_opt_u64(ctx, o, 1, EMU_MAX_CONCURRENCY, &c);
        if (rc == 0)
            pr->concurrency = (uint32_t)c;
        return rc;
    }
    if (kv_opt_is(o, "name")) {
        char must[96];

        if (emu_valid_name(o->val, o->val_len)) {
            snprintf(pr->name, sizeof(pr->name), "%.*s", (int)o->val_len, o->val);
            return 0;
        }
        snprintf(must, sizeof(must), "1..%d of [A-Za-z0-9._-], starting with a letter or digit",
                 EMU_NAME_MAX);
        return kv_opt_bad(ctx, o, must);
    }
    return kv_opt_choice(ctx, o, &pr->storage);     /* kind: memory 0, storage 1 */
}

static const struct memtier_kind emu_kind = {
    .ops = &kv_emu_ops,
    .data_bytes = sizeof(struct emu_data),
    .keys = emu_keys,
    .option = emu_option,
    .cold_refused = "emu never flushes caches (the profile sets the time; a cache hit only lowers "
                    "the floor)",
};

static int emu_finish_open(struct kv_ctx *ctx, struct emu_data *d)
{
    if (!d->have_latency || !d->have_gbps || !d->have_concurrency)
        return kv_fail(ctx, -EINVAL, "%s: a profile needs latency_ns, gbps and concurrency "
                       "(give one as %s:NAME or %s:PATH.toml)", emu_name(d), emu_name(d),
                       emu_name(d));
    if (!d->pr.name[0])
        strcpy(d->pr.name, "custom");
    d->ticks_per_ns = ctx->timer.use_tsc ? ctx->timer.tsc_ghz : 1.0;
    d->pay_min_ticks = (uint64_t)(EMU_PAY_MIN_NS * d->ticks_per_ns);
    return 0;
}

static int emu_open(struct kv_ctx *ctx, const char *args)
{
    struct emu_data *d;
    int rc;

    rc = memtier_open(ctx, &emu_kind, args);
    if (rc < 0)
        return rc;
    d = ctx->backend_data;
    /*
     * The profile's concurrency models the tier; transfer workers (workers=N, default 1) only
     * move each access's bytes, so that this host keeps up with a faster profile.
     * No write-back: the profile, not this host's memory, sets a store's time.
     */
    d->mt.writeback = MEMTIER_WB_NONE;
    /* One worker unless asked: pacing is on this thread, and a pinned pool makes a busy host worse. */
    if (d->mt.workers_requested == 0)
        d->mt.workers_requested = 1;
    rc = emu_finish_open(ctx, d);
    if (rc < 0)
        memtier_discard(ctx);
    return rc;
}

/* vemu has no memory: the profile options only. */
static int vemu_open(struct kv_ctx *ctx, const char *args)
{
    static const struct memtier_kind vemu_kind = { .ops = &kv_vemu_ops };
    struct emu_data *d = calloc(1, sizeof(*d));
    struct kv_opts opts;
    struct kv_opt o;
    int rc = 0;

    if (!d)
        return kv_fail(ctx, -ENOMEM, "vemu: cannot allocate backend state");
    d->mt.kind = &vemu_kind;
    d->virtual_time = 1;
    kv_opts_init(&opts, ctx, "vemu", args, emu_keys, NULL);
    while (rc == 0 && (rc = kv_opts_next(&opts, &o)) > 0)
        rc = emu_option(ctx, &d->mt, &o);
    if (rc == 0)
        rc = emu_finish_open(ctx, d);
    if (rc < 0) {
        free(d);
        return rc;
    }
    ctx->backend_data = d;
    return 0;
}

/* ------------------------------------------------------------------- memory */

static int emu_prepare(struct kv_ctx *ctx, uint64_t arena_bytes, uint64_t staging_bytes)
{
    struct emu_data *d = ctx->backend_data;

    return memtier_prepare_anon(ctx, &d->mt, arena_bytes, staging_bytes, NULL);
}

/* Virtual time needs no memory: offsets are checked by the core and never dereferenced. */
static int vemu_prepare(struct kv_ctx *ctx, uint64_t arena_bytes, uint64_t staging_bytes)
{
    (void)ctx;
    (void)arena_bytes;
    (void)staging_bytes;
    return 0;
}

/* Each instance models its own link to the tier; there is no memory to share. */
static int vemu_attach(struct kv_ctx *ctx, const struct kv_ctx *owner, uint64_t staging_bytes)
{
    (void)ctx;
    (void)owner;
    (void)staging_bytes;
    return 0;
}

/* -------------------------------------------------------------------- model */

/*
 * The batch model (docs/tier-profiles.md), in ns from the batch's start. One
 * CPU issues the accesses in order, overhead_ns each, and access k cannot be
 * issued before access k - concurrency completed; latency_ns after its issue
 * its data can move, over one link of gbps bytes/ns shared in issue order:
 *   issue_k = max(issue_{k-1} + o, done_{k-c})
 *   done_k  = max(done_{k-1}, issue_k + o + L) + bytes_k / B
 * kvemu/profiles.py (batch_times) computes the same, in the same order.
 */
static void emu_model(const struct emu_profile *pr, const struct kv_access *acc, uint32_t n,
                      double *issue, double *done)
{
    const double o = pr->overhead_ns, lat = pr->latency_ns, bw = pr->gbps;
    const uint32_t c = pr->concurrency;
    double cpu_free = 0.0, link_free = 0.0;

    for (uint32_t k = 0; k < n; k++) {
        double slot = k >= c ? done[k - c] : 0.0;
        double start = cpu_free > slot ? cpu_free : slot;
        double ready;

        issue[k] = start;
        cpu_free = start + o;
        ready = cpu_free + lat;
        done[k] = (link_free > ready ? link_free : ready) + (double)acc[k].bytes / bw;
        link_free = done[k];
    }
}

/* Rounded to the nearest integer, saturating: a tiny bandwidth must not overflow the cast. */
static inline uint64_t emu_round(double x)
{
    return x <= 0 ? 0 : x >= 1.8e19 ? UINT64_MAX : (uint64_t)(x + 0.5);
}

static int vemu_access(struct kv_ctx *ctx, int op, const struct kv_access *acc, uint32_t n,
                       uint64_t *lat_ns, uint64_t *busy_ns)
{
    struct emu_data *d = ctx->backend_data;

    if (op < 0 || op >= KV_N_OPS)
        return kv_fail(ctx, -EINVAL, "vemu: unknown op %d", op);
    emu_model(&d->pr, acc, n, d->issue_ns, d->done_ns);
    for (uint32_t k = 0; k < n; k++) {
        lat_ns[k] = emu_round(d->done_ns[k] - d->issue_ns[k]);
        d->bytes += acc[k].bytes;
    }
    d->accesses += n;
    *busy_ns = n ? emu_round(d->done_ns[n - 1]) : 0;
    return (int)n;
}

/* ------------------------------------------------------------------- pacing */

static inline void emu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __asm__ __volatile__("pause" ::: "memory");
#endif
}

/*
 * Waits until the timer reads at least deadline and sets *now to the reading that ended the
 * wait. Polls for a cancel on every round (a relaxed load, beside a timer read of tens of ns):
 * returns 0, or -EINTR when cancelled, *now then the reading that saw it.
 */
static int emu_wait_until(struct kv_ctx *ctx, uint64_t deadline, uint64_t *now)
{
    const struct kv_timer *t = &ctx->timer;

    while ((*now = kv_timer_ticks(t)) < deadline) {
        if (kv_cancelled(ctx))
            return kv_cancelled_fail(ctx, emu_name(ctx->backend_data));
        emu_relax();
    }
    return 0;
}

static inline uint64_t emu_ticks(const struct emu_data *d, double ns)
{
    return emu_round(ns * d->ticks_per_ns);
}

static int emu_access(struct kv_ctx *ctx, int op, const struct kv_access *acc, uint32_t n,
                      uint64_t *lat_ns, uint64_t *busy_ns)
{
    struct emu_data *d = ctx->backend_data;
    const struct kv_timer *t = &ctx->timer;
    uint64_t start, t0, now, begin, end = 0, wall_start;

    if (op < 0 || op >= KV_N_OPS)
        return kv_fail(ctx, -EINVAL, "emu: unknown op %d", op);
    if (n == 0) {
        *busy_ns = 0;
        return 0;
    }
    emu_model(&d->pr, acc, n, d->issue_ns, d->done_ns);
    /*
     * A batch starts when the previous one completed in the model, even if that is still owed.
     * Back-to-back calls (the core's bookkeeping between them is well under EMU_PAY_MIN_NS) also
     * start there: otherwise that gap and the last wait's overshoot would be charged to every
     * access of the next batch. A longer gap is real idle time, and the batch starts now.
     */
    begin = now = kv_timer_ticks(t);
    start = t0 = now > d->sched_end + d->pay_min_ticks ? now : d->sched_end;
    /* Wall-clock busy time: back-to-back batches continue from where the last one returned. */
    wall_start = start == now ? now : d->wall_end;
    for (uint32_t k = 0; k < n; k++) {
        uint64_t deadline, issue, host_lat, host_busy;

        /* The bytes move with the transfer workers (memtier.c), the access split among them. */
        int rc = memtier_access(ctx, op, &acc[k], 1, &host_lat, &host_busy);

        if (rc < 0)
            return rc;
        now = kv_timer_ticks(t);
        d->host_ticks += now - begin;
        deadline = t0 + emu_ticks(d, d->done_ns[k]);
        issue = t0 + emu_ticks(d, d->issue_ns[k]);
        if (now > deadline) {
            /* Late: the access completes now, and the rest of the batch's schedule moves with it. */
            d->floor_hits++;
            t0 += now - deadline;
            end = now;
        } else {
            end = deadline;
            if (deadline - now >= d->pay_min_ticks && (rc = emu_wait_until(ctx, deadline, &now)) < 0)
                return rc;
        }
        lat_ns[k] = kv_timer_ns(t, end - issue);
        d->bytes += acc[k].bytes;
        begin = now;
    }
    /*
     * The batch ends at its last completion, paid in full, and its busy time is the wall clock
     * from its start to the reading that ended the wait: what the run really took, not the
     * model's deadline (they differ by the waiting loop's error, tens of ns per batch).
     */
    if (end > now) {
        int rc = emu_wait_until(ctx, end, &now);

        if (rc < 0)
            return rc;
    }
    d->sched_end = end;
    d->wall_end = now;
    d->accesses += n;
    *busy_ns = kv_timer_ns(t, now > wall_start ? now - wall_start : 0);
    return (int)n;
}

/* -------------------------------------------------------------------- chase */

/*
 * Each hop depends on the one before, so it cannot hide in another's time:
 * hop i ends max(host time, o + L) after hop i-1 ended. Waits are deferred
 * like the accesses' and paid in full before the clock stops.
 */
static int emu_chase(struct kv_ctx *ctx, uint64_t hops, double *ns_per_hop)
{
    struct emu_data *d = ctx->backend_data;
    const struct kv_timer *t = &ctx->timer;
    const uint64_t hop_ticks = emu_ticks(d, d->pr.overhead_ns + d->pr.latency_ns);
    uint64_t start, prev, now, sched;
    void *p = NULL;
    int64_t rc;

    rc = kv_chase_chain(ctx, &p);
    if (rc < 0)
        return (int)rc;
    p = kv_chase_walk(p, kv_chase_warmup_hops(hops));
    start = prev = sched = kv_timer_ticks(t);
    for (uint64_t i = 0; i < hops; i++) {
        uint64_t host;

        /* Waits poll on their own; hops at the host's pace (floor hits) poll here. */
        if ((i & 16383u) == 0 && kv_cancelled(ctx))
            return kv_cancelled_fail(ctx, "emu");
        memcpy(&p, p, sizeof(p));
        now = kv_timer_ticks(t);
        host = now - prev;
        d->hop_host_ticks += host;
        if (host > hop_ticks) {
            d->hop_floor_hits++;
            sched += host;
        } else {
            sched += hop_ticks;
        }
        if (sched > now && sched - now >= d->pay_min_ticks &&
            (rc = emu_wait_until(ctx, sched, &now)) < 0)
            return (int)rc;
        prev = now;
    }
    rc = emu_wait_until(ctx, sched, &now);
    if (rc < 0)
        return (int)rc;
    d->hops += hops;
    ctx->read_sink += (uint64_t)(uintptr_t)p;
    *ns_per_hop = (double)(now - start) * t->ns_per_tick / (double)hops;
    return 0;
}

/* The model's hop: one dependent load of a line, o + L by the definition of latency_ns. */
static int vemu_chase(struct kv_ctx *ctx, uint64_t hops, double *ns_per_hop)
{
    struct emu_data *d = ctx->backend_data;

    d->hops += hops;
    *ns_per_hop = d->pr.overhead_ns + d->pr.latency_ns;
    return 0;
}

/* ----------------------------------------------------------------- describe */

static int emu_describe(struct kv_ctx *ctx, char *buf, size_t len)
{
    const struct emu_data *d = ctx->backend_data;
    const struct emu_profile *pr = &d->pr;
    const double ns_per_tick = ctx->timer.ns_per_tick;
    size_t pos = 0;

    kv_appendf(buf, len, &pos,
               ",\"mode\":\"%s\",\"profile\":{\"name\":\"%s\",\"kind\":\"%s\",\"latency_ns\":%.17g"
               ",\"bandwidth_gbps\":%.17g,\"concurrency\":%u,\"overhead_ns\":%.17g}"
               ",\"accesses\":%" PRIu64 ",\"bytes\":%" PRIu64 ",\"hops\":%" PRIu64,
               d->virtual_time ? "emulated-virtual" : "emulated", pr->name,
               pr->storage ? "storage" : "memory", pr->latency_ns, pr->gbps, pr->concurrency,
               pr->overhead_ns, d->accesses, d->bytes, d->hops);
    if (d->virtual_time) {
        kv_appendf(buf, len, &pos, ",\"virtual\":true");
        return (int)pos;
    }
    kv_appendf(buf, len, &pos,
               ",\"virtual\":false,\"floor_hits\":%" PRIu64 ",\"hop_floor_hits\":%" PRIu64
               ",\"pay_min_ns\":%.0f", d->floor_hits, d->hop_floor_hits, EMU_PAY_MIN_NS);
    /* The host's own time per access and per hop, before any delay: what emu cannot go below. */
    if (d->accesses)
        kv_appendf(buf, len, &pos, ",\"floor_ns\":%.1f,\"floor_gbps\":%.4g",
                   (double)d->host_ticks * ns_per_tick / (double)d->accesses,
                   d->host_ticks ? (double)d->bytes / ((double)d->host_ticks * ns_per_tick) : 0.0);
    else
        kv_appendf(buf, len, &pos, ",\"floor_ns\":null,\"floor_gbps\":null");
    if (d->hops)
        kv_appendf(buf, len, &pos, ",\"hop_floor_ns\":%.1f",
                   (double)d->hop_host_ticks * ns_per_tick / (double)d->hops);
    else
        kv_appendf(buf, len, &pos, ",\"hop_floor_ns\":null");
    /* Memory facts as dram's: page size, huge pages, pre-faulting, cache_cold (always false). */
    {
        int n = memtier_describe(ctx, pos < len ? buf + pos : NULL, pos < len ? len - pos : 0);

        if (n < 0)
            return n;
        pos += (size_t)n;
    }
    return (int)pos;
}

static void vemu_close(struct kv_ctx *ctx)
{
    free(ctx->backend_data);
    ctx->backend_data = NULL;
}

const struct kv_backend_ops kv_emu_ops = {
    .version = KV_OPS_VERSION,
    .name = "emu",
    .open = emu_open,
    .prepare = emu_prepare,
    .access = emu_access,
    .describe = emu_describe,
    .close = memtier_close,
    .chase = emu_chase,
    .attach = memtier_attach,
};

const struct kv_backend_ops kv_vemu_ops = {
    .version = KV_OPS_VERSION,
    .name = "vemu",
    .open = vemu_open,
    .prepare = vemu_prepare,
    .access = vemu_access,
    .describe = emu_describe,
    .close = vemu_close,
    .chase = vemu_chase,
    .attach = vemu_attach,
};
