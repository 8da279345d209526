/*
 * dram.c - host DRAM, the fastest tier kvemu replays on (a CPU-memory KV cache
 * such as LMCache's or Mooncake's local DRAM pool).
 *
 * Measures each block transfer as this host's transfer workers perform it
 * (memtier.c, xfer.c): W pinned threads (workers=N, default one per CPU this
 * process may use) split every batch of transfers, as a GPU's copy engines
 * split a step's copies. load = memcpy arena -> staging, store = memcpy
 * staging -> arena with every stored line written back (clwb, else
 * clflushopt, else clflush) and a fence inside the timed region, read = one
 * 8-byte load per 64-byte cache line of the block, in place.
 *
 * Caveats:
 *  - CPU workers, not a DMA engine. A GPU copies over its link with copy
 *    engines; replay composes each batch with the link model (core.c), and a
 *    batch these workers made slower than the link is counted medium-bound:
 *    results flag such a run host-bound, an upper bound of the tier's time.
 *  - Caches. A GPU reaching a memory tier gets nothing from the CPU's caches,
 *    so by default (cold=1, x86-64) every arena line an access touched is
 *    evicted (clflushopt, else clflush) after the access is timed: the next
 *    access to that block comes from DRAM, as in a tier many times larger
 *    than the LLC.
 *    With cold=0 recently touched blocks are served from cache. The staging
 *    buffer (the HBM stand-in, up to 64 MiB) is not flushed.
 *  - Timer. Each access is bracketed by two timer reads (~20-40 cycles with
 *    the TSC); for small blocks that overhead is part of the latency.
 *  - Stores count until their lines are written back to memory; that
 *    includes reading a cold line for ownership, which a GPU's DMA write of
 *    whole lines would not need.
 *  - Pages. Both buffers are pre-faulted at prepare (as writes), so no page
 *    fault lands in a timed access. Huge pages are advised (hugepages=1, the
 *    default), not guaranteed; describe reports how much of the arena the
 *    kernel backed with them. Nothing is mlocked: under memory pressure pages may be
 *    reclaimed and faulted back in, which shows up as latency outliers.
 */
#define _GNU_SOURCE
#include "memtier.h"

/* Everything but the arena's origin is shared with numa and mmap (memtier.c). */
static const struct memtier_kind dram_kind = {
    .ops = &kv_dram_ops,
    .data_bytes = sizeof(struct memtier),
};

static int dram_open(struct kv_ctx *ctx, const char *args)
{
    return memtier_open(ctx, &dram_kind, args);
}

static int dram_prepare(struct kv_ctx *ctx, uint64_t arena_bytes, uint64_t staging_bytes)
{
    return memtier_prepare_anon(ctx, ctx->backend_data, arena_bytes, staging_bytes, NULL);
}

const struct kv_backend_ops kv_dram_ops = {
    .version = KV_OPS_VERSION,
    .name = "dram",
    .open = dram_open,
    .prepare = dram_prepare,
    .access = memtier_access,
    .describe = memtier_describe,
    .close = memtier_close,
    .attach = memtier_attach,
};
