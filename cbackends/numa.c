/*
 * numa.c - memory on one NUMA node reached from a CPU of another: a remote
 * socket's DRAM, or a CXL Type-3 memory expander, which Linux shows as a node
 * with memory and no CPUs. Spec: numa:NODE[,hugepages=0|1][,cold=0|1].
 *
 * Measures what dram measures, with memtier.c's access loop: the arena is
 * bound to NODE (raw mbind, MPOL_BIND, before the first touch) and the thread
 * calling prepare - the replaying thread - is pinned to one CPU of the nearest
 * other node that has CPUs (by the kernel's node distances). The staging
 * buffer keeps the default policy and is first touched from that CPU, so it is
 * local to it, as a GPU's HBM is to the GPU.
 *
 * Caveats:
 *  - dram.c's: one thread, each access timed alone, arena lines flushed after
 *    each access (cold=1), store buffers not drained, nothing mlocked.
 *  - Placement is checked once, after pre-faulting, on up to 4096 evenly
 *    spread pages (move_pages); prepare refuses when one is elsewhere.
 *    MPOL_BIND keeps later faults on NODE, but pages swapped out and back
 *    are not re-checked.
 *  - The pinned thread's previous affinity is restored at close; threads it
 *    starts meanwhile inherit the pinning.
 *  - With one node (or no other node with CPUs), the thread is not moved and
 *    describe says so: numa:0 on such a machine is local memory, the dram
 *    baseline through this backend's path, not a remote tier.
 *  - Huge pages are advised as in dram; a CXL node may have fewer free.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <linux/mempolicy.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "memtier.h"

#define NUMA_SYSFS "/sys/devices/system/node"
#define NUMA_MAX_NODES 1024u   /* the kernel's largest MAX_NUMNODES (NODES_SHIFT 10) */
#define NUMA_LONG_BITS (8u * sizeof(unsigned long))
#define NUMA_SAMPLE_PAGES 4096u

/* A set of node or CPU ids below NUMA_MAX_NODES; CPU_SETSIZE is the same 1024. */
struct numa_set {
    unsigned long bits[NUMA_MAX_NODES / NUMA_LONG_BITS];
};

struct numa_data {
    struct memtier mt;              /* first: memtier's hooks find it at backend_data */
    int node;                       /* where the arena lives */
    int cpu;                        /* the CPU prepare pins the thread to; -1: none elsewhere */
    int cpu_node;                   /* that CPU's node, else where the thread ran; -1 unknown */
    struct numa_set memory_nodes;   /* online nodes with memory, for describe and messages */
    int pinned;                     /* affinity changed by prepare, restored at close */
    pid_t tid;                      /* the thread pinned */
    cpu_set_t saved;                /* its affinity before */
    uint32_t pages_checked, pages_on_node;
    int staging_node;               /* node of staging's first page; -1 unknown */
    unsigned attached;              /* owner: contexts attached so far (atomic; picks their CPUs) */
};
_Static_assert(offsetof(struct numa_data, mt) == 0, "memtier's hooks read mt at backend_data");

static int numa_set_has(const struct numa_set *s, unsigned i)
{
    return i < NUMA_MAX_NODES && (s->bits[i / NUMA_LONG_BITS] >> (i % NUMA_LONG_BITS)) & 1u;
}

/* Appends the ids in s as "0,1,4". */
static void numa_append_set(char *buf, size_t len, size_t *pos, const struct numa_set *s)
{
    const char *sep = "";

    for (unsigned i = 0; i < NUMA_MAX_NODES; i++)
        if (numa_set_has(s, i)) {
            kv_appendf(buf, len, pos, "%s%u", sep, i);
            sep = ",";
        }
}

/* Parses a kernel list ("0-3,8,10-11", blank when empty) into s; 0 or -EINVAL. */
static int numa_parse_list(const char *text, struct numa_set *s)
{
    const char *p = text;

    memset(s, 0, sizeof(*s));
    while (*p && *p != '\n') {
        char *end;
        unsigned long lo = strtoul(p, &end, 10), hi = lo;

        if (end == p)
            return -EINVAL;
        p = end;
        if (*p == '-') {
            hi = strtoul(p + 1, &end, 10);
            if (end == p + 1)
                return -EINVAL;
            p = end;
        }
        if (lo > hi || hi >= NUMA_MAX_NODES)
            return -EINVAL;
        for (unsigned long i = lo; i <= hi; i++)
            s->bits[i / NUMA_LONG_BITS] |= 1ul << (i % NUMA_LONG_BITS);
        if (*p == ',')
            p++;
    }
    return 0;
}

/* The first line of a small sysfs or proc file into buf; 0 or -errno. */
static int numa_read_line(const char *path, char *buf, size_t len)
{
    FILE *f = fopen(path, "r");

    if (!f)
        return -errno;
    if (!fgets(buf, (int)len, f))
        buf[0] = '\0';
    fclose(f);
    return 0;
}

static int numa_read_set(const char *path, struct numa_set *s)
{
    char line[4096];
    int rc = numa_read_line(path, line, sizeof(line));

    return rc < 0 ? rc : numa_parse_list(line, s);
}

/* The memory nodes this process may use (its cpuset's), from /proc/self/status. */
static int numa_mems_allowed(struct numa_set *s)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[4096];
    int rc = -ENOENT;

    if (!f)
        return -errno;
    while (fgets(line, sizeof(line), f))
        if (strncmp(line, "Mems_allowed_list:", 18) == 0) {
            rc = numa_parse_list(line + 18 + strspn(line + 18, " \t"), s);
            break;
        }
    fclose(f);
    return rc;
}

/* Distance from node `from` to node `to`, as the kernel lists it; INT_MAX unknown. */
static int numa_distance(int from, int to, const struct numa_set *online)
{
    char path[96], line[4096], *p = line;

    snprintf(path, sizeof(path), NUMA_SYSFS "/node%d/distance", from);
    if (numa_read_line(path, line, sizeof(line)) < 0)
        return INT_MAX;
    /* One figure per online node, in ascending node order. */
    for (int n = 0; n < (int)NUMA_MAX_NODES; n++) {
        long v;
        char *end;

        if (!numa_set_has(online, (unsigned)n))
            continue;
        v = strtol(p, &end, 10);
        if (end == p)
            return INT_MAX;
        p = end;
        if (n == to)
            return v > 0 && v < INT_MAX ? (int)v : INT_MAX;
    }
    return INT_MAX;
}

static int numa_node_of_cpu(int cpu, const struct numa_set *online)
{
    for (int n = 0; cpu >= 0 && n < (int)NUMA_MAX_NODES; n++) {
        char path[96];
        struct numa_set cpus;

        snprintf(path, sizeof(path), NUMA_SYSFS "/node%d/cpulist", n);
        if (numa_set_has(online, (unsigned)n) && numa_read_set(path, &cpus) == 0 &&
            numa_set_has(&cpus, (unsigned)cpu))
            return n;
    }
    return -1;
}

/*
 * Finds the nodes (online, with memory), checks NODE is one this process may
 * bind to, and picks the CPU prepare will pin to: the first allowed CPU of the
 * nearest other node with allowed CPUs.
 */
static int numa_discover(struct kv_ctx *ctx, struct numa_data *d)
{
    struct numa_set online, mems_allowed;
    cpu_set_t allowed;
    int best_dist = INT_MAX;

    if (numa_read_set(NUMA_SYSFS "/online", &online) < 0)
        return kv_fail(ctx, -ENODEV, "numa: this kernel shows no NUMA nodes (" NUMA_SYSFS
                       "/online is missing)");
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0)
        CPU_ZERO(&allowed);
    d->cpu = -1;
    for (int n = 0; n < (int)NUMA_MAX_NODES; n++) {
        char path[96];
        uint64_t mem_kb = 0;
        struct numa_set cpus;
        int first_cpu = -1, dist;

        if (!numa_set_has(&online, (unsigned)n))
            continue;
        snprintf(path, sizeof(path), NUMA_SYSFS "/node%d/meminfo", n);
        if (memtier_meminfo_kb(path, "MemTotal", &mem_kb) && mem_kb > 0)
            d->memory_nodes.bits[n / NUMA_LONG_BITS] |= 1ul << (n % NUMA_LONG_BITS);
        snprintf(path, sizeof(path), NUMA_SYSFS "/node%d/cpulist", n);
        if (n == d->node || numa_read_set(path, &cpus) < 0)
            continue;
        for (int c = 0; c < CPU_SETSIZE && first_cpu < 0; c++)
            if (numa_set_has(&cpus, (unsigned)c) && CPU_ISSET(c, &allowed))
                first_cpu = c;
        dist = numa_distance(d->node, n, &online);
        if (first_cpu >= 0 && (d->cpu < 0 || dist < best_dist)) {
            d->cpu = first_cpu;
            d->cpu_node = n;
            best_dist = dist;
        }
    }
    if (!numa_set_has(&d->memory_nodes, (unsigned)d->node)) {
        char list[256] = "none";
        size_t pos = 0;

        numa_append_set(list, sizeof(list), &pos, &d->memory_nodes);
        return kv_fail(ctx, -ENODEV, "numa: node %d is unavailable (nodes with memory: %s)",
                       d->node, list);
    }
    /* mbind to a node outside the cpuset fails with a bare EINVAL; say why beforehand. */
    if (numa_mems_allowed(&mems_allowed) == 0 && !numa_set_has(&mems_allowed, (unsigned)d->node))
        return kv_fail(ctx, -ENODEV, "numa: node %d is outside this process's cpuset "
                       "(Mems_allowed_list of /proc/self/status)", d->node);
    if (d->cpu < 0)
        d->cpu_node = numa_node_of_cpu(sched_getcpu(), &online);
    return 0;
}

static const struct memtier_kind numa_kind = {
    .ops = &kv_numa_ops,
    .data_bytes = sizeof(struct numa_data),
};

static int numa_open(struct kv_ctx *ctx, const char *args)
{
    const char *rest;
    size_t n = kv_opt_positional(args, &rest);
    uint64_t node;
    struct numa_data *d;
    int rc;

    /* A node number the kernel cannot have is unavailable, like any missing node, below. */
    if (kv_parse_u64(args, n, &node) < 0 || node > INT_MAX)
        return kv_fail(ctx, -EINVAL, "numa: '%.*s' is not a node number; the spec is "
                       "numa:NODE[,hugepages=0|1][,cold=0|1]", (int)n, args);
    rc = memtier_open(ctx, &numa_kind, rest);
    if (rc < 0)
        return rc;
    d = memtier_container(ctx->backend_data, struct numa_data);
    d->node = (int)node;
    d->staging_node = -1;
    rc = numa_discover(ctx, d);
    if (rc < 0)
        memtier_discard(ctx);
    return rc;
}

/* memtier_prepare_anon's bind step: the arena has no page yet, so every fault obeys this. */
static int numa_bind(struct kv_ctx *ctx, struct memtier *m)
{
    struct numa_data *d = memtier_container(m, struct numa_data);
    struct numa_set mask;

    memset(&mask, 0, sizeof(mask));
    mask.bits[d->node / NUMA_LONG_BITS] = 1ul << (d->node % NUMA_LONG_BITS);
    /* The kernel reads maxnode - 1 bits (a historical off-by-one every caller matches). */
    if (syscall(SYS_mbind, m->arena.base, m->arena.bytes, MPOL_BIND, mask.bits,
                NUMA_MAX_NODES + 1, MPOL_MF_STRICT | MPOL_MF_MOVE) != 0) {
        int err = errno;

        return kv_fail(ctx, -err, "numa: cannot bind the arena to node %d (mbind): %s%s",
                       d->node, strerror(err),
                       err == EPERM ? " (a seccomp profile, as containers have, may forbid it)"
                                    : "");
    }
    return 0;
}

/* Where the kernel put a sample of the arena; -EIO when any sampled page is off the node. */
static int numa_verify(struct kv_ctx *ctx, struct numa_data *d)
{
    const struct memtier *m = &d->mt;
    size_t n_pages = m->arena.bytes / m->page_bytes;
    uint32_t k = n_pages < NUMA_SAMPLE_PAGES ? (uint32_t)n_pages : NUMA_SAMPLE_PAGES;
    void **pages = malloc((k + 1) * sizeof(*pages));
    int *status = malloc((k + 1) * sizeof(*status)), bad = -1, rc = 0;

    if (!pages || !status) {
        free(pages);
        free(status);
        return kv_fail(ctx, -ENOMEM, "numa: cannot allocate the placement sample");
    }
    for (uint32_t i = 0; i < k; i++)
        pages[i] = m->arena.base + (size_t)((uint64_t)i * n_pages / k) * m->page_bytes;
    pages[k] = m->staging.base;     /* rides along, for describe */
    /* nodes == NULL: move nothing, report each page's node (or -errno) in status. */
    if (syscall(SYS_move_pages, 0, (unsigned long)k + 1, pages, NULL, status, 0) != 0) {
        int err = errno;

        rc = kv_fail(ctx, -err, "numa: cannot query the arena's placement (move_pages): %s",
                     strerror(err));
        goto out;
    }
    d->staging_node = status[k] >= 0 ? status[k] : -1;
    d->pages_checked = k;
    d->pages_on_node = 0;
    for (uint32_t i = 0; i < k; i++) {
        if (status[i] == d->node)
            d->pages_on_node++;
        else if (bad < 0)
            bad = (int)i;
    }
    if (bad >= 0)
        rc = kv_fail(ctx, -EIO,
                     "numa: %u of %u sampled arena pages are not on node %d (the page at offset "
                     "%zu reports %s %d); the binding did not hold", k - d->pages_on_node, k,
                     d->node, (size_t)((uint8_t *)pages[bad] - m->arena.base),
                     status[bad] < 0 ? "error" : "node",
                     status[bad] < 0 ? -status[bad] : status[bad]);
out:
    free(pages);
    free(status);
    return rc;
}

static void numa_unpin(struct numa_data *d)
{
    /* By tid: close may run on another thread than prepare did. A thread gone is ESRCH, fine. */
    if (d->pinned)
        sched_setaffinity(d->tid, sizeof(d->saved), &d->saved);
    d->pinned = 0;
}

/* Pins the calling thread - the one that replays - to a CPU of another node, when there is one. */
static int numa_pin(struct kv_ctx *ctx, struct numa_data *d)
{
    if (d->cpu >= 0) {
        cpu_set_t one;
        int err;

        if (sched_getaffinity(0, sizeof(d->saved), &d->saved) != 0) {
            err = errno;
            return kv_fail(ctx, -err, "numa: cannot read this thread's CPU affinity: %s",
                           strerror(err));
        }
        CPU_ZERO(&one);
        CPU_SET(d->cpu, &one);
        if (sched_setaffinity(0, sizeof(one), &one) != 0) {
            err = errno;
            return kv_fail(ctx, -err, "numa: cannot pin this thread to CPU %d (node %d): %s",
                           d->cpu, d->cpu_node, strerror(err));
        }
        d->tid = gettid();
        d->pinned = 1;
    }
    return 0;
}

/*
 * The transfer workers run on the CPUs of the replaying CPU's node that this
 * process may use (all allowed CPUs when that node is unknown), so that every
 * worker reaches the arena across the same distance.
 */
static void numa_worker_cpus(struct numa_data *d)
{
    struct numa_set node_cpus;
    cpu_set_t allowed;
    char path[96];

    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0)
        return;
    CPU_ZERO(&d->mt.cpus);
    if (d->cpu_node >= 0) {
        snprintf(path, sizeof(path), NUMA_SYSFS "/node%d/cpulist", d->cpu_node);
        if (numa_read_set(path, &node_cpus) == 0)
            for (int c = 0; c < CPU_SETSIZE; c++)
                if (CPU_ISSET(c, &allowed) && numa_set_has(&node_cpus, (unsigned)c))
                    CPU_SET(c, &d->mt.cpus);
    }
    if (CPU_COUNT(&d->mt.cpus) == 0)
        d->mt.cpus = allowed;
    /* The replaying thread is pinned to d->cpu (when there is one): it must be in the set. */
    if (d->cpu >= 0)
        CPU_SET(d->cpu, &d->mt.cpus);
    d->mt.have_cpus = 1;
}

static int numa_prepare(struct kv_ctx *ctx, uint64_t arena_bytes, uint64_t staging_bytes)
{
    struct numa_data *d = memtier_container(ctx->backend_data, struct numa_data);
    char path[96];
    uint64_t free_kb = 0, inactive_kb = 0;
    int rc;

    /* MPOL_BIND does not spill to other nodes: a full node reclaims, swaps or OOM-kills. */
    snprintf(path, sizeof(path), NUMA_SYSFS "/node%d/meminfo", d->node);
    if (memtier_meminfo_kb(path, "MemFree", &free_kb)) {
        uint64_t room;

        memtier_meminfo_kb(path, "Inactive(file)", &inactive_kb);
        room = (free_kb + inactive_kb) * 1024;
        if (arena_bytes > room)
            return kv_fail(ctx, -ENOMEM,
                           "numa: arena (%" PRIu64 " bytes) exceeds the %" PRIu64 " bytes node %d "
                           "can give (MemFree + Inactive(file)); binding it there would invite "
                           "the OOM killer", arena_bytes, room, d->node);
    }
    numa_worker_cpus(d);
    rc = numa_pin(ctx, d);
    if (rc < 0)
        return rc;
    /* Pinned first, so staging's first touch - and so its pages - are on the CPU's node. */
    rc = memtier_prepare_anon(ctx, &d->mt, arena_bytes, staging_bytes, numa_bind);
    if (rc == 0) {
        rc = numa_verify(ctx, d);
        if (rc < 0)
            memtier_release(ctx, &d->mt);
    }
    if (rc < 0)
        numa_unpin(d);
    return rc;
}

static int numa_describe(struct kv_ctx *ctx, char *buf, size_t len)
{
    const struct numa_data *d = memtier_container(ctx->backend_data, struct numa_data);
    size_t pos = (size_t)memtier_describe(ctx, buf, len);

    kv_appendf(buf, len, &pos, ",\"node\":%d,\"nodes_with_memory\":[", d->node);
    numa_append_set(buf, len, &pos, &d->memory_nodes);
    kv_appendf(buf, len, &pos, "],\"pages_checked\":%u,\"pages_on_node\":%u", d->pages_checked,
               d->pages_on_node);
    if (d->cpu >= 0)
        kv_appendf(buf, len, &pos, ",\"cpu\":%d", d->cpu);
    else
        kv_appendf(buf, len, &pos, ",\"cpu\":null");
    if (d->cpu_node >= 0)
        kv_appendf(buf, len, &pos, ",\"cpu_node\":%d", d->cpu_node);
    else
        kv_appendf(buf, len, &pos, ",\"cpu_node\":null");
    kv_appendf(buf, len, &pos, ",\"cpu_pinned\":%s,\"remote_cpu\":%s",
               d->pinned ? "true" : "false", d->cpu >= 0 ? "true" : "false");
    if (d->cpu < 0)
        kv_appendf(buf, len, &pos,
                   ",\"cpu_note\":\"no allowed CPU outside node %d: the thread is not moved, so "
                   "this measures memory local to the CPU (the dram baseline), not a remote tier\"",
                   d->node);
    if (d->staging_node >= 0)
        kv_appendf(buf, len, &pos, ",\"staging_node\":%d", d->staging_node);
    else
        kv_appendf(buf, len, &pos, ",\"staging_node\":null");
    return (int)pos;
}

/*
 * Another instance on the same node: the arena is the owner's, its own thread is pinned too, to
 * the next CPU of the replaying node (the k-th attached context gets the k-th CPU after the
 * owner's, round the node's allowed CPUs), so that instances do not share one CPU.
 */
static int numa_attach(struct kv_ctx *ctx, const struct kv_ctx *owner, uint64_t staging_bytes)
{
    struct numa_data *d = memtier_container(ctx->backend_data, struct numa_data);
    int rc;

    numa_worker_cpus(d);
    if (d->cpu >= 0) {
        struct numa_data *od = memtier_container(owner->backend_data, struct numa_data);
        unsigned k = __atomic_add_fetch(&od->attached, 1u, __ATOMIC_RELAXED);
        int count = CPU_COUNT(&d->mt.cpus), seen = 0;

        for (int c = 0; count > 0 && c < CPU_SETSIZE; c++) {
            if (!CPU_ISSET(c, &d->mt.cpus))
                continue;
            if ((unsigned)seen == k % (unsigned)count) {
                d->cpu = c;
                break;
            }
            seen++;
        }
    }
    rc = numa_pin(ctx, d);

    return rc < 0 ? rc : memtier_attach(ctx, owner, staging_bytes);
}

static void numa_close(struct kv_ctx *ctx)
{
    if (!ctx->backend_data)
        return;
    numa_unpin(memtier_container(ctx->backend_data, struct numa_data));
    memtier_close(ctx);
}

const struct kv_backend_ops kv_numa_ops = {
    .version = KV_OPS_VERSION,
    .name = "numa",
    .open = numa_open,
    .prepare = numa_prepare,
    .access = memtier_access,
    .describe = numa_describe,
    .close = numa_close,
    .attach = numa_attach,
};
