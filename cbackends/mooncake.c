/*
 * mooncake.c - a real storage stack in the loop: Mooncake Store (a master
 * process and the store client of kvemu/mooncake.py) reached over its TCP
 * transport on loopback.
 *
 * The store's client is a Python binding of a C++ library, so this backend
 * owns only the host side of the tier: the staging buffer (the HBM stand-in)
 * that the store client registers and moves bytes to and from. Each access
 * hook call is one batch of the core (one op, one replayed layer, at most
 * KV_BATCH transfers); it is handed to Python in one callback
 * (kv_py_stack_access, an extern "Python+C" function of build_ffi.py), which
 * builds the key list with numpy and makes one batch call of the store client
 * (batch_upsert_from for stores, batch_get_into for loads). The time of that
 * call, measured by the callback around the client call only, is the batch's
 * busy time and every access's latency (all are issued together and complete
 * by its end). Python thus runs once per batch, never once per access.
 *
 * Options (from Python, not the user): session=N, the key of the store
 * session in kvemu/backends.py's table of stacks.
 *
 * Caveats:
 *  - The arena is the store's segment (memory the client allocates and the
 *    master places objects in); arena_host stays NULL: only the store reads
 *    and writes it, with its own allocation, eviction and leases.
 *  - Reads in place (--tier-policy resident) are refused: a store is read by
 *    a get, not by loads.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "backend.h"

/*
 * Defined by cffi from build_ffi.py's extern "Python+C" declarations (kvemu/backends.py). Weak, so
 * that the core links without them (the sanitizer builds of tests/test_c_build.py): open then
 * refuses the backend.
 */
int kv_py_stack_prepare(uint64_t session, uint64_t staging_addr, uint64_t staging_bytes,
                        uint64_t arena_bytes) __attribute__((weak));
int kv_py_stack_access(uint64_t session, int op, const struct kv_access *acc, uint32_t n,
                       uint64_t *lat_ns, uint64_t *busy_ns) __attribute__((weak));

struct mooncake_data {
    uint64_t session;
    uint8_t *staging;
    uint64_t staging_bytes, arena_bytes;
};

static const struct kv_opt_key mooncake_keys[] = {
    { "session", "N" },
    { NULL, NULL },
};

static int mooncake_open(struct kv_ctx *ctx, const char *args)
{
    struct mooncake_data *d;
    struct kv_opts opts;
    struct kv_opt o;
    int rc, have = 0;

    if (!kv_py_stack_prepare || !kv_py_stack_access)
        return kv_fail(ctx, -ENOSYS, "mooncake: this build has no store callbacks (it runs through kvemu.backends)");
    d = calloc(1, sizeof(*d));
    if (!d)
        return kv_fail(ctx, -ENOMEM, "mooncake: out of memory");
    kv_opts_init(&opts, ctx, "mooncake", args, mooncake_keys, NULL);
    rc = 0;
    while (rc == 0 && (rc = kv_opts_next(&opts, &o)) > 0) {
        rc = kv_opt_u64(ctx, &o, 1, UINT64_MAX, &d->session);
        have = 1;
    }
    if (rc == 0 && !have)
        rc = kv_fail(ctx, -EINVAL, "mooncake: opened without a store session (open it through kvemu.backends.Backend)");
    if (rc < 0) {
        free(d);
        return rc;
    }
    ctx->backend_data = d;
    return 0;
}

static int mooncake_prepare(struct kv_ctx *ctx, uint64_t arena_bytes, uint64_t staging_bytes)
{
    struct mooncake_data *d = ctx->backend_data;
    void *p;
    int rc;

    if (arena_bytes == 0 || staging_bytes == 0)
        return kv_fail(ctx, -EINVAL, "mooncake: refusing an empty arena");
    p = mmap(NULL, staging_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED)
        return kv_fail(ctx, -errno, "mooncake: cannot map %" PRIu64 " bytes of staging: %s", staging_bytes,
                       strerror(errno));
    /* Non-zero, so that a load that moved nothing shows in a checksum. */
    memset(p, 0x5a, staging_bytes);
    rc = kv_py_stack_prepare(d->session, (uint64_t)(uintptr_t)p, staging_bytes, arena_bytes);
    if (rc < 0) {
        munmap(p, staging_bytes);
        return kv_fail(ctx, rc, "mooncake: the store could not mount a segment of %" PRIu64
                       " bytes or register the staging buffer (see the error raised)", arena_bytes);
    }
    d->staging = p;
    d->staging_bytes = staging_bytes;
    d->arena_bytes = arena_bytes;
    ctx->staging_host = p;
    return 0;
}

static int mooncake_access(struct kv_ctx *ctx, int op, const struct kv_access *acc, uint32_t n,
                           uint64_t *lat_ns, uint64_t *busy_ns)
{
    struct mooncake_data *d = ctx->backend_data;
    int rc;

    if (op == KV_OP_READ)
        return kv_fail(ctx, -EINVAL, "mooncake: a store is read by a get into HBM, not in place: "
                       "use --tier-policy offload, not resident");
    rc = kv_py_stack_access(d->session, op, acc, n, lat_ns, busy_ns);
    if (rc < 0)
        return kv_fail(ctx, rc, "mooncake: a batch %s failed (see the error raised)",
                       op == KV_OP_LOAD ? "get" : "put");
    return rc;
}

static int mooncake_describe(struct kv_ctx *ctx, char *buf, size_t len)
{
    const struct mooncake_data *d = ctx->backend_data;
    size_t pos = 0;

    kv_appendf(buf, len, &pos, ",\"store_session\":%" PRIu64 ",\"staging_bytes\":%" PRIu64
               ",\"arena_host_addressable\":false", d->session, d->staging_bytes);
    return (int)pos;
}

static void mooncake_close(struct kv_ctx *ctx)
{
    struct mooncake_data *d = ctx->backend_data;

    if (!d)
        return;
    /* The store client unregisters the buffer when Python closes the session, after this. */
    if (d->staging)
        munmap(d->staging, d->staging_bytes);
    free(d);
    ctx->backend_data = NULL;
}

const struct kv_backend_ops kv_mooncake_ops = {
    .version = KV_OPS_VERSION,
    .name = "mooncake",
    .open = mooncake_open,
    .prepare = mooncake_prepare,
    .access = mooncake_access,
    .describe = mooncake_describe,
    .close = mooncake_close,
};
