/*
 * numa.c - placeholder: the numa backend is being written (issue 3). Opening it
 * reports -ENOSYS so the registry, build and Python side are already wired.
 */
#define _GNU_SOURCE
#include <errno.h>

#include "backend.h"

static int numa_open(struct kv_ctx *ctx, const char *args)
{
    (void)args;
    return kv_fail(ctx, -ENOSYS, "numa: backend not implemented yet");
}

static int numa_prepare(struct kv_ctx *ctx, uint64_t arena_bytes, uint64_t staging_bytes)
{
    (void)arena_bytes;
    (void)staging_bytes;
    return kv_fail(ctx, -ENOSYS, "numa: backend not implemented yet");
}

static int numa_access(struct kv_ctx *ctx, int op, const struct kv_access *acc, uint32_t n,
                       uint64_t *lat_ns, uint64_t *busy_ns)
{
    (void)op;
    (void)acc;
    (void)n;
    (void)lat_ns;
    (void)busy_ns;
    return kv_fail(ctx, -ENOSYS, "numa: backend not implemented yet");
}

const struct kv_backend_ops kv_numa_ops = {
    .version = KV_OPS_VERSION,
    .name = "numa",
    .open = numa_open,
    .prepare = numa_prepare,
    .access = numa_access,
};
