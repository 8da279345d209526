/*
 * membw.c - the plain C baseline of tools/bench_dram.py: block copies (memcpy,
 * kvemu's `load`) or in-place sums (one 8-byte load per 64-byte line, kvemu's
 * `read`) of BLOCK bytes at random slots of an arena of ARENA bytes, with no
 * kvemu code in between. Compiled by the benchmark at run time; never
 * committed as a binary.
 *
 *   membw copy|sum ARENA_BYTES BLOCK_BYTES ACCESSES|@FILE FLUSH REPS [HUGEPAGES]
 *
 * ACCESSES blocks at uniformly random slots, or @FILE: the arena offsets to
 * access, in order (little-endian uint64, multiples of BLOCK_BYTES), such as
 * the sequence a kvemu replay performed.
 *
 * Memory is set up as kvemu's dram backend sets it up (cbackends/memtier.c):
 * anonymous, 2 MiB aligned, huge pages advised, pre-faulted by writes; copies
 * go to a staging buffer of min(64 MiB, arena) filled front to back.
 *
 * FLUSH=0: the whole loop is timed with clock_gettime, nothing else inside it.
 * FLUSH=1: every arena line an access touched is flushed (clflush + mfence)
 * after it, as dram's cold=1 does; the flushes must stay out of the timed
 * region, so each access is bracketed by the same lfence;rdtsc;lfence pair
 * kvemu uses and the bracketed times are summed. The TSC rate is measured
 * against CLOCK_MONOTONIC_RAW over the run.
 *
 * Prints one JSON line: {"op":..., "gbps":[one per repetition], ...}.
 */
#define _GNU_SOURCE
#include <emmintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define ALIGN_BYTES (2ull << 20)
#define STAGING_MAX (64ull << 20)

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

/* xorshift64*: an order of slots independent of numpy's and of the trace. */
static uint64_t next_rand(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545f4914f6cdd1dull;
}

int main(int argc, char **argv)
{
    int copy, flush, huge = 1;
    uint64_t arena_bytes, block, n, reps, slots, staging_bytes, seed = 0x9e3779b97f4a7c15ull;
    uint64_t sink = 0;
    uint8_t *arena, *staging;
    uint64_t *order;

    if (argc < 7) {
        fprintf(stderr, "usage: %s copy|sum ARENA_BYTES BLOCK_BYTES ACCESSES|@FILE FLUSH REPS [HUGEPAGES]\n",
                argv[0]);
        return 2;
    }
    copy = strcmp(argv[1], "copy") == 0;
    arena_bytes = strtoull(argv[2], NULL, 10);
    block = strtoull(argv[3], NULL, 10);
    n = argv[4][0] == '@' ? 1 : strtoull(argv[4], NULL, 10);
    flush = atoi(argv[5]);
    reps = strtoull(argv[6], NULL, 10);
    if (argc > 7)
        huge = atoi(argv[7]);
    if (!block || block % 64 || arena_bytes < block || !n || !reps) {
        fprintf(stderr, "membw: bad sizes\n");
        return 2;
    }
    slots = arena_bytes / block;
    staging_bytes = arena_bytes < STAGING_MAX ? arena_bytes : STAGING_MAX;
    staging_bytes -= staging_bytes % block;
    arena = map_region(slots * block, huge);
    staging = map_region(staging_bytes, huge);
    if (argv[4][0] == '@') {
        FILE *f = fopen(argv[4] + 1, "rb");
        long len;

        if (!f || fseek(f, 0, SEEK_END) != 0 || (len = ftell(f)) <= 0) {
            fprintf(stderr, "membw: cannot read %s\n", argv[4] + 1);
            return 2;
        }
        rewind(f);
        n = (uint64_t)len / sizeof(*order);
        order = malloc(n * sizeof(*order));
        if (!order || fread(order, sizeof(*order), n, f) != n)
            return 2;
        fclose(f);
        for (uint64_t i = 0; i < n; i++) {
            if (order[i] % block || order[i] + block > slots * block) {
                fprintf(stderr, "membw: offset %llu outside the arena\n", (unsigned long long)order[i]);
                return 2;
            }
        }
    } else {
        order = malloc(n * sizeof(*order));
        if (!order)
            return 2;
        for (uint64_t i = 0; i < n; i++)
            order[i] = next_rand(&seed) % slots * block;
    }

    printf("{\"op\":\"%s\",\"arena_bytes\":%llu,\"block_bytes\":%llu,\"accesses\":%llu,"
           "\"flush\":%d,\"hugepages\":%d,\"gbps\":[", copy ? "copy" : "sum",
           (unsigned long long)(slots * block), (unsigned long long)block,
           (unsigned long long)n, flush, huge);
    for (uint64_t r = 0; r < reps; r++) {
        uint64_t cursor = 0, ticks = 0, c0, c1, k0, k1;
        double ns;

        if (flush) {
            /* Start as cold as the replay does: nothing of the arena in cache. */
            for (uint64_t off = 0; off < slots * block; off += 64)
                _mm_clflush(arena + off);
            _mm_mfence();
        }
        c0 = now_ns();
        k0 = tsc();
        for (uint64_t i = 0; i < n; i++) {
            uint8_t *a = arena + order[i];
            uint64_t t0 = 0;

            if (flush)
                t0 = tsc();
            if (copy) {
                memcpy(staging + cursor, a, block);
                cursor += block;
                if (cursor + block > staging_bytes)
                    cursor = 0;
            } else {
                for (const uint8_t *p = a, *end = a + block; p < end; p += 64) {
                    uint64_t v;

                    memcpy(&v, p, sizeof(v));
                    sink += v;
                }
            }
            if (flush) {
                ticks += tsc() - t0;
                for (uint64_t off = 0; off < block; off += 64)
                    _mm_clflush(a + off);
                _mm_mfence();
            }
        }
        k1 = tsc();
        c1 = now_ns();
        /* FLUSH=1: the bracketed ticks at the TSC rate this run measured. */
        ns = flush ? (double)ticks * (double)(c1 - c0) / (double)(k1 - k0) : (double)(c1 - c0);
        printf("%s%.4f", r ? "," : "", (double)(n * block) / ns);
    }
    printf("],\"sink\":%llu}\n", (unsigned long long)(sink & 0xff));
    return 0;
}
