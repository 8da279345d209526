/*
 * backend.h - what the replay core shares with its backends. Not public: Python
 * never sees the ops table or the context layout (see kvemu.h for that).
 *
 * Include after defining _GNU_SOURCE: the timer needs CLOCK_MONOTONIC_RAW.
 */
#ifndef KVEMU_BACKEND_H
#define KVEMU_BACKEND_H

#include <stdint.h>
#include <time.h>

#include "kvemu.h"

#if defined(__GNUC__)
#define KV_INTERNAL __attribute__((visibility("hidden")))
#define KV_PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define KV_INTERNAL
#define KV_PRINTF(fmt, args)
#endif

#ifndef CLOCK_MONOTONIC_RAW
#define CLOCK_MONOTONIC_RAW CLOCK_MONOTONIC
#endif

/* Accesses per backend call: large enough to amortise the call, small enough for the stack. */
#define KV_BATCH 256u

/* Histogram shape; see kv_hist_bucket_lower_ns in kvemu.h. */
#define KV_HIST_SUB_BITS 6u
#define KV_HIST_EXACT (1u << KV_HIST_SUB_BITS)
#define KV_HIST_MAX_EXP 40u
#define KV_HIST_N_BUCKETS (KV_HIST_EXACT + (KV_HIST_MAX_EXP - KV_HIST_SUB_BITS) * KV_HIST_EXACT)

/*
 * A backend: one const table per tier, checked once by kv_backend_open (version
 * equal to KV_OPS_VERSION, name and required hooks non-NULL). Hooks return
 * >= 0 or -errno and explain failures with kv_fail(ctx, ...). Private state
 * goes in ctx->backend_data.
 */
struct kv_backend_ops {
    uint32_t version;   /* KV_OPS_VERSION the table was written against */
    const char *name;   /* what kv_backend_open matches; a plain identifier (goes into JSON) */

    /*
     * Required. Called once, from kv_backend_open, with args never NULL ("" for
     * defaults). Parses args, allocates private state into ctx->backend_data.
     * On failure it must leave nothing allocated: close is not called then.
     */
    int (*open)(struct kv_ctx *ctx, const char *args);

    /*
     * Required. Called at most once successfully, from kv_prepare, after the
     * geometry was validated. Allocates the arena (arena_bytes > 0) and the
     * staging buffer (a whole number of blocks) and pre-faults both, so that no
     * fault lands inside a timed access. Sets ctx->arena_host/staging_host when
     * that memory is addressable from the host, leaves them NULL otherwise. On
     * failure it must release what this call allocated; kv_prepare may be
     * called again.
     */
    int (*prepare)(struct kv_ctx *ctx, uint64_t arena_bytes, uint64_t staging_bytes);

    /*
     * Required. Performs n (1..KV_BATCH) accesses of one op and writes the
     * latency of each, in ns, to lat_ns[i] (issue to completion), and to
     * *busy_ns the time the batch kept the tier busy: the sum of the
     * latencies for a backend that performs accesses one after another, the
     * elapsed time from first issue to last completion for one that keeps
     * several in flight (the core uses busy_ns for step time and shares it
     * among the accesses in proportion to their latencies). The core
     * guarantees arena_off + bytes <= arena_bytes and, for loads and stores,
     * staging_off + bytes <= staging_bytes. Time with kv_timer_ticks around
     * the accesses only, so batching and housekeeping (cache flushes) do not
     * show up. Reads add what they load to ctx->read_sink. Returns n or -errno.
     */
    int (*access)(struct kv_ctx *ctx, int op, const struct kv_access *acc, uint32_t n,
                  uint64_t *lat_ns, uint64_t *busy_ns);

    /*
     * Optional. Writes the backend's own facts as JSON members, each preceded
     * by a comma (`,"page_size":4096`), NUL-terminated, into buf[len] (use
     * kv_appendf). Returns the length it needed, like snprintf; the core
     * reports -ENOSPC when that does not fit. Called before or after prepare.
     */
    int (*describe)(struct kv_ctx *ctx, char *buf, size_t len);

    /*
     * Optional. Called once, from kv_ctx_free, if open succeeded: releases
     * everything open and prepare allocated.
     */
    void (*close)(struct kv_ctx *ctx);

    /*
     * Optional; last so that tables written before it stay valid. Called by
     * kv_chase after it checked its arguments (prepared, hops >= 1): measures
     * the idle latency of one dependent access, as a pointer chase over the
     * arena would, and writes the mean ns per hop. For a backend whose accesses
     * the host cannot chase itself, or whose time is not the host's (emulated
     * tiers). Without it kv_chase chases over arena_host (kv_chase_chain and
     * kv_chase_walk), or reports -EOPNOTSUPP when arena_host is NULL. May
     * overwrite the arena's contents.
     */
    int (*chase)(struct kv_ctx *ctx, uint64_t hops, double *ns_per_hop);

    /*
     * Optional. Called once instead of prepare, from kv_prepare_attached, when
     * this context replays another serving instance on the same tier: it uses
     * owner's arena (owner is open on the same backend, prepared with the same
     * geometry, and outlives this context) and maps its own staging buffer of
     * staging_bytes. close must then release the staging buffer only, never
     * the borrowed arena. Without it, sharing an arena is refused with
     * -EOPNOTSUPP.
     */
    int (*attach)(struct kv_ctx *ctx, const struct kv_ctx *owner, uint64_t staging_bytes);
};

struct kv_timer {
    int use_tsc;          /* 1: rdtsc ticks; 0: CLOCK_MONOTONIC_RAW ns */
    double ns_per_tick;
    double tsc_ghz;       /* calibrated rate, 0 when the TSC is not used */
};

struct kv_op_hist {
    uint64_t counts[KV_HIST_N_BUCKETS];
    uint64_t accesses, bytes, time_ns, busy_ns;
    uint64_t link_ns, charged_ns, medium_bound_ns;  /* the data path's, see kv_datapath_stats */
};

/* An asynchronous store in flight: when it completes, and its bytes. */
struct kv_store_slot {
    int64_t done_ns;
    uint64_t bytes;
};

/* The context, laid out here because backends read the timer and their state from it. */
struct kv_ctx {
    const struct kv_backend_ops *ops;   /* NULL until kv_backend_open succeeds */
    void *backend_data;                 /* owned by the backend */
    struct kv_timer timer;

    int prepared;
    struct kv_geom geom;
    uint64_t arena_bytes, staging_bytes;
    uint64_t staging_cursor;            /* next staging offset; persists across replays */
    uint8_t *arena_host, *staging_host; /* set by prepare when host-addressable; tests only */

    /* Reads sum what they load here, so the compiler cannot drop the loads. */
    uint64_t read_sink;

    /* Per-step scratch, one value per replayed layer, sized by kv_prepare: each op's charged time. */
    int64_t *layer_ns[KV_N_OPS];
    uint64_t *layer_store_bytes;

    /* Composition and timeline (kv_set_timing, kv_timeline). */
    struct kv_timing timing;
    int64_t clock_ns;               /* end of the last step */
    int64_t store_free_ns;          /* when the async store stream is idle */
    struct kv_store_slot *sq;       /* ring of async stores in flight */
    uint64_t sq_cap, sq_head, sq_len, sq_bytes;

    struct kv_op_hist stats[KV_N_OPS];
    char msg[512];

    /* Set by kv_cancel, possibly from another thread; read it with kv_cancelled. Never cleared. */
    int cancel;

    /*
     * References: the caller's (kv_ctx_new .. kv_ctx_free) and one per context attached to this
     * one's arena (kv_prepare_attached), so that the arena outlives every context replaying on it.
     */
    uint32_t refs;
    struct kv_ctx *arena_owner;     /* the context whose arena this one borrows, or NULL */
};

/* Backends, one const table each; the registry in core.c lists them. */
extern const struct kv_backend_ops kv_dram_ops KV_INTERNAL;
extern const struct kv_backend_ops kv_numa_ops KV_INTERNAL;
extern const struct kv_backend_ops kv_mmap_ops KV_INTERNAL;
extern const struct kv_backend_ops kv_uring_ops KV_INTERNAL;
extern const struct kv_backend_ops kv_emu_ops KV_INTERNAL;
extern const struct kv_backend_ops kv_vemu_ops KV_INTERNAL;
extern const struct kv_backend_ops kv_store_ops KV_INTERNAL;

/*
 * Cancellation (kv_cancel in kvemu.h). Every wait and every loop that can run
 * long (a busy-wait to a deadline, an io_uring completion wait, a pre-fault,
 * a pointer chase, the replay's batches) polls kv_cancelled at least every
 * KV_CANCEL_POLL_NS of its own time and then returns kv_cancelled_fail(ctx,
 * what): -EINTR with "WHAT: cancelled". A relaxed load: only the flag is
 * shared, and a poll that misses a store sees it on the next round.
 */
#define KV_CANCEL_POLL_NS 50000000ull

static inline int kv_cancelled(const struct kv_ctx *ctx)
{
    return __atomic_load_n(&ctx->cancel, __ATOMIC_RELAXED);
}

int kv_cancelled_fail(struct kv_ctx *ctx, const char *what) KV_INTERNAL;

/* Formats the failure message into ctx and returns rc (a -errno), for `return kv_fail(...)`. */
int kv_fail(struct kv_ctx *ctx, int rc, const char *fmt, ...) KV_INTERNAL KV_PRINTF(3, 4);

/*
 * Backend options: after a backend's positional part (a path, a node), one
 * comma-separated list of key=value (empty items skipped), parsed here for
 * every backend against the keys it declares, so that every backend reports
 * the same mistakes the same way: "B: unknown option 'X' (known: k=SYNTAX,
 * ...)", "B: option K needs a value: K=SYNTAX", "B: option K given twice",
 * and for a value the typed helpers refuse "B: option K is 'V', must be ...".
 */
struct kv_opt_key {
    const char *key;        /* NULL ends a list */
    const char *syntax;     /* its value as messages show it ("0|1", "N"); kv_opt_choice's choices */
};

struct kv_opts {
    struct kv_ctx *ctx;
    const char *backend;                /* prefixes every message */
    const struct kv_opt_key *keys[2];   /* the backend's keys, then shared ones (or NULL) */
    const char *p;                      /* what is left to parse */
    uint64_t seen;                      /* bit per key index: given already */
};

/* One option kv_opts_next accepted: a declared key, given once, with a value (maybe empty). */
struct kv_opt {
    const char *backend;
    const struct kv_opt_key *decl;      /* the declared key */
    const char *key;                    /* decl->key */
    int table;                          /* 0: from keys[0], 1: from keys[1] */
    const char *text, *val;             /* the whole key=value, len bytes; its value, val_len bytes */
    size_t len, val_len;
};

void kv_opts_init(struct kv_opts *s, struct kv_ctx *ctx, const char *backend, const char *args,
                  const struct kv_opt_key *keys, const struct kv_opt_key *more) KV_INTERNAL;

/* 1 with the next option in *o, 0 at the end, or -EINVAL after kv_fail (unknown, no '=', twice). */
int kv_opts_next(struct kv_opts *s, struct kv_opt *o) KV_INTERNAL;

/* 1 when o names key. */
int kv_opt_is(const struct kv_opt *o, const char *key) KV_INTERNAL;

/* Typed values: 0, or -EINVAL after kv_fail(ctx, "B: option K is 'V', must be ..."). */
int kv_opt_u64(struct kv_ctx *ctx, const struct kv_opt *o, uint64_t min, uint64_t max,
               uint64_t *out) KV_INTERNAL;
int kv_opt_double(struct kv_ctx *ctx, const struct kv_opt *o, double *out) KV_INTERNAL; /* >= 0 */
int kv_opt_bool(struct kv_ctx *ctx, const struct kv_opt *o, int *out) KV_INTERNAL;    /* 0|1 */
/* The index of the value among the '|'-separated choices of o's syntax. */
int kv_opt_choice(struct kv_ctx *ctx, const struct kv_opt *o, int *out) KV_INTERNAL;
/* The value-error message for a check of the backend's own: "..., must be <must>". */
int kv_opt_bad(struct kv_ctx *ctx, const struct kv_opt *o, const char *must) KV_INTERNAL;

/* The positional part of args (before the first comma): its length; *rest follows the comma. */
size_t kv_opt_positional(const char *args, const char **rest) KV_INTERNAL;

/* s[0 .. len) as a decimal uint64 (digits only: no sign, space or suffix); 0 or -EINVAL. */
int kv_parse_u64(const char *s, size_t len, uint64_t *out) KV_INTERNAL;

/*
 * snprintf at buf + *pos that advances *pos by what it needed even when that
 * does not fit, so the caller learns the required length at the end.
 */
void kv_appendf(char *buf, size_t len, size_t *pos, const char *fmt, ...) KV_INTERNAL
    KV_PRINTF(4, 5);

/*
 * Pointer-chase helpers for chase hooks. kv_chase_chain links the arena's
 * elements (one pointer per element, elements at least a cache line apart, at
 * most 4 Mi of them) into one random cycle, visiting all, and stores its first
 * element in *head; returns the number of elements or -errno. kv_chase_walk
 * follows hops links from p and returns where it stopped (each load depends on
 * the one before, so none overlap).
 */
int64_t kv_chase_chain(struct kv_ctx *ctx, void **head) KV_INTERNAL;
void *kv_chase_walk(void *p, uint64_t hops) KV_INTERNAL;

/* Untimed hops before a timed chase of hops: min(hops / 8, 65536), as kv_chase documents. */
static inline uint64_t kv_chase_warmup_hops(uint64_t hops)
{
    return hops / 8 < 65536u ? hops / 8 : 65536u;
}

/*
 * KV_NO_TSC builds the clock_gettime path only, as on other architectures;
 * tests use it to exercise that path on x86-64.
 */
#if defined(__x86_64__) && !defined(KV_NO_TSC)
#define KV_HAVE_TSC 1
#endif

/*
 * Reads the timer. On x86-64 with an invariant TSC the lfences keep the read
 * from moving across the loads and stores being timed; "memory" keeps the
 * compiler from doing so. Elsewhere it is CLOCK_MONOTONIC_RAW, ~20-30 ns a read.
 */
static inline uint64_t kv_timer_ticks(const struct kv_timer *t)
{
#if defined(KV_HAVE_TSC)
    if (t->use_tsc) {
        uint32_t lo, hi;
        __asm__ __volatile__("lfence\n\trdtsc\n\tlfence" : "=a"(lo), "=d"(hi) : : "memory");
        return ((uint64_t)hi << 32) | lo;
    }
#endif
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_RAW, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint64_t kv_timer_ns(const struct kv_timer *t, uint64_t ticks)
{
    return (uint64_t)((double)ticks * t->ns_per_tick + 0.5);
}

#endif /* KVEMU_BACKEND_H */
