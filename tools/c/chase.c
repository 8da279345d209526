/*
 * chase.c - an independent pointer chase, the baseline of tools/bench_latency.py
 * for `kvemu calibrate`'s idle latency. Written apart from kvemu's kv_chase:
 * every cache line of the buffer is one element of a single random cycle
 * (Sattolo's algorithm, its own generator), and the loop is a plain dependent
 * load `p = *p` timed with clock_gettime around the whole round. Compiled by
 * the benchmark at run time; never committed as a binary.
 *
 *   chase BUFFER_BYTES HOPS_PER_ROUND ROUNDS [HUGEPAGES]
 *
 * The buffer is anonymous memory, 2 MiB aligned, huge pages advised
 * (HUGEPAGES=1, the default, as kvemu's dram), pre-faulted by writes.
 * Prints one JSON line: {"ns_per_hop":[one per round], "hugepage_bytes":N}.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define LINE 64u
#define ALIGN_BYTES (2ull << 20)

static uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC_RAW, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* pcg32-style LCG output: unrelated to kvemu's splitmix64. */
static uint32_t rnd(uint64_t *s)
{
    uint64_t old = *s;
    uint32_t x, rot;

    *s = old * 6364136223846793005ull + 1442695040888963407ull;
    x = (uint32_t)(((old >> 18u) ^ old) >> 27u);
    rot = (uint32_t)(old >> 59u);
    return (x >> rot) | (x << ((-rot) & 31));
}

static uint64_t rnd_below(uint64_t *s, uint64_t n)
{
    return (((uint64_t)rnd(s) << 32) | rnd(s)) % n;
}

/* AnonHugePages of the mapping holding addr, from /proc/self/smaps. */
static uint64_t hugepage_bytes(const void *addr)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    int inside = 0;
    uint64_t total = 0;

    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f)) {
        unsigned long lo, hi, kb;

        if (sscanf(line, "%lx-%lx", &lo, &hi) == 2) {
            inside = (uintptr_t)addr >= lo && (uintptr_t)addr < hi;
            continue;
        }
        if (inside && sscanf(line, "AnonHugePages: %lu", &kb) == 1)
            total += kb * 1024;
    }
    fclose(f);
    return total;
}

int main(int argc, char **argv)
{
    uint64_t bytes, hops, rounds, n, seed = 0x853c49e6748fea9bull;
    int huge = 1;
    uint8_t *raw, *buf;
    uint32_t *perm;
    void **p;

    if (argc < 4) {
        fprintf(stderr, "usage: %s BUFFER_BYTES HOPS_PER_ROUND ROUNDS [HUGEPAGES]\n", argv[0]);
        return 2;
    }
    bytes = strtoull(argv[1], NULL, 10);
    hops = strtoull(argv[2], NULL, 10);
    rounds = strtoull(argv[3], NULL, 10);
    if (argc > 4)
        huge = atoi(argv[4]);
    n = bytes / LINE;
    if (n < 2 || n > UINT32_MAX || !hops || !rounds) {
        fprintf(stderr, "chase: bad arguments\n");
        return 2;
    }
    raw = mmap(NULL, bytes + ALIGN_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        perror("mmap");
        return 2;
    }
    buf = (uint8_t *)(((uintptr_t)raw + ALIGN_BYTES - 1) & ~(uintptr_t)(ALIGN_BYTES - 1));
    if (huge)
        madvise(buf, bytes, MADV_HUGEPAGE);
    memset(buf, 0, bytes);

    /* Sattolo: a uniformly random permutation that is one cycle through every line. */
    perm = malloc(n * sizeof(*perm));
    if (!perm)
        return 2;
    for (uint64_t i = 0; i < n; i++)
        perm[i] = (uint32_t)i;
    for (uint64_t i = n - 1; i > 0; i--) {
        uint64_t j = rnd_below(&seed, i);
        uint32_t t = perm[i];

        perm[i] = perm[j];
        perm[j] = t;
    }
    for (uint64_t i = 0; i < n; i++)
        *(void **)(buf + (uint64_t)i * LINE) = buf + (uint64_t)perm[i] * LINE;
    free(perm);

    p = (void **)buf;
    for (uint64_t i = 0; i < hops / 8; i++) /* warm-up: TLB and the walk's own code */
        p = *p;
    printf("{\"buffer_bytes\":%llu,\"lines\":%llu,\"hops_per_round\":%llu,\"hugepages\":%d,"
           "\"ns_per_hop\":[", (unsigned long long)bytes, (unsigned long long)n,
           (unsigned long long)hops, huge);
    for (uint64_t r = 0; r < rounds; r++) {
        uint64_t t0 = now_ns(), t1;

        for (uint64_t i = 0; i < hops; i++)
            p = (void **)*p;
        t1 = now_ns();
        printf("%s%.3f", r ? "," : "", (double)(t1 - t0) / (double)hops);
    }
    printf("],\"hugepage_bytes\":%llu,\"end\":%llu}\n", (unsigned long long)hugepage_bytes(buf),
           (unsigned long long)((uintptr_t)p & 0xff));
    return 0;
}
