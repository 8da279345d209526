/*
 * xfer.h - the transfer engine's worker pool: W workers, each pinned to one
 * CPU, that run one job together, as a GPU's copy engines split a step's
 * transfers. Internal to the backends.
 *
 * The calling thread is worker 0 and takes its share of every job; workers
 * 1 .. W-1 are threads the pool starts. Between jobs they spin for about
 * 100 us (back-to-back batches of one replay find them awake) and then sleep
 * on a futex, so an idle pool costs no CPU.
 */
#ifndef KVEMU_XFER_H
#define KVEMU_XFER_H

#include <sched.h>
#include <stdint.h>

#include "backend.h"

#define XFER_MAX_WORKERS 256u

struct xfer_pool;

/* fn(arg, worker, n_active) runs once per active worker; worker 0 is the caller. */
typedef void (*xfer_fn)(void *arg, uint32_t worker, uint32_t n_active);

/*
 * Starts a pool of n workers (2 .. XFER_MAX_WORKERS) on the CPUs of `cpus`
 * (worker k on the k-th CPU of the set, round-robin when n exceeds it). When
 * the calling thread may run on more than one CPU, it is pinned to the first
 * while the pool runs; a caller already pinned to one CPU of the set keeps
 * it, and the helpers take the others. The affinity the caller had before the
 * first pool pinned it is put back, exactly, when the last pool that pinned
 * it (or kept its pinning) stops, in whatever order pools stop and from
 * whichever thread. Returns 0 or -errno after kv_fail(ctx, ...) naming `who`.
 */
int xfer_pool_start(struct kv_ctx *ctx, const char *who, uint32_t n, const cpu_set_t *cpus,
                    struct xfer_pool **out) KV_INTERNAL;

/* Runs fn on workers 0 .. n_active-1 (1 <= n_active <= n) and returns when all are done. */
void xfer_pool_run(struct xfer_pool *p, xfer_fn fn, void *arg, uint32_t n_active) KV_INTERNAL;

/*
 * The calling thread's CPU affinity as its own code set it: what it was before a pool pinned it,
 * else its affinity now. 0 or -errno.
 */
int xfer_caller_cpus(cpu_set_t *out) KV_INTERNAL;

/* The CPU worker k is pinned to; -1 for no such worker. */
int xfer_pool_cpu(const struct xfer_pool *p, uint32_t k) KV_INTERNAL;

/* Stops and joins the helpers; the last pool on a pinned caller restores its affinity. NULL-safe. */
void xfer_pool_stop(struct xfer_pool *p) KV_INTERNAL;

#endif /* KVEMU_XFER_H */
