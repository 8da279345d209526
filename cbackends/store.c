/*
 * store.c - the C bridge of every store kind (kvemu/stores/: Mooncake Store,
 * a file per object, ...): a tier whose objects a store that Python drives
 * keeps by key, put from and got into kvemu's staging buffer.
 *
 * This backend owns only the host side of the tier: the staging buffer (the
 * HBM stand-in) that the store reads and writes. Each access hook call is one
 * batch of the core (one op, one replayed layer, at most KV_BATCH transfers);
 * it is handed to Python in one callback (kv_py_store_access, an extern
 * "Python+C" function of build_ffi.py), which builds the keys and makes one
 * batch call of the store (kvemu.stores.StoreSession.access: put_from for
 * stores, get_into for loads). The time of that call, measured by the callback
 * around the store's call only, is the batch's busy time and every access's
 * latency (all are issued together and complete by its end). Python thus runs
 * once per batch, never once per access.
 *
 * Options (from kvemu/backends.py, not the user): session=N, the key of the
 * store session in its table of sessions; kind=NAME, the store kind the
 * messages name (mooncake, files).
 *
 * Caveats:
 *  - The arena is the store's (its segment, its files); arena_host stays NULL:
 *    only the store reads and writes it, with its own allocation and rules.
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
int kv_py_store_prepare(uint64_t session, uint64_t staging_addr, uint64_t staging_bytes,
                        uint64_t arena_bytes) __attribute__((weak));
int kv_py_store_access(uint64_t session, int op, const struct kv_access *acc, uint32_t n,
                       uint64_t *lat_ns, uint64_t *busy_ns) __attribute__((weak));

struct store_data {
    uint64_t session;
    char kind[32];
    uint8_t *staging;
    uint64_t staging_bytes, arena_bytes;
};

static const struct kv_opt_key store_keys[] = {
    { "session", "N" },
    { "kind", "NAME" },
    { NULL, NULL },
};

static int store_kind(struct kv_ctx *ctx, const struct kv_opt *o, struct store_data *d)
{
    if (o->val_len == 0 || o->val_len >= sizeof(d->kind))
        return kv_fail(ctx, -EINVAL, "store: option kind is '%.*s', must be a name of 1 to %zu characters",
                       (int)(o->val_len > 64 ? 64 : o->val_len), o->val, sizeof(d->kind) - 1);
    for (size_t i = 0; i < o->val_len; i++) {
        char c = o->val[i];

        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
            return kv_fail(ctx, -EINVAL, "store: option kind is '%.*s', must be [a-z0-9_-]",
                           (int)(o->val_len > 64 ? 64 : o->val_len), o->val);
    }
    memcpy(d->kind, o->val, o->val_len);
    d->kind[o->val_len] = '\0';
    return 0;
}

static int store_open(struct kv_ctx *ctx, const char *args)
{
    struct store_data *d;
    struct kv_opts opts;
    struct kv_opt o;
    int rc, have = 0;

    if (!kv_py_store_prepare || !kv_py_store_access)
        return kv_fail(ctx, -ENOSYS, "store: this build has no store callbacks (it runs through kvemu.backends)");
    d = calloc(1, sizeof(*d));
    if (!d)
        return kv_fail(ctx, -ENOMEM, "store: out of memory");
    strcpy(d->kind, "store");
    kv_opts_init(&opts, ctx, "store", args, store_keys, NULL);
    rc = 0;
    while (rc == 0 && (rc = kv_opts_next(&opts, &o)) > 0) {
        if (kv_opt_is(&o, "session")) {
            rc = kv_opt_u64(ctx, &o, 1, UINT64_MAX, &d->session);
            have = 1;
        } else {
            rc = store_kind(ctx, &o, d);
        }
    }
    if (rc == 0 && !have)
        rc = kv_fail(ctx, -EINVAL, "%s: opened without a store session (open it through kvemu.backends.Backend)",
                     d->kind);
    if (rc < 0) {
        free(d);
        return rc;
    }
    ctx->backend_data = d;
    return 0;
}

static int store_prepare(struct kv_ctx *ctx, uint64_t arena_bytes, uint64_t staging_bytes)
{
    struct store_data *d = ctx->backend_data;
    void *p;
    int rc;

    if (arena_bytes == 0 || staging_bytes == 0)
        return kv_fail(ctx, -EINVAL, "%s: refusing an empty arena", d->kind);
    p = mmap(NULL, staging_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED)
        return kv_fail(ctx, -errno, "%s: cannot map %" PRIu64 " bytes of staging: %s", d->kind, staging_bytes,
                       strerror(errno));
    /* Non-zero, so that a load that moved nothing shows in a checksum. */
    memset(p, 0x5a, staging_bytes);
    rc = kv_py_store_prepare(d->session, (uint64_t)(uintptr_t)p, staging_bytes, arena_bytes);
    if (rc < 0) {
        munmap(p, staging_bytes);
        return kv_fail(ctx, rc, "%s: the store could not take %" PRIu64
                       " bytes of objects or register the staging buffer (see the error raised)", d->kind, arena_bytes);
    }
    d->staging = p;
    d->staging_bytes = staging_bytes;
    d->arena_bytes = arena_bytes;
    ctx->staging_host = p;
    return 0;
}

static int store_access(struct kv_ctx *ctx, int op, const struct kv_access *acc, uint32_t n,
                        uint64_t *lat_ns, uint64_t *busy_ns)
{
    struct store_data *d = ctx->backend_data;
    int rc;

    if (op == KV_OP_READ)
        return kv_fail(ctx, -EINVAL, "%s: a store is read by a get into HBM, not in place: "
                       "use --tier-policy offload, not resident", d->kind);
    rc = kv_py_store_access(d->session, op, acc, n, lat_ns, busy_ns);
    if (rc < 0)
        return kv_fail(ctx, rc, "%s: a batch %s failed (see the error raised)", d->kind,
                       op == KV_OP_LOAD ? "get" : "put");
    return rc;
}

static int store_describe(struct kv_ctx *ctx, char *buf, size_t len)
{
    const struct store_data *d = ctx->backend_data;
    size_t pos = 0;

    kv_appendf(buf, len, &pos, ",\"store_session\":%" PRIu64 ",\"staging_bytes\":%" PRIu64
               ",\"arena_host_addressable\":false", d->session, d->staging_bytes);
    return (int)pos;
}

static void store_close(struct kv_ctx *ctx)
{
    struct store_data *d = ctx->backend_data;

    if (!d)
        return;
    /* The store releases the buffer when Python closes the session, before this. */
    if (d->staging)
        munmap(d->staging, d->staging_bytes);
    free(d);
    ctx->backend_data = NULL;
}

const struct kv_backend_ops kv_store_ops = {
    .version = KV_OPS_VERSION,
    .name = "store",
    .open = store_open,
    .prepare = store_prepare,
    .access = store_access,
    .describe = store_describe,
    .close = store_close,
};
