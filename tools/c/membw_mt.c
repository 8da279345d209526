/*
 * membw_mt.c - the plain C baseline of tools/bench_workers.py (and of the store
 * rows of tools/bench_replay_dram.py): W pinned threads moving a sequence of
 * block accesses the way kvemu's memory tiers do (cbackends/memtier.c,
 * memtier_access / memtier_work), with no kvemu code in between. Compiled by
 * the benchmark at run time; never committed as a binary.
 *
 *   membw_mt ARENA_BYTES BLOCK_BYTES ACCESSES|@FILE WORKERS COLD [HUGEPAGES]
 *
 * then one command per line on stdin: `load`, `store` or `read` runs one pass
 * over the sequence and prints one JSON line; `quit` (or end of input) exits.
 * The arena and staging buffer stay mapped between passes, so a benchmark can
 * interleave passes of this process with kvemu's, back to back.
 *
 * ACCESSES blocks at uniformly random slots (batches of 256, staging offsets
 * from a cursor as below), or @FILE: the transfers to perform, in order, as
 * records of four little-endian uint64 (arena offset, bytes, staging offset,
 * batch number), such as the transfers a kvemu replay performed
 * (tools/bench_common.py, replay_transfers): consecutive records with the same
 * batch number form one batch (at most 256), as one memtier_access call.
 *
 * What it does, as kvemu does it:
 *  - memory: anonymous, 2 MiB aligned, huge pages advised, pre-faulted by
 *    writes; staging of min(64 MiB, arena) rounded down to whole blocks,
 *    filled front to back by a cursor that wraps when the next block does not
 *    fit (core.c, kv_run_phase);
 *  - batches: of at most 256 transfers (KV_BATCH); a
 *    batch's bytes are split into W contiguous shares, cut on 64-byte lines
 *    (the last share takes the rest; a block may be cut between two workers),
 *    and fewer workers run when a share would fall below 32 KiB;
 *  - threads: worker 0 is the calling thread, workers 1..W-1 are threads, worker
 *    k pinned to the k-th CPU this process may use (round-robin beyond them:
 *    W > CPUs oversubscribes); a batch starts when worker 0 publishes it and
 *    ends when every worker is done (spinning, with sched_yield now and then);
 *  - timing: each worker brackets each piece with lfence;rdtsc;lfence; load =
 *    memcpy arena -> staging; store = memcpy staging -> arena, then the best
 *    write-back this CPU has (clwb, else clflushopt, each + sfence; else
 *    clflush + mfence) of every stored line, INSIDE the timed region; read =
 *    one 8-byte load per 64-byte line, summed;
 *  - COLD=1: every arena line a piece touched is evicted after its timed
 *    region, untimed, as kvemu's memtier does: clflushopt where the CPU has
 *    it, else clflush, then mfence;
 *  - figure: busy = the largest per-worker sum of piece times of each batch,
 *    summed over the batches; GB/s = bytes / busy. TSC ticks are converted at
 *    the rate measured against CLOCK_MONOTONIC_RAW over the pass.
 *
 * Each pass prints {"op":..., "gbps":G, "bytes":B, "busy_ns":N, "skew_ns":...,
 * "wall_gbps":..., "workers":W, "writeback":"clwb+sfence", ...}: skew_ns sums
 * over the batches the time between the first and the last worker's first
 * piece start (how late the helpers joined: time busy_ns does not see);
 * wall_gbps is bytes / the whole pass, untimed flushes and all.
 */
#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define ALIGN_BYTES (2ull << 20)
#define STAGING_MAX (64ull << 20)
#define BATCH 256u
#define MIN_SHARE (32u << 10)
#define MAX_WORKERS 256u

enum { OP_LOAD, OP_STORE, OP_READ };
enum { WB_CLWB, WB_CLFLUSHOPT, WB_CLFLUSH };

static uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC_RAW, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t tsc(void)
{
    uint32_t lo, hi;

    __asm__ __volatile__("lfence\n\trdtsc\n\tlfence" : "=a"(lo), "=d"(hi) : : "memory");
    return ((uint64_t)hi << 32) | lo;
}

static uint8_t *map_region(uint64_t bytes, int huge)
{
    uint64_t span = bytes + ALIGN_BYTES;
    uint8_t *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint8_t *base;

    if (raw == MAP_FAILED) {
        perror("mmap");
        exit(2);
    }
    base = (uint8_t *)(((uintptr_t)raw + ALIGN_BYTES - 1) & ~(uintptr_t)(ALIGN_BYTES - 1));
    if (huge)
        madvise(base, bytes, MADV_HUGEPAGE);
    for (uint64_t off = 0; off < bytes; off += 4096)
        base[off] = (uint8_t)off;
    return base;
}

static uint64_t next_rand(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545f4914f6cdd1dull;
}

static int writeback_kind(void)
{
    unsigned a, b, c, d;

    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        if (b & (1u << 24))
            return WB_CLWB;
        if (b & (1u << 23))
            return WB_CLFLUSHOPT;
    }
    return WB_CLFLUSH;
}

static const char *const WB_NAME[] = { "clwb+sfence", "clflushopt+sfence", "clflush+mfence" };

__attribute__((target("clwb"))) static void wb_clwb(uint8_t *p, uint64_t n)
{
    for (uint64_t off = 0; off < n; off += 64)
        _mm_clwb(p + off);
    _mm_sfence();
}

__attribute__((target("clflushopt"))) static void wb_clflushopt(uint8_t *p, uint64_t n)
{
    for (uint64_t off = 0; off < n; off += 64)
        _mm_clflushopt(p + off);
    _mm_sfence();
}

static void flush_lines(uint8_t *p, uint64_t n)
{
    for (uint64_t off = 0; off < n; off += 64)
        _mm_clflush(p + off);
    _mm_mfence();
}

/* COLD=1's eviction (memtier_evict in cbackends/memtier.c). */
__attribute__((target("clflushopt"))) static void evict_clflushopt(uint8_t *p, uint64_t n)
{
    for (uint64_t off = 0; off < n; off += 64)
        _mm_clflushopt(p + off);
    _mm_mfence();
}

static int have_clflushopt(void)
{
    unsigned a, b, c, d;

    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 23));
}

/* ------------------------------------------------------------------ state */

static uint8_t *arena, *staging;
static uint64_t arena_bytes, staging_bytes, block, n_acc;
/* One transfer: as struct kv_access, plus the batch it belongs to. */
struct xfer {
    uint64_t arena_off, bytes, staging_off, batch;
};
static struct xfer *acc;
static uint64_t *batch_at, n_batches;   /* index of each batch's first transfer; batch_at[n_batches] = n_acc */
static uint32_t n_workers;
static int cold, wb, evict_opt;    /* evict_opt: COLD=1 evicts with clflushopt */
static int cpus[CPU_SETSIZE], n_cpus;

/* The current batch, published by worker 0. */
static int op;
static uint64_t batch_first, batch_n, batch_total;
static uint64_t begin[BATCH + 1];
static uint32_t batch_k;
static uint64_t piece_ticks[MAX_WORKERS];
static uint64_t first_tick[MAX_WORKERS];       /* the worker's first piece start in the batch */
static uint64_t sink[MAX_WORKERS];
static _Atomic uint64_t gen;            /* batch sequence; helpers wait for it to move */
static _Atomic uint32_t remaining;      /* active helpers not yet done with the batch */
static _Atomic int stop;

/* Worker w's share of the current batch: bytes [w * total / k, (w + 1) * total / k), cut on lines. */
static void work(uint32_t w, uint32_t k)
{
    uint64_t lo = batch_total / k * w + batch_total % k * w / k, hi, ticks = 0, s = 0;
    uint64_t t_first = UINT64_MAX;
    uint64_t i = 0;

    hi = w + 1 == k ? batch_total : batch_total / k * (w + 1) + batch_total % k * (w + 1) / k;
    lo &= ~(uint64_t)63;
    if (w + 1 < k)
        hi &= ~(uint64_t)63;
    while (i < batch_n && begin[i + 1] <= lo)
        i++;
    for (; i < batch_n && begin[i] < hi; i++) {
        uint64_t a_lo = lo > begin[i] ? lo - begin[i] : 0;
        uint64_t a_hi = (hi < begin[i + 1] ? hi : begin[i + 1]) - begin[i];
        uint64_t bytes = a_hi - a_lo, t0, t1;
        uint8_t *p = arena + acc[batch_first + i].arena_off + a_lo;
        uint8_t *q = staging + acc[batch_first + i].staging_off + a_lo;

        if (bytes == 0)
            continue;
        t0 = tsc();
        if (op == OP_LOAD) {
            memcpy(q, p, bytes);
        } else if (op == OP_STORE) {
            memcpy(p, q, bytes);
            if (wb == WB_CLWB)
                wb_clwb(p, bytes);
            else if (wb == WB_CLFLUSHOPT)
                wb_clflushopt(p, bytes);
            else
                flush_lines(p, bytes);
        } else {
            for (const uint8_t *r = p; r < p + bytes; r += 64) {
                uint64_t v;

                memcpy(&v, r, sizeof(v));
                s += v;
            }
        }
        t1 = tsc();
        ticks += t1 - t0;
        if (t0 < t_first)
            t_first = t0;
        if (cold && evict_opt)
            evict_clflushopt(p, bytes);
        else if (cold)
            flush_lines(p, bytes);
    }
    piece_ticks[w] = ticks;
    first_tick[w] = t_first;
    sink[w] += s;
}

static void *helper(void *arg)
{
    uint32_t w = (uint32_t)(uintptr_t)arg;
    uint64_t seen = 0;

    for (;;) {
        uint64_t g;
        unsigned spins = 0;

        while ((g = atomic_load(&gen)) == seen && !atomic_load(&stop)) {
            _mm_pause();
            if (++spins % 4096u == 0)
                sched_yield();
        }
        if (atomic_load(&stop))
            return NULL;
        seen = g;
        if (w < batch_k) {
            work(w, batch_k);
            atomic_fetch_sub(&remaining, 1);
        }
    }
}

static void pin(pthread_t t, int cpu)
{
    cpu_set_t one;

    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pthread_setaffinity_np(t, sizeof(one), &one);
}

/* One pass over the sequence; prints its JSON line. */
static void pass(int which)
{
    pthread_t th[MAX_WORKERS];
    uint64_t busy_ticks = 0, skew_ticks = 0, bytes = 0, c0, c1, k0, k1, s = 0;
    double ns_per_tick, busy_ns;

    op = which;
    atomic_store(&stop, 0);
    atomic_store(&gen, 0);
    pin(pthread_self(), cpus[0]);
    for (uint32_t w = 1; w < n_workers; w++) {
        pthread_create(&th[w], NULL, helper, (void *)(uintptr_t)w);
        pin(th[w], cpus[w % (uint32_t)n_cpus]);
    }
    c0 = now_ns();
    k0 = tsc();
    for (uint64_t b = 0; b < n_batches; b++) {
        uint64_t first = batch_at[b], n = batch_at[b + 1] - first, max = 0, lo = UINT64_MAX, hi = 0;
        uint32_t k = n_workers;
        unsigned spins = 0;

        batch_first = first;
        batch_n = n;
        begin[0] = 0;
        for (uint64_t i = 0; i < n; i++)
            begin[i + 1] = begin[i] + acc[first + i].bytes;
        batch_total = begin[n];
        if (batch_total / MIN_SHARE < k)
            k = batch_total / MIN_SHARE > 1 ? (uint32_t)(batch_total / MIN_SHARE) : 1;
        batch_k = k;
        if (k > 1) {
            atomic_store(&remaining, k - 1);
            atomic_fetch_add(&gen, 1);      /* seq_cst: publishes the batch */
        }
        work(0, k);
        while (k > 1 && atomic_load(&remaining) != 0) {
            _mm_pause();
            if (++spins % 4096u == 0)
                sched_yield();
        }
        for (uint32_t w = 0; w < k; w++) {
            if (piece_ticks[w] > max)
                max = piece_ticks[w];
            if (first_tick[w] < lo)
                lo = first_tick[w];
            if (first_tick[w] != UINT64_MAX && first_tick[w] > hi)
                hi = first_tick[w];
        }
        busy_ticks += max;
        skew_ticks += hi > lo ? hi - lo : 0;
        bytes += batch_total;
    }
    k1 = tsc();
    c1 = now_ns();
    atomic_store(&stop, 1);
    for (uint32_t w = 1; w < n_workers; w++)
        pthread_join(th[w], NULL);
    for (uint32_t w = 0; w < n_workers; w++)
        s += sink[w];
    ns_per_tick = (double)(c1 - c0) / (double)(k1 - k0);
    busy_ns = (double)busy_ticks * ns_per_tick;
    printf("{\"op\":\"%s\",\"gbps\":%.4f,\"bytes\":%llu,\"busy_ns\":%.0f,\"skew_ns\":%.0f,"
           "\"wall_gbps\":%.4f,"
           "\"accesses\":%llu,\"batches\":%llu,\"block_bytes\":%llu,\"arena_bytes\":%llu,\"workers\":%u,"
           "\"cpus\":%d,\"cold\":%d,\"cold_flush\":\"%s\",\"writeback\":\"%s\",\"sink\":%llu}\n",
           op == OP_LOAD ? "load" : op == OP_STORE ? "store" : "read", (double)bytes / busy_ns,
           (unsigned long long)bytes, busy_ns, (double)skew_ticks * ns_per_tick, (double)bytes / (double)(c1 - c0),
           (unsigned long long)n_acc, (unsigned long long)n_batches, (unsigned long long)block, (unsigned long long)arena_bytes,
           n_workers, n_cpus, cold, !cold ? "none" : evict_opt ? "clflushopt+mfence" : "clflush+mfence",
           WB_NAME[wb], (unsigned long long)(s & 0xff));
    fflush(stdout);
}

int main(int argc, char **argv)
{
    int huge = 1;
    uint64_t slots, seed = 0x9e3779b97f4a7c15ull;
    cpu_set_t mine;
    char line[64];

    if (argc < 6) {
        fprintf(stderr, "usage: %s ARENA_BYTES BLOCK_BYTES ACCESSES|@FILE WORKERS COLD [HUGEPAGES]\n"
                        "then load|store|read|quit lines on stdin\n", argv[0]);
        return 2;
    }
    arena_bytes = strtoull(argv[1], NULL, 10);
    block = strtoull(argv[2], NULL, 10);
    n_acc = argv[3][0] == '@' ? 1 : strtoull(argv[3], NULL, 10);
    n_workers = (uint32_t)strtoul(argv[4], NULL, 10);
    cold = atoi(argv[5]);
    evict_opt = have_clflushopt();
    if (argc > 6)
        huge = atoi(argv[6]);
    if (!block || block % 64 || arena_bytes < block || !n_acc || n_workers < 1 ||
        n_workers > MAX_WORKERS) {
        fprintf(stderr, "membw_mt: bad arguments\n");
        return 2;
    }
    if (sched_getaffinity(0, sizeof(mine), &mine) != 0) {
        perror("sched_getaffinity");
        return 2;
    }
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &mine))
            cpus[n_cpus++] = c;
    wb = writeback_kind();
    slots = arena_bytes / block;
    arena_bytes = slots * block;
    staging_bytes = arena_bytes < STAGING_MAX ? arena_bytes : STAGING_MAX;
    staging_bytes -= staging_bytes % block;
    staging = map_region(staging_bytes, huge);
    arena = map_region(arena_bytes, huge);
    if (argv[3][0] == '@') {
        FILE *f = fopen(argv[3] + 1, "rb");
        long len;

        if (!f || fseek(f, 0, SEEK_END) != 0 || (len = ftell(f)) <= 0) {
            fprintf(stderr, "membw_mt: cannot read %s\n", argv[3] + 1);
            return 2;
        }
        rewind(f);
        n_acc = (uint64_t)len / sizeof(*acc);
        acc = malloc(n_acc * sizeof(*acc));
        if (!acc || fread(acc, sizeof(*acc), n_acc, f) != n_acc)
            return 2;
        fclose(f);
    } else {
        uint64_t cursor = 0;

        acc = malloc(n_acc * sizeof(*acc));
        if (!acc)
            return 2;
        for (uint64_t i = 0; i < n_acc; i++) {
            acc[i] = (struct xfer){ .arena_off = next_rand(&seed) % slots * block, .bytes = block,
                                    .staging_off = cursor, .batch = i / BATCH };
            cursor += block;
            if (cursor + block > staging_bytes)
                cursor = 0;
        }
    }
    batch_at = malloc((n_acc + 1) * sizeof(*batch_at));
    if (!batch_at)
        return 2;
    for (uint64_t i = 0; i < n_acc; i++) {
        const struct xfer *x = &acc[i];

        if (!x->bytes || x->bytes % 64 || x->arena_off > arena_bytes ||
            x->bytes > arena_bytes - x->arena_off || x->staging_off > staging_bytes ||
            x->bytes > staging_bytes - x->staging_off) {
            fprintf(stderr, "membw_mt: transfer %llu (arena %llu, %llu bytes, staging %llu) outside "
                            "the arena (%llu) or staging (%llu)\n", (unsigned long long)i,
                    (unsigned long long)x->arena_off, (unsigned long long)x->bytes,
                    (unsigned long long)x->staging_off, (unsigned long long)arena_bytes,
                    (unsigned long long)staging_bytes);
            return 2;
        }
        if (i == 0 || x->batch != acc[i - 1].batch) {
            batch_at[n_batches++] = i;
        } else if (i - batch_at[n_batches - 1] >= BATCH) {
            fprintf(stderr, "membw_mt: batch %llu holds more than %u transfers\n",
                    (unsigned long long)x->batch, BATCH);
            return 2;
        }
    }
    batch_at[n_batches] = n_acc;
    printf("{\"ready\":true,\"workers\":%u,\"cpus\":%d,\"writeback\":\"%s\"}\n", n_workers, n_cpus,
           WB_NAME[wb]);
    fflush(stdout);
    while (fgets(line, sizeof(line), stdin)) {
        line[strcspn(line, "\r\n")] = 0;
        if (strcmp(line, "load") == 0)
            pass(OP_LOAD);
        else if (strcmp(line, "store") == 0)
            pass(OP_STORE);
        else if (strcmp(line, "read") == 0)
            pass(OP_READ);
        else if (strcmp(line, "quit") == 0 || line[0] == 0)
            break;
        else {
            fprintf(stderr, "membw_mt: unknown command '%s'\n", line);
            return 2;
        }
    }
    return 0;
}
