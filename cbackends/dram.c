/*
 * dram.c - host DRAM, the fastest tier kvemu replays on (a CPU-memory KV cache
 * such as LMCache's or Mooncake's local DRAM pool).
 *
 * Measures the time of each block-layer access as seen by one CPU thread:
 * load = memcpy arena -> staging, store = memcpy staging -> arena, read = one
 * 8-byte load per 64-byte cache line of the block, in place.
 *
 * Caveats:
 *  - Single thread. A real engine copies with a DMA engine (cudaMemcpyAsync
 *    from pinned memory) or several threads; this is one core's memcpy
 *    bandwidth, usually well below the memory system's.
 *  - Caches. A GPU reaching a memory tier gets nothing from the CPU's caches,
 *    so by default (cold=1, x86-64) every arena line an access touched is
 *    flushed (clflush) after the access is timed: the next access to that
 *    block comes from DRAM, as in a tier many times larger than the LLC.
 *    With cold=0 recently touched blocks are served from cache. The staging
 *    buffer (the HBM stand-in, up to 64 MiB) is not flushed.
 *  - Timer. Each access is bracketed by two timer reads (~20-40 cycles with
 *    the TSC); for small blocks that overhead is part of the latency.
 *  - Stores. The closing timer read does not wait for the store buffer to
 *    drain, nor for non-temporal stores glibc uses on large copies; the error
 *    is bounded by the buffer size (a few KiB), not the block.
 *  - Pages. Both buffers are pre-faulted at prepare, so no page fault lands
 *    in a timed access. Huge pages are advised (hugepages=1, the default),
 *    not guaranteed; describe reports how much of the arena the kernel backed
 *    with them. Nothing is mlocked: under memory pressure pages may be
 *    reclaimed and faulted back in, which shows up as latency outliers.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#define DRAM_CAN_FLUSH 1
#else
#define DRAM_CAN_FLUSH 0
#endif

/* The x86-64 PMD size: aligning to it lets THP back the whole arena, not just its middle. */
#define DRAM_ALIGN_BYTES (2ull << 20)

struct dram_region {
    uint8_t *base;          /* aligned start, what accesses use */
    size_t bytes;           /* mapped from base, a whole number of pages */
};

struct dram_data {
    int hugepages_requested;
    int cold;                   /* flush touched arena lines after each timed access */
    int hugepages_advised;      /* madvise(MADV_HUGEPAGE) accepted for arena and staging */
    int prefaulted;
    size_t page_bytes;
    uint64_t arena_hugepage_bytes;  /* AnonHugePages of the arena after pre-faulting */
    struct dram_region arena, staging;
};

static int dram_open(struct kv_ctx *ctx, const char *args)
{
    struct dram_data *d;
    int hugepages = 1, cold = DRAM_CAN_FLUSH;
    const char *p = args;

    /* Comma-separated key=value, so later options need no new syntax. */
    while (*p) {
        size_t n = strcspn(p, ",");

        if (n == 0) {
            p++;
            continue;
        }
        if (n == strlen("hugepages=0") && strncmp(p, "hugepages=", 10) == 0 &&
            (p[10] == '0' || p[10] == '1'))
            hugepages = p[10] == '1';
        else if (n == strlen("cold=0") && strncmp(p, "cold=", 5) == 0 && (p[5] == '0' || p[5] == '1'))
            cold = p[5] == '1';
        else
            return kv_fail(ctx, -EINVAL, "dram: unknown option '%.*s' (known: hugepages=0|1, cold=0|1)",
                           (int)n, p);
        p += n;
    }

    d = calloc(1, sizeof(*d));
    if (!d)
        return kv_fail(ctx, -ENOMEM, "dram: cannot allocate backend state");
    if (cold && !DRAM_CAN_FLUSH) {
        free(d);
        return kv_fail(ctx, -EOPNOTSUPP, "dram: cold=1 needs clflush (x86-64); use cold=0");
    }
    d->hugepages_requested = hugepages;
    d->cold = cold;
    {
        long pg = sysconf(_SC_PAGESIZE);
        d->page_bytes = pg > 0 ? (size_t)pg : 4096;
    }
    ctx->backend_data = d;
    return 0;
}

/* Finds "key: <n> kB" in f; 1 when found. */
static int dram_read_kb(FILE *f, const char *key, uint64_t *kb)
{
    char line[256];
    size_t n = strlen(key);

    while (fgets(line, sizeof(line), f))
        if (strncmp(line, key, n) == 0 && line[n] == ':')
            return sscanf(line + n + 1, "%" SCNu64, kb) == 1;
    return 0;
}

/*
 * Memory we may pre-fault without inviting the OOM killer: MemAvailable, and
 * the cgroup v2 limit minus usage when there is one. UINT64_MAX when unknown.
 */
static uint64_t dram_available_bytes(void)
{
    uint64_t avail = UINT64_MAX, kb, max, cur;
    FILE *f;

    f = fopen("/proc/meminfo", "r");
    if (f) {
        if (dram_read_kb(f, "MemAvailable", &kb))
            avail = kb * 1024;
        fclose(f);
    }
    f = fopen("/sys/fs/cgroup/memory.max", "r");
    if (f) {
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

static int dram_map(struct kv_ctx *ctx, struct dram_data *d, const char *what, uint64_t want,
                    struct dram_region *r, int *advised)
{
    size_t bytes, span, head, tail;
    uint8_t *raw, *base;

    bytes = (size_t)((want + d->page_bytes - 1) / d->page_bytes * d->page_bytes);
    if (bytes < want || __builtin_add_overflow(bytes, (size_t)DRAM_ALIGN_BYTES, &span))
        return kv_fail(ctx, -ENOMEM, "dram: %s of %" PRIu64 " bytes cannot be mapped", what, want);
    raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        int err = errno;

        return kv_fail(ctx, -err, "dram: cannot map %s of %zu bytes: %s", what, bytes,
                       strerror(err));
    }
    /* Over-map, then trim to an aligned window so close needs only base and bytes. */
    base = (uint8_t *)(((uintptr_t)raw + DRAM_ALIGN_BYTES - 1) & ~(uintptr_t)(DRAM_ALIGN_BYTES - 1));
    head = (size_t)(base - raw);
    tail = span - head - bytes;
    if (head)
        munmap(raw, head);
    if (tail)
        munmap(base + bytes, tail);

    *advised = 0;
#ifdef MADV_HUGEPAGE
    /* Advice must precede the first touch: the fault is what allocates the huge page. */
    if (d->hugepages_requested)
        *advised = madvise(base, bytes, MADV_HUGEPAGE) == 0;
#endif
    /* Write, not read: a read fault maps the shared zero page and defers the real one. */
    for (size_t off = 0; off < bytes; off += d->page_bytes)
        ((volatile uint8_t *)base)[off] = 1;
    r->base = base;
    r->bytes = bytes;
    return 0;
}

static void dram_unmap(struct dram_region *r)
{
    if (r->base)
        munmap(r->base, r->bytes);
    r->base = NULL;
    r->bytes = 0;
}

/* AnonHugePages of the mapping holding base; the kernel may have merged neighbours into it. */
static uint64_t dram_hugepage_bytes(const struct dram_region *r)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    int inside = 0;
    uint64_t kb = 0;

    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f)) {
        uintptr_t lo, hi;

        /* Only header lines parse as "lo-hi"; attribute lines stop at the first non-hex. */
        if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR, &lo, &hi) == 2) {
            if (inside)
                break;
            inside = lo <= (uintptr_t)r->base && (uintptr_t)r->base < hi;
        } else if (inside && strncmp(line, "AnonHugePages:", 14) == 0) {
            if (sscanf(line + 14, "%" SCNu64, &kb) != 1)
                kb = 0;
            break;
        }
    }
    fclose(f);
    return kb * 1024 < r->bytes ? kb * 1024 : r->bytes;
}

static int dram_prepare(struct kv_ctx *ctx, uint64_t arena_bytes, uint64_t staging_bytes)
{
    struct dram_data *d = ctx->backend_data;
    uint64_t avail = dram_available_bytes(), need;
    int adv_arena, adv_staging, rc;

    if (arena_bytes == 0)
        return kv_fail(ctx, -EINVAL, "dram: refusing an empty arena");
    if (__builtin_add_overflow(arena_bytes, staging_bytes, &need) || need > avail)
        return kv_fail(ctx, -ENOMEM,
                       "dram: arena (%" PRIu64 " bytes) and staging (%" PRIu64 " bytes) exceed "
                       "the %" PRIu64 " bytes of memory available; pre-faulting them would "
                       "invite the OOM killer", arena_bytes, staging_bytes, avail);
    rc = dram_map(ctx, d, "arena", arena_bytes, &d->arena, &adv_arena);
    if (rc < 0)
        return rc;
    rc = dram_map(ctx, d, "staging", staging_bytes, &d->staging, &adv_staging);
    if (rc < 0) {
        dram_unmap(&d->arena);
        return rc;
    }
    d->hugepages_advised = adv_arena && adv_staging;
    d->prefaulted = 1;
    d->arena_hugepage_bytes = dram_hugepage_bytes(&d->arena);
    ctx->arena_host = d->arena.base;
    ctx->staging_host = d->staging.base;
    return 0;
}

static int dram_access(struct kv_ctx *ctx, int op, const struct kv_access *acc, uint32_t n,
                       uint64_t *lat_ns, uint64_t *busy_ns)
{
    struct dram_data *d = ctx->backend_data;
    const struct kv_timer *t = &ctx->timer;
    uint8_t *arena = d->arena.base, *staging = d->staging.base;
    uint64_t sink = 0, busy = 0;

    if (op < 0 || op >= KV_N_OPS)
        return kv_fail(ctx, -EINVAL, "dram: unknown op %d", op);
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *a = arena + acc[i].arena_off;
        uint64_t t0, t1;

        t0 = kv_timer_ticks(t);
        if (op == KV_OP_LOAD) {
            memcpy(staging + acc[i].staging_off, a, acc[i].bytes);
        } else if (op == KV_OP_STORE) {
            memcpy(a, staging + acc[i].staging_off, acc[i].bytes);
        } else {
            const uint8_t *end = a + acc[i].bytes;

            for (const uint8_t *p = a; p < end; p += 64) {
                uint64_t v;

                memcpy(&v, p, sizeof(v));
                sink += v;
            }
        }
        t1 = kv_timer_ticks(t);
        lat_ns[i] = kv_timer_ns(t, t1 - t0);
        busy += lat_ns[i];
#if DRAM_CAN_FLUSH
        if (d->cold) {
            for (uint64_t off = 0; off < acc[i].bytes; off += 64)
                _mm_clflush(a + off);
            _mm_mfence(); /* the flushes complete before the next timed access starts */
        }
#endif
    }
    ctx->read_sink += sink;
    *busy_ns = busy;
    return (int)n;
}

static int dram_describe(struct kv_ctx *ctx, char *buf, size_t len)
{
    const struct dram_data *d = ctx->backend_data;
    size_t pos = 0;

    kv_appendf(buf, len, &pos,
               ",\"page_size\":%zu,\"hugepages_requested\":%s,\"hugepages_advised\":%s"
               ",\"arena_hugepage_bytes\":%" PRIu64 ",\"prefaulted\":%s,\"cache_cold\":%s",
               d->page_bytes, d->hugepages_requested ? "true" : "false",
               d->hugepages_advised ? "true" : "false", d->arena_hugepage_bytes,
               d->prefaulted ? "true" : "false", d->cold ? "true" : "false");
    return (int)pos;
}

static void dram_close(struct kv_ctx *ctx)
{
    struct dram_data *d = ctx->backend_data;

    if (!d)
        return;
    dram_unmap(&d->arena);
    dram_unmap(&d->staging);
    free(d);
    ctx->backend_data = NULL;
    ctx->arena_host = ctx->staging_host = NULL;
}

const struct kv_backend_ops kv_dram_ops = {
    .version = KV_OPS_VERSION,
    .name = "dram",
    .open = dram_open,
    .prepare = dram_prepare,
    .access = dram_access,
    .describe = dram_describe,
    .close = dram_close,
};
