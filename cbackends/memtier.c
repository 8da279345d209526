/*
 * memtier.c - the shared half of the host-addressable memory tiers (dram, numa,
 * mmap): options, anonymous mappings, pre-faulting, huge-page accounting, the
 * timed access loop and the facts every such tier reports. See memtier.h.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "memtier.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define MEMTIER_CAN_FLUSH 1
#else
#define MEMTIER_CAN_FLUSH 0
#endif

/* The smallest share of a batch's bytes a worker is given: below it, fewer workers run. */
#define MEMTIER_MIN_SHARE (32u << 10)

/* The x86-64 PMD size: aligning to it lets THP back the whole arena, not just its middle. */
#define MEMTIER_ALIGN_BYTES (2ull << 20)

/* Linux 5.14; older headers lack them, older kernels answer EINVAL. */
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

static const char *memtier_name(const struct memtier *m)
{
    return m->kind->ops->name;
}

/* ------------------------------------------------------------------ options */

/* Options every host-addressable tier takes, after its own (memtier_kind.keys). */
static const struct kv_opt_key memtier_keys[] = {
    { "hugepages", "0|1" },
    { "cold", "0|1" },
    { "workers", "N" },
    { NULL, NULL },
};

static int memtier_option(struct kv_ctx *ctx, struct memtier *m, const struct kv_opt *o)
{
    uint64_t w;
    int rc;

    if (kv_opt_is(o, "hugepages"))
        return kv_opt_bool(ctx, o, &m->hugepages_requested);
    if (kv_opt_is(o, "cold")) {
        rc = kv_opt_bool(ctx, o, &m->cold);
        if (rc == 0 && m->cold && m->kind->cold_refused)
            rc = kv_fail(ctx, -EINVAL, "%s: cold=1 is not supported: %s", memtier_name(m),
                         m->kind->cold_refused);
        return rc;
    }
    rc = kv_opt_u64(ctx, o, 1, XFER_MAX_WORKERS, &w);   /* workers */
    if (rc == 0)
        m->workers_requested = (uint32_t)w;
    return rc;
}

/* The best instruction this CPU has to write a dirty line back to memory (CPUID leaf 7, EBX). */
static int memtier_writeback_kind(void)
{
#if MEMTIER_CAN_FLUSH
    unsigned a, b, c, d;

    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        if (b & (1u << 24))
            return MEMTIER_WB_CLWB;
        if (b & (1u << 23))
            return MEMTIER_WB_CLFLUSHOPT;
    }
    return MEMTIER_WB_CLFLUSH;
#else
    return MEMTIER_WB_NONE;
#endif
}

/*
 * The instruction cold=1 evicts lines with: clflushopt where the CPU has it (CPUID leaf 7, EBX
 * bit 23), else clflush. Both invalidate the line in every cache level; clflush is ordered
 * against every other clflush, so a flush of a 64 KiB block runs its 1,024 lines one after
 * another (77 ns per line on the development VM against 5 ns with clflushopt), which made the
 * untimed flush ~94 % of a cold in-place read replay's wall time.
 */
static int memtier_cold_flush_kind(void)
{
#if MEMTIER_CAN_FLUSH
    unsigned a, b, c, d;

    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 23)))
        return MEMTIER_WB_CLFLUSHOPT;
    return MEMTIER_WB_CLFLUSH;
#else
    return MEMTIER_WB_NONE;
#endif
}

static const char *memtier_writeback_name(int wb)
{
    switch (wb) {
    case MEMTIER_WB_CLWB: return "clwb+sfence";
    case MEMTIER_WB_CLFLUSHOPT: return "clflushopt+sfence";
    case MEMTIER_WB_CLFLUSH: return "clflush+mfence";
    default: return "none";
    }
}

int memtier_open(struct kv_ctx *ctx, const struct memtier_kind *kind, const char *args)
{
    struct memtier *m;
    struct kv_opts opts;
    struct kv_opt o;
    long pg = sysconf(_SC_PAGESIZE);
    int rc = 0;

    m = calloc(1, kind->data_bytes);
    if (!m)
        return kv_fail(ctx, -ENOMEM, "%s: cannot allocate backend state", kind->ops->name);
    m->kind = kind;
    m->cold = kind->cold_refused ? 0 : MEMTIER_CAN_FLUSH;
    m->hugepages_requested = 1;
    m->page_bytes = pg > 0 ? (size_t)pg : 4096;
    m->arena_page_bytes = m->page_bytes;
    m->writeback = memtier_writeback_kind();
    m->cold_flush = memtier_cold_flush_kind();

    /* Comma-separated key=value, so later options need no new syntax. */
    kv_opts_init(&opts, ctx, kind->ops->name, args, kind->keys, memtier_keys);
    while (rc == 0 && (rc = kv_opts_next(&opts, &o)) > 0)
        rc = o.table == 0 ? kind->option(ctx, m, &o) : memtier_option(ctx, m, &o);
    if (rc == 0 && m->cold && !MEMTIER_CAN_FLUSH)
        rc = kv_fail(ctx, -EOPNOTSUPP, "%s: cold=1 needs clflush (x86-64); use cold=0",
                     kind->ops->name);
    if (rc < 0) {
        free(m);
        return rc;
    }
    ctx->backend_data = m;
    return 0;
}

void memtier_discard(struct kv_ctx *ctx)
{
    free(ctx->backend_data);
    ctx->backend_data = NULL;
}

/* One batch handed to the workers. */
struct memtier_job {
    struct kv_ctx *ctx;
    struct memtier *m;
    int op;
    const struct kv_access *acc;
    uint32_t n;
    uint64_t total;                 /* bytes of the batch */
    uint64_t begin[KV_BATCH + 1];   /* byte offset of each access in the batch; begin[n] = total */
    uint32_t n_pieces[XFER_MAX_WORKERS];
    uint64_t busy_ns[XFER_MAX_WORKERS];     /* sum of the worker's piece times */
    uint64_t sink[XFER_MAX_WORKERS];
};

/* ------------------------------------------------------------------- memory */

int memtier_meminfo_kb(const char *path, const char *key, uint64_t *kb)
{
    FILE *f = fopen(path, "r");
    char line[256];
    size_t n = strlen(key);
    int found = 0;

    if (!f)
        return 0;
    while (!found && fgets(line, sizeof(line), f)) {
        const char *s = line;
        int skip = 0;

        /* Per-node files prefix every line with "Node N ". */
        if (sscanf(s, "Node %*d %n", &skip) == 0 && skip > 0)
            s += skip;
        if (strncmp(s, key, n) == 0 && s[n] == ':')
            found = sscanf(s + n + 1, "%" SCNu64, kb) == 1 ? 1 : -1;
    }
    fclose(f);
    return found == 1;
}

uint64_t memtier_available_bytes(void)
{
    uint64_t avail = UINT64_MAX, kb, max, cur;
    FILE *f;

    if (memtier_meminfo_kb("/proc/meminfo", "MemAvailable", &kb))
        avail = kb * 1024;
    f = fopen("/sys/fs/cgroup/memory.max", "r");
    if (f) {
        /* "max" when unlimited: the scan fails and the limit is ignored. */
        if (fscanf(f, "%" SCNu64, &max) == 1) {
            FILE *c = fopen("/sys/fs/cgroup/memory.current", "r");

            if (c) {
                if (fscanf(c, "%" SCNu64, &cur) == 1) {
                    uint64_t room = max > cur ? max - cur : 0;
                    if (room < avail)
                        avail = room;
                }
                fclose(c);
            }
        }
        fclose(f);
    }
    return avail;
}

int memtier_check_memory(struct kv_ctx *ctx, const struct memtier *m, uint64_t arena_bytes,
                         uint64_t staging_bytes, uint64_t avail_bytes)
{
    uint64_t need;

    if (!__builtin_add_overflow(arena_bytes, staging_bytes, &need) && need <= avail_bytes)
        return 0;
    if (arena_bytes == 0)
        return kv_fail(ctx, -ENOMEM,
                       "%s: staging (%" PRIu64 " bytes) exceeds the %" PRIu64 " bytes of memory "
                       "available; pre-faulting it would invite the OOM killer", memtier_name(m),
                       staging_bytes, avail_bytes);
    return kv_fail(ctx, -ENOMEM,
                   "%s: arena (%" PRIu64 " bytes) and staging (%" PRIu64 " bytes) exceed the %"
                   PRIu64 " bytes of memory available; pre-faulting them would invite the OOM "
                   "killer", memtier_name(m), arena_bytes, staging_bytes, avail_bytes);
}

void memtier_advise(const struct memtier *m, struct memtier_region *r)
{
    r->advised = 0;
#ifdef MADV_HUGEPAGE
    if (m->hugepages_requested)
        r->advised = madvise(r->base, r->bytes, MADV_HUGEPAGE) == 0;
#else
    (void)m;
#endif
}

int memtier_map_anon(struct kv_ctx *ctx, struct memtier *m, const char *what, uint64_t want,
                     struct memtier_region *r)
{
    size_t bytes, span, head, tail;
    uint8_t *raw, *base;

    bytes = (size_t)((want + m->page_bytes - 1) / m->page_bytes * m->page_bytes);
    if (bytes < want || __builtin_add_overflow(bytes, (size_t)MEMTIER_ALIGN_BYTES, &span))
        return kv_fail(ctx, -ENOMEM, "%s: %s of %" PRIu64 " bytes cannot be mapped",
                       memtier_name(m), what, want);
    raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        int err = errno;

        return kv_fail(ctx, -err, "%s: cannot map %s of %zu bytes: %s", memtier_name(m), what,
                       bytes, strerror(err));
    }
    /* Over-map, then trim to an aligned window so release needs only base and bytes. */
    base = (uint8_t *)(((uintptr_t)raw + MEMTIER_ALIGN_BYTES - 1) &
                       ~(uintptr_t)(MEMTIER_ALIGN_BYTES - 1));
    head = (size_t)(base - raw);
    tail = span - head - bytes;
    if (head)
        munmap(raw, head);
    if (tail)
        munmap(base + bytes, tail);
    r->base = base;
    r->bytes = bytes;
    memtier_advise(m, r);
    return 0;
}

/* One thread's part of a parallel pre-fault. */
struct memtier_populate {
    uint8_t *base;
    size_t bytes;
    int advice, err;
    const struct kv_ctx *ctx;   /* polled for a cancel between pieces */
};

/*
 * Populated per call: a few ms of zeroing (or of reading a file from a fast disk), so that a
 * cancel is seen well within KV_CANCEL_POLL_NS. A multiple of every huge page size in use.
 */
#define MEMTIER_POPULATE_PIECE_BYTES ((size_t)16 << 20)

static void *memtier_populate_part(void *arg)
{
    struct memtier_populate *p = arg;

    p->err = 0;
    for (size_t off = 0; off < p->bytes && !p->err; off += MEMTIER_POPULATE_PIECE_BYTES) {
        size_t len = p->bytes - off < MEMTIER_POPULATE_PIECE_BYTES ? p->bytes - off
                                                                    : MEMTIER_POPULATE_PIECE_BYTES;

        if (kv_cancelled(p->ctx))
            p->err = EINTR;
        else if (madvise(p->base + off, len, p->advice) != 0)
            p->err = errno;
    }
    return NULL;
}

/* 1 when the machine has a single NUMA node: where pages land does not depend on the faulting CPU. */
static int memtier_one_node(void)
{
    char buf[32] = "";
    FILE *f = fopen("/sys/devices/system/node/online", "r");
    int one;

    if (!f)
        return 1;
    one = fgets(buf, sizeof(buf), f) && strcmp(buf, "0\n") == 0;
    fclose(f);
    return one;
}

/*
 * MADV_POPULATE over r, split among up to 8 threads (one per CPU this thread may use) for a large
 * region on a one-node machine: zeroing the pages is the kernel's work, and it scales with CPUs.
 * Returns 0 or the errno of the first part that failed.
 */
static int memtier_populate(const struct kv_ctx *ctx, const struct memtier_region *r, int advice)
{
    enum { PARTS_MAX = 8 };
    struct memtier_populate part[PARTS_MAX];
    pthread_t th[PARTS_MAX];
    cpu_set_t cpus;
    size_t n = 1, step;
    int started[PARTS_MAX] = { 0 }, err = 0;

    if (r->bytes >= (256u << 20) && memtier_one_node() && sched_getaffinity(0, sizeof(cpus), &cpus) == 0)
        n = (size_t)CPU_COUNT(&cpus);
    if (n > PARTS_MAX)
        n = PARTS_MAX;
    if (n <= 1) {
        part[0] = (struct memtier_populate){ r->base, r->bytes, advice, 0, ctx };
        memtier_populate_part(&part[0]);
        return part[0].err;
    }
    step = (r->bytes / n + MEMTIER_ALIGN_BYTES - 1) & ~(size_t)(MEMTIER_ALIGN_BYTES - 1);
    for (size_t i = 0; i < n; i++) {
        size_t lo = i * step < r->bytes ? i * step : r->bytes;
        size_t hi = lo + step < r->bytes ? lo + step : r->bytes;

        part[i] = (struct memtier_populate){ r->base + lo, hi - lo, advice, 0, ctx };
        if (hi > lo)
            started[i] = pthread_create(&th[i], NULL, memtier_populate_part, &part[i]) == 0;
        if (hi > lo && !started[i])
            memtier_populate_part(&part[i]);
    }
    for (size_t i = 0; i < n; i++) {
        if (started[i])
            pthread_join(th[i], NULL);
        if (!err && part[i].err)
            err = part[i].err;
    }
    return err;
}

int memtier_prefault(struct kv_ctx *ctx, const struct memtier *m, const char *what,
                     const struct memtier_region *r, int write)
{
    volatile uint8_t *p = r->base;
    uint8_t sink = 0;
    int err;

    err = memtier_populate(ctx, r, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ);
    if (err == 0)
        return 0;
    if (err == EINTR && kv_cancelled(ctx))
        return kv_cancelled_fail(ctx, "prepare");
    if (err != EINVAL)
        return kv_fail(ctx, -err, "%s: cannot pre-fault the %s (%zu bytes): %s%s",
                       memtier_name(m), what, r->bytes, strerror(err),
                       err == EFAULT ? " (a page could not be backed: file system full, or the "
                                       "file shorter than the mapping?)" : "");
    /*
     * Kernels before 5.14 (or mappings the advice does not cover): touch each
     * page. Writing back what was read keeps the data; a write fault, not a
     * read, is what gives private memory its own page instead of the zero page.
     */
    for (size_t off = 0; off < r->bytes; off += m->page_bytes) {
        uint8_t v;

        if (off % MEMTIER_POPULATE_PIECE_BYTES == 0 && kv_cancelled(ctx))
            return kv_cancelled_fail(ctx, "prepare");
        v = p[off];

        if (write)
            p[off] = v;
        sink ^= v;
    }
    (void)sink;
    return 0;
}

int memtier_map_staging(struct kv_ctx *ctx, struct memtier *m, uint64_t staging_bytes)
{
    int rc = memtier_map_anon(ctx, m, "staging", staging_bytes, &m->staging);

    if (rc == 0)
        rc = memtier_prefault(ctx, m, "staging", &m->staging, 1);
    return rc;
}

/* Bytes of r the kernel backs with huge pages, summed over the mappings overlapping it. */
static uint64_t memtier_hugepage_bytes(const struct memtier_region *r)
{
    /* Anonymous THP, shmem/tmpfs THP, file THP, hugetlbfs. */
    static const char *const keys[] = {
        "AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:", "Shared_Hugetlb:",
        "Private_Hugetlb:",
    };
    const uintptr_t lo_r = (uintptr_t)r->base, hi_r = lo_r + r->bytes;
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    int inside = 0;
    uint64_t total_kb = 0;

    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f)) {
        uintptr_t lo, hi;

        /* Only header lines parse as "lo-hi"; attribute lines stop at the first non-hex. */
        if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR, &lo, &hi) == 2) {
            inside = lo < hi_r && lo_r < hi;
            continue;
        }
        if (!inside)
            continue;
        for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
            size_t n = strlen(keys[k]);
            uint64_t kb;

            if (strncmp(line, keys[k], n) == 0 && sscanf(line + n, "%" SCNu64, &kb) == 1)
                total_kb += kb;
        }
    }
    fclose(f);
    /* The kernel may have merged neighbours into the mapping; never claim more than r. */
    return total_kb * 1024 < r->bytes ? total_kb * 1024 : r->bytes;
}

int memtier_finish(struct kv_ctx *ctx, struct memtier *m)
{
    uint32_t n;

    m->hugepages_advised = m->arena.advised && m->staging.advised;
    m->arena_hugepage_bytes = memtier_hugepage_bytes(&m->arena);
    ctx->arena_host = m->arena.base;
    ctx->staging_host = m->staging.base;

    if (!m->have_cpus && xfer_caller_cpus(&m->cpus) != 0) {
        CPU_ZERO(&m->cpus);
        CPU_SET(sched_getcpu() >= 0 ? sched_getcpu() : 0, &m->cpus);
    }
    /*
     * At most one worker per CPU: a worker waiting for its CPU is not timed (its pieces are), so
     * more workers than CPUs would overstate the bandwidth instead of measuring contention.
     */
    n = (uint32_t)CPU_COUNT(&m->cpus);
    if (m->workers_requested && m->workers_requested < n)
        n = m->workers_requested;
    if (n < 1)
        n = 1;
    if (n > XFER_MAX_WORKERS)
        n = XFER_MAX_WORKERS;
    m->pieces = calloc((size_t)n * (KV_BATCH + 1), sizeof(*m->pieces));
    m->job = malloc(sizeof(struct memtier_job));
    if (!m->pieces || !m->job)
        return kv_fail(ctx, -ENOMEM, "%s: cannot allocate the transfer workers' scratch",
                       memtier_name(m));
    if (n > 1) {
        int rc = xfer_pool_start(ctx, memtier_name(m), n, &m->cpus, &m->pool);

        if (rc < 0)
            return rc;
    }
    m->n_workers = n;
    return 0;
}

int memtier_prepare_anon(struct kv_ctx *ctx, struct memtier *m, uint64_t arena_bytes,
                         uint64_t staging_bytes,
                         int (*bind)(struct kv_ctx *ctx, struct memtier *m))
{
    int rc;

    if (arena_bytes == 0)
        return kv_fail(ctx, -EINVAL, "%s: refusing an empty arena", memtier_name(m));
    rc = memtier_check_memory(ctx, m, arena_bytes, staging_bytes, memtier_available_bytes());
    if (rc == 0)
        rc = memtier_map_staging(ctx, m, staging_bytes);
    if (rc == 0)
        rc = memtier_map_anon(ctx, m, "arena", arena_bytes, &m->arena);
    if (rc == 0 && bind)
        rc = bind(ctx, m);
    if (rc == 0)
        rc = memtier_prefault(ctx, m, "arena", &m->arena, 1);
    if (rc < 0) {
        memtier_release(ctx, m);
        return rc;
    }
    m->prefaulted = 1;
    rc = memtier_finish(ctx, m);
    if (rc < 0)
        memtier_release(ctx, m);
    return rc;
}

static void memtier_unmap(struct memtier_region *r)
{
    if (r->base)
        munmap(r->base, r->bytes);
    r->base = NULL;
    r->bytes = 0;
    r->advised = 0;
}

int memtier_attach(struct kv_ctx *ctx, const struct kv_ctx *owner, uint64_t staging_bytes)
{
    struct memtier *m = ctx->backend_data;
    const struct memtier *om = owner->backend_data;
    int rc = memtier_map_staging(ctx, m, staging_bytes);

    if (rc < 0) {
        memtier_release(ctx, m);
        return rc;
    }
    m->arena = om->arena;
    m->arena_borrowed = 1;
    m->prefaulted = om->prefaulted;
    m->arena_page_bytes = om->arena_page_bytes;
    rc = memtier_finish(ctx, m);
    if (rc < 0)
        memtier_release(ctx, m);
    return rc;
}

void memtier_release(struct kv_ctx *ctx, struct memtier *m)
{
    xfer_pool_stop(m->pool);
    m->pool = NULL;
    free(m->pieces);
    m->pieces = NULL;
    free(m->job);
    m->job = NULL;
    m->n_workers = 0;
    if (m->arena_borrowed) {
        m->arena.base = NULL;
        m->arena.bytes = 0;
        m->arena_borrowed = 0;
    }
    memtier_unmap(&m->arena);
    memtier_unmap(&m->staging);
    ctx->arena_host = ctx->staging_host = NULL;
}

/* -------------------------------------------------------------------- hooks */

#if MEMTIER_CAN_FLUSH
__attribute__((target("clwb"))) static void memtier_wb_clwb(uint8_t *p, uint64_t n)
{
    for (uint64_t off = 0; off < n; off += 64)
        _mm_clwb(p + off);
    _mm_sfence();
}

__attribute__((target("clflushopt"))) static void memtier_wb_clflushopt(uint8_t *p, uint64_t n)
{
    for (uint64_t off = 0; off < n; off += 64)
        _mm_clflushopt(p + off);
    _mm_sfence();
}

static void memtier_flush_lines(uint8_t *p, uint64_t n)
{
    for (uint64_t off = 0; off < n; off += 64)
        _mm_clflush(p + off);
    _mm_mfence();
}

/* cold=1's eviction: the mfence (not sfence) also keeps the next piece's timed loads behind it. */
__attribute__((target("clflushopt"))) static void memtier_evict_clflushopt(uint8_t *p, uint64_t n)
{
    for (uint64_t off = 0; off < n; off += 64)
        _mm_clflushopt(p + off);
    _mm_mfence();
}

static inline void memtier_evict(int kind, uint8_t *p, uint64_t n)
{
    if (kind == MEMTIER_WB_CLFLUSHOPT)
        memtier_evict_clflushopt(p, n);
    else
        memtier_flush_lines(p, n);
}
#endif

/* Writes stored lines back to memory and waits for them: part of a store's timed region. */
static inline void memtier_write_back(int wb, uint8_t *p, uint64_t n)
{
#if MEMTIER_CAN_FLUSH
    if (wb == MEMTIER_WB_CLWB)
        memtier_wb_clwb(p, n);
    else if (wb == MEMTIER_WB_CLFLUSHOPT)
        memtier_wb_clflushopt(p, n);
    else if (wb == MEMTIER_WB_CLFLUSH)
        memtier_flush_lines(p, n);
#else
    (void)wb, (void)p, (void)n;
#endif
}

/* Worker w's share: bytes [w * total / k, (w + 1) * total / k), cut on 64-byte lines. */
static void memtier_work(void *arg, uint32_t w, uint32_t k)
{
    struct memtier_job *j = arg;
    struct memtier *m = j->m;
    const struct kv_timer *t = &j->ctx->timer;
    struct memtier_piece *pc = m->pieces + (size_t)w * (KV_BATCH + 1);
    uint8_t *arena = m->arena.base, *staging = m->staging.base;
    uint64_t lo = j->total / k * w + j->total % k * w / k, hi;
    uint64_t busy = 0, sink = 0;
    uint32_t np = 0, i = 0;

    hi = w + 1 == k ? j->total : j->total / k * (w + 1) + j->total % k * (w + 1) / k;
    lo &= ~(uint64_t)63;
    if (w + 1 < k)
        hi &= ~(uint64_t)63;
    while (i < j->n && j->begin[i + 1] <= lo)
        i++;
    for (; i < j->n && j->begin[i] < hi; i++) {
        const struct kv_access *a = &j->acc[i];
        uint64_t a_lo = lo > j->begin[i] ? lo - j->begin[i] : 0;
        uint64_t a_hi = (hi < j->begin[i + 1] ? hi : j->begin[i + 1]) - j->begin[i];
        uint8_t *p = arena + a->arena_off + a_lo;
        uint64_t bytes = a_hi - a_lo, t0, t1;

        if (bytes == 0)
            continue;
        t0 = kv_timer_ticks(t);
        if (j->op == KV_OP_LOAD) {
            memcpy(staging + a->staging_off + a_lo, p, bytes);
        } else if (j->op == KV_OP_STORE) {
            memcpy(p, staging + a->staging_off + a_lo, bytes);
            memtier_write_back(m->writeback, p, bytes);
        } else {
            for (const uint8_t *q = p; q < p + bytes; q += 64) {
                uint64_t v;

                memcpy(&v, q, sizeof(v));
                sink += v;
            }
        }
        t1 = kv_timer_ticks(t);
        pc[np++] = (struct memtier_piece){ .idx = i, .t0 = t0, .t1 = t1 };
        busy += kv_timer_ns(t, t1 - t0);
#if MEMTIER_CAN_FLUSH
        /* Untimed: the next access to this block comes from memory, not the CPU's caches. */
        if (m->cold)
            memtier_evict(m->cold_flush, p, bytes);
#endif
    }
    j->n_pieces[w] = np;
    j->busy_ns[w] = busy;
    j->sink[w] = sink;
}

int memtier_access(struct kv_ctx *ctx, int op, const struct kv_access *acc, uint32_t n,
                   uint64_t *lat_ns, uint64_t *busy_ns)
{
    struct memtier *m = ctx->backend_data;
    const struct kv_timer *t = &ctx->timer;
    struct memtier_job *j;
    uint64_t first[KV_BATCH], last[KV_BATCH], busy = 0;
    uint32_t k;

    if (op < 0 || op >= KV_N_OPS)
        return kv_fail(ctx, -EINVAL, "%s: unknown op %d", memtier_name(m), op);
    if (n > KV_BATCH)
        return kv_fail(ctx, -EINVAL, "%s: batch of %u accesses exceeds %u", memtier_name(m), n,
                       KV_BATCH);
    j = m->job;
    if (!j)
        return kv_fail(ctx, -EINVAL, "%s: access before prepare", memtier_name(m));
    j->ctx = ctx;
    j->m = m;
    j->op = op;
    j->acc = acc;
    j->n = n;
    j->begin[0] = 0;
    for (uint32_t i = 0; i < n; i++)
        j->begin[i + 1] = j->begin[i] + acc[i].bytes;
    j->total = j->begin[n];
    k = m->n_workers ? m->n_workers : 1;
    if (j->total / MEMTIER_MIN_SHARE < k)
        k = j->total / MEMTIER_MIN_SHARE > 1 ? (uint32_t)(j->total / MEMTIER_MIN_SHARE) : 1;
    if (k > 1 && m->pool)
        xfer_pool_run(m->pool, memtier_work, j, k);
    else
        memtier_work(j, 0, k = 1);

    for (uint32_t i = 0; i < n; i++) {
        first[i] = UINT64_MAX;
        last[i] = 0;
    }
    for (uint32_t w = 0; w < k; w++) {
        const struct memtier_piece *pc = m->pieces + (size_t)w * (KV_BATCH + 1);

        for (uint32_t q = 0; q < j->n_pieces[w]; q++) {
            if (pc[q].t0 < first[pc[q].idx])
                first[pc[q].idx] = pc[q].t0;
            if (pc[q].t1 > last[pc[q].idx])
                last[pc[q].idx] = pc[q].t1;
        }
        if (j->busy_ns[w] > busy)
            busy = j->busy_ns[w];
        ctx->read_sink += j->sink[w];
    }
    for (uint32_t i = 0; i < n; i++)
        lat_ns[i] = first[i] == UINT64_MAX ? 0 : kv_timer_ns(t, last[i] - first[i]);
    *busy_ns = busy;
    return (int)n;
}

int memtier_describe(struct kv_ctx *ctx, char *buf, size_t len)
{
    const struct memtier *m = ctx->backend_data;
    size_t pos = 0;

    kv_appendf(buf, len, &pos,
               ",\"page_size\":%zu,\"hugepages_requested\":%s,\"hugepages_advised\":%s"
               ",\"arena_hugepage_bytes\":%" PRIu64 ",\"prefaulted\":%s,\"cache_cold\":%s"
               ",\"arena_shared_with_owner\":%s,\"workers\":%u,\"workers_requested\":%u,\"store_writeback\":\"%s\""
               ",\"cold_flush\":\"%s\"",
               m->arena_page_bytes, m->hugepages_requested ? "true" : "false",
               m->hugepages_advised ? "true" : "false", m->arena_hugepage_bytes,
               m->prefaulted ? "true" : "false", m->cold ? "true" : "false",
               m->arena_borrowed ? "true" : "false", m->n_workers, m->workers_requested,
               memtier_writeback_name(m->writeback),
               !m->cold ? "none" : m->cold_flush == MEMTIER_WB_CLFLUSHOPT ? "clflushopt+mfence"
                                                                   : "clflush+mfence");
    kv_appendf(buf, len, &pos, ",\"worker_cpus\":[");
    for (uint32_t k = 0; k < m->n_workers; k++) {
        int c = m->pool ? xfer_pool_cpu(m->pool, k) : -1;

        if (c >= 0)
            kv_appendf(buf, len, &pos, "%s%d", k ? "," : "", c);
        else
            kv_appendf(buf, len, &pos, "%snull", k ? "," : "");
    }
    kv_appendf(buf, len, &pos, "]");
    return (int)pos;
}

void memtier_close(struct kv_ctx *ctx)
{
    struct memtier *m = ctx->backend_data;

    if (!m)
        return;
    memtier_release(ctx, m);
    free(m);
    ctx->backend_data = NULL;
}

/* ---------------------------------------------------------------------- JSON */

/* Length of the valid UTF-8 sequence at p, 0 when p does not start one. */
static size_t memtier_utf8_len(const unsigned char *p)
{
    size_t n;
    uint32_t c;

    if (p[0] < 0x80)
        return 1;
    if (p[0] >= 0xc2 && p[0] <= 0xdf) {
        n = 2;
        c = p[0] & 0x1fu;
    } else if ((p[0] & 0xf0) == 0xe0) {
        n = 3;
        c = p[0] & 0x0fu;
    } else if (p[0] >= 0xf0 && p[0] <= 0xf4) {
        n = 4;
        c = p[0] & 0x07u;
    } else {
        return 0;
    }
    /* A NUL fails the continuation test, so this never reads past the string. */
    for (size_t i = 1; i < n; i++) {
        if ((p[i] & 0xc0) != 0x80)
            return 0;
        c = (c << 6) | (p[i] & 0x3fu);
    }
    if ((n == 3 && (c < 0x800 || (c >= 0xd800 && c <= 0xdfff))) ||
        (n == 4 && (c < 0x10000 || c > 0x10ffff)))
        return 0;
    return n;
}

void memtier_append_json_string(char *buf, size_t len, size_t *pos, const char *s)
{
    const unsigned char *p = (const unsigned char *)s;

    kv_appendf(buf, len, pos, "\"");
    while (*p) {
        size_t n = memtier_utf8_len(p);

        /* Python decodes describe's output as strict UTF-8; a stray byte must not break it. */
        if (n == 0) {
            kv_appendf(buf, len, pos, "\\ufffd");
            n = 1;
        } else if (*p == '"' || *p == '\\') {
            kv_appendf(buf, len, pos, "\\%c", *p);
        } else if (*p < 0x20) {
            kv_appendf(buf, len, pos, "\\u%04x", *p);
        } else {
            kv_appendf(buf, len, pos, "%.*s", (int)n, (const char *)p);
        }
        p += n;
    }
    kv_appendf(buf, len, pos, "\"");
}
