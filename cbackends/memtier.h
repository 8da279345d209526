/*
 * memtier.h - what the host-addressable memory tiers (dram, numa, mmap) share.
 * Internal to the backends: the core and Python never see it.
 *
 * Such a tier is an arena the CPU reaches with plain loads and stores plus a
 * staging buffer (the HBM stand-in) in local anonymous memory. The tiers
 * differ only in how they obtain the arena (anonymous memory, memory bound to
 * a NUMA node, a shared mapping of a file or device); parsing options,
 * mapping and pre-faulting anonymous memory, the timed access loop with its
 * cache-cold flush, huge-page accounting and the common describe facts are
 * here, once.
 *
 * A backend's private state embeds struct memtier as its first member, named
 * mt, so memtier's hooks find it at ctx->backend_data and the backend's own
 * code reaches the rest with memtier_container. memtier_open allocates it.
 */
#ifndef KVEMU_MEMTIER_H
#define KVEMU_MEMTIER_H

#include <sched.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "xfer.h"

/* A mapping the tier owns: [base, base + bytes), whole pages, released with munmap. */
struct memtier_region {
    uint8_t *base;
    size_t bytes;
    int advised;            /* madvise(MADV_HUGEPAGE) accepted */
};

struct memtier;

/* What a tier backend tells memtier_open about itself; one static const per backend. */
struct memtier_kind {
    const struct kv_backend_ops *ops;   /* its ops table; ops->name prefixes every message */
    size_t data_bytes;                  /* size of its private state, struct memtier first */
    const struct kv_opt_key *keys;      /* its own options, before memtier's; NULL when none */
    /* Called for each of its own options kv_opts_next accepted: 0, or -errno after kv_fail. */
    int (*option)(struct kv_ctx *ctx, struct memtier *m, const struct kv_opt *o);
    /* Why cold=1 is refused (it never flushes caches; the default is then cold=0), or NULL. */
    const char *cold_refused;
};

/* Shared state of every host-addressable tier: member mt, the first, of the backend's state. */
struct memtier {
    const struct memtier_kind *kind;    /* the backend it belongs to */
    int cold;                       /* flush touched arena lines after each timed access */
    int hugepages_requested;        /* advise THP for arena and staging (hugepages=1, default) */
    int hugepages_advised;          /* madvise(MADV_HUGEPAGE) accepted for arena and staging */
    int prefaulted;                 /* the arena was pre-faulted (staging always is) */
    size_t page_bytes;              /* the base page size, for staging and anonymous arenas */
    size_t arena_page_bytes;        /* the page the arena is mapped with: describe's page_size */
    uint64_t arena_hugepage_bytes;  /* arena bytes the kernel backed with huge pages, at prepare */
    struct memtier_region arena, staging;
    int arena_borrowed;             /* attached to another context's arena: never unmap it */

    /* The transfer engine (docs/backends.md): W workers split each batch of accesses. */
    uint32_t workers_requested;     /* workers=N; 0: one per CPU this process may use */
    uint32_t n_workers;             /* what prepare started (1: the calling thread alone) */
    int have_cpus;                  /* the backend chose the workers' CPUs (numa: its CPU node) */
    cpu_set_t cpus;                 /* the CPUs workers are pinned to */
    struct xfer_pool *pool;         /* NULL with one worker */
    int writeback;                  /* how a store is pushed to memory: MEMTIER_WB_* */
    int cold_flush;                 /* how cold=1 evicts a piece's lines, untimed: MEMTIER_WB_* */
    struct memtier_piece *pieces;   /* scratch: n_workers x (KV_BATCH + 1) timed pieces */
    struct memtier_job *job;        /* scratch: the batch handed to the workers */
};

struct memtier_job;

/* The instruction that writes a stored line back to memory inside the timed region. */
enum { MEMTIER_WB_NONE = 0, MEMTIER_WB_CLFLUSH = 1, MEMTIER_WB_CLFLUSHOPT = 2, MEMTIER_WB_CLWB = 3 };

/* One worker's timed part of access idx: the timer ticks around it. */
struct memtier_piece {
    uint32_t idx;
    uint64_t t0, t1;
};

/* The backend state of type `type` holding memtier m. */
#define memtier_container(m, type) ((type *)(void *)((char *)(m) - offsetof(type, mt)))

/*
 * The open hook's shared half: allocates kind->data_bytes of zeroed state,
 * sets the defaults (cold=1 where clflush exists, hugepages=1), parses args
 * with kv_opts_next (kind->keys through kind->option, then hugepages=0|1,
 * cold=0|1, workers=N), and sets
 * ctx->backend_data. On failure nothing stays allocated. A backend with a
 * positional first argument (a node, a path) passes what follows it.
 */
int memtier_open(struct kv_ctx *ctx, const struct memtier_kind *kind, const char *args) KV_INTERNAL;

/*
 * The attach hook of a host-addressable tier: borrows owner's arena (same
 * backend, so its state also starts with struct memtier) and maps a staging
 * buffer of its own.
 */
int memtier_attach(struct kv_ctx *ctx, const struct kv_ctx *owner, uint64_t staging_bytes) KV_INTERNAL;

/* Frees what memtier_open allocated after the backend's own checks failed in its open. */
void memtier_discard(struct kv_ctx *ctx) KV_INTERNAL;

/*
 * Memory that may be pre-faulted without inviting the OOM killer: MemAvailable,
 * and the cgroup v2 limit minus usage when there is one. UINT64_MAX when unknown.
 */
uint64_t memtier_available_bytes(void) KV_INTERNAL;

/*
 * Finds "key: <n>" in a meminfo-style file (lines optionally prefixed with
 * "Node N ", as in /sys/devices/system/node/nodeN/meminfo); 1 when found.
 */
int memtier_meminfo_kb(const char *path, const char *key, uint64_t *kb) KV_INTERNAL;

/*
 * -ENOMEM with the figures when arena_bytes (the part of the arena that
 * pre-faulting takes from memory; 0 for an arena elsewhere) plus
 * staging_bytes exceed avail_bytes.
 */
int memtier_check_memory(struct kv_ctx *ctx, const struct memtier *m, uint64_t arena_bytes,
                         uint64_t staging_bytes, uint64_t avail_bytes) KV_INTERNAL;

/*
 * Maps want bytes (rounded up to pages) of private anonymous memory, aligned
 * to 2 MiB so THP can back all of it, advises huge pages when requested, and
 * does not touch it: a caller that binds the memory (mbind) must do so before
 * the first touch. Pre-fault with memtier_prefault.
 */
int memtier_map_anon(struct kv_ctx *ctx, struct memtier *m, const char *what, uint64_t want,
                     struct memtier_region *r) KV_INTERNAL;

/*
 * Advises huge pages for r when hugepages=1 (before its first touch: the
 * fault is what allocates a huge page); records in r->advised whether the
 * kernel accepted the advice.
 */
void memtier_advise(const struct memtier *m, struct memtier_region *r) KV_INTERNAL;

/*
 * Faults every page of r in, so that no fault lands in a timed access: as
 * writes (write=1: page tables writable, data unchanged) or as reads
 * (write=0: for memory other processes may be writing). Uses
 * MADV_POPULATE_WRITE/READ, which report a failed fault (a full tmpfs, a
 * truncated file) as an error instead of SIGBUS; touches each page where the
 * kernel predates them (< 5.14).
 */
int memtier_prefault(struct kv_ctx *ctx, const struct memtier *m, const char *what,
                     const struct memtier_region *r, int write) KV_INTERNAL;

/* Maps and pre-faults the staging buffer (local anonymous memory). */
int memtier_map_staging(struct kv_ctx *ctx, struct memtier *m, uint64_t staging_bytes) KV_INTERNAL;

/*
 * The prepare hook of a tier whose arena is anonymous memory: checks that arena
 * and staging fit in available memory, maps staging, maps the arena, calls
 * bind (NULL: none) on it before its first touch, pre-faults it and finishes.
 * On failure everything is unmapped again.
 */
int memtier_prepare_anon(struct kv_ctx *ctx, struct memtier *m, uint64_t arena_bytes,
                         uint64_t staging_bytes,
                         int (*bind)(struct kv_ctx *ctx, struct memtier *m)) KV_INTERNAL;

/*
 * Last step of every prepare: huge-page accounting, ctx->arena_host/staging_host,
 * and the transfer workers (pinned; see xfer.h). Returns 0 or -errno; on
 * failure the caller releases the tier.
 */
int memtier_finish(struct kv_ctx *ctx, struct memtier *m) KV_INTERNAL;

/* Unmaps arena and staging; idempotent. */
void memtier_release(struct kv_ctx *ctx, struct memtier *m) KV_INTERNAL;

/*
 * Hooks usable as they are in an ops table. access: the batch's bytes are split
 * into n_workers contiguous shares (none below MEMTIER_MIN_SHARE bytes, so
 * small batches use fewer workers), each worker timing its pieces one by one:
 * load = memcpy arena -> staging, store = memcpy staging -> arena then every
 * stored line written back (clwb, else clflushopt, else clflush) and an
 * sfence, all inside the timed region, read = one 8-byte load per 64-byte
 * line; then (cold) the piece's arena lines flushed untimed (clflushopt, else
 * clflush, then mfence: clflush is ordered against every other clflush, 12-15x
 * slower per line, and was most of a cold read's wall time). An access's
 * latency runs from the first start to the last end of its pieces; busy = the
 * largest sum of piece times of one worker (the workers are concurrent
 * streams). describe: the shared facts. close: release and free.
 */
int memtier_access(struct kv_ctx *ctx, int op, const struct kv_access *acc, uint32_t n,
                   uint64_t *lat_ns, uint64_t *busy_ns) KV_INTERNAL;
int memtier_describe(struct kv_ctx *ctx, char *buf, size_t len) KV_INTERNAL;
void memtier_close(struct kv_ctx *ctx) KV_INTERNAL;

/* Appends s as a JSON string (quoted and escaped) for describe hooks. */
void memtier_append_json_string(char *buf, size_t len, size_t *pos, const char *s) KV_INTERNAL;

#endif /* KVEMU_MEMTIER_H */
