/*
 * xfer.c - the transfer engine's worker pool (see xfer.h).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "xfer.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define XFER_PAUSE() _mm_pause()
#else
#define XFER_PAUSE() ((void)0)
#endif

/* How long an idle helper spins before it sleeps: covers the gap between two batches of a replay. */
#define XFER_SPIN_NS 100000ull

struct xfer_pool {
    uint32_t n;
    int *cpu;                   /* per worker; cpu[0] is the caller's */
    pthread_t *threads;         /* helpers 1 .. n-1 */
    uint32_t started;           /* helpers running */
    /*
     * Bumped once per job, helpers wait on it: (sequence << 8) | (n_active - 1). Carrying
     * n_active in the word a helper wakes on means a helper left out of one job never reads
     * the next job's count: the coordinator does not wait for helpers a job leaves out.
     */
    _Atomic uint32_t gen;
    _Atomic uint32_t sleepers;  /* helpers in (or entering) futex_wait on gen */
    _Atomic uint32_t remaining; /* active helpers not yet done with the job */
    _Atomic int stop;
    xfer_fn fn;                 /* stable while any active helper runs: the coordinator waits */
    void *arg;
    struct xfer_pin *pin;       /* the caller's pinning, when this pool pinned it or relies on it */
};

/*
 * A caller the pools pinned: its affinity before the first of them did, and how many pools rely
 * on the pinning. One thread may prepare several backends and close them in any order, from any
 * thread; its affinity is put back, exactly as it was, when the last of those pools stops.
 */
struct xfer_pin {
    struct xfer_pin *next;
    pid_t tid;
    uint32_t pools;
    cpu_set_t saved;
};

static struct xfer_pin *xfer_pins;     /* every pinned caller; under xfer_pins_lock */
static pthread_mutex_t xfer_pins_lock = PTHREAD_MUTEX_INITIALIZER;

struct xfer_helper {
    struct xfer_pool *p;
    uint32_t k;
};

static long xfer_futex(_Atomic uint32_t *addr, int op, uint32_t val)
{
    return syscall(SYS_futex, (uint32_t *)addr, op, val, NULL, NULL, 0);
}

static uint64_t xfer_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void *xfer_helper_main(void *argp)
{
    struct xfer_helper h = *(struct xfer_helper *)argp;
    struct xfer_pool *p = h.p;
    uint32_t seen = 0;          /* gen when the pool started: a job posted before this runs is seen */

    free(argp);
    for (;;) {
        uint32_t g = atomic_load(&p->gen);

        if (g == seen && !atomic_load(&p->stop)) {
            uint64_t t0 = xfer_now_ns();

            for (unsigned i = 1; (g = atomic_load(&p->gen)) == seen && !atomic_load(&p->stop); i++) {
                XFER_PAUSE();
                if ((i & 255u) == 0 && xfer_now_ns() - t0 > XFER_SPIN_NS) {
                    atomic_fetch_add(&p->sleepers, 1);
                    /* Returns at once when gen moved on since it was read: no lost wake-up. */
                    xfer_futex(&p->gen, FUTEX_WAIT_PRIVATE, seen);
                    atomic_fetch_sub(&p->sleepers, 1);
                    t0 = xfer_now_ns();
                }
            }
        }
        if (atomic_load(&p->stop))
            return NULL;
        seen = g;
        if (h.k <= (g & 255u)) {
            p->fn(p->arg, h.k, (g & 255u) + 1);
            atomic_fetch_sub(&p->remaining, 1);
        }
    }
}

static struct xfer_pin *xfer_pin_of(pid_t tid)
{
    struct xfer_pin *pin = xfer_pins;

    while (pin && pin->tid != tid)
        pin = pin->next;
    return pin;
}

int xfer_caller_cpus(cpu_set_t *out)
{
    struct xfer_pin *pin;
    int rc = 0;

    pthread_mutex_lock(&xfer_pins_lock);
    pin = xfer_pin_of(gettid());
    if (pin)
        *out = pin->saved;
    else if (sched_getaffinity(0, sizeof(*out), out) != 0)
        rc = -errno;
    pthread_mutex_unlock(&xfer_pins_lock);
    return rc;
}

/*
 * Makes the caller worker 0 on list[0], moving list[caller] there when the caller already runs on
 * one CPU of the list (numa's pinning, or a pool's), else pinning it to list[0]. Under
 * xfer_pins_lock.
 */
static int xfer_pin_caller(struct kv_ctx *ctx, const char *who, struct xfer_pool *p, int *list,
                           int n_cpus)
{
    struct xfer_pin *pin = xfer_pin_of(gettid()), *made = NULL;
    int caller_cpu = -1, err;
    cpu_set_t mine, one;

    if (sched_getaffinity(0, sizeof(mine), &mine) != 0) {
        err = errno;
        return kv_fail(ctx, -err, "%s: cannot read this thread's CPU affinity: %s", who,
                       strerror(err));
    }
    if (CPU_COUNT(&mine) == 1) {
        for (int i = 0; i < n_cpus; i++)
            if (CPU_ISSET(list[i], &mine))
                caller_cpu = i;
    }
    if (caller_cpu >= 0) {
        int c = list[caller_cpu];

        memmove(list + 1, list, (size_t)caller_cpu * sizeof(int));
        list[0] = c;
    } else {
        if (!pin) {
            made = pin = calloc(1, sizeof(*pin));
            if (!pin)
                return kv_fail(ctx, -ENOMEM, "%s: cannot allocate the worker pool", who);
            pin->tid = gettid();
            pin->saved = mine;
        }
        CPU_ZERO(&one);
        CPU_SET(list[0], &one);
        if (sched_setaffinity(0, sizeof(one), &one) != 0) {
            err = errno;
            free(made);
            return kv_fail(ctx, -err, "%s: cannot pin the replaying thread to CPU %d: %s", who,
                           list[0], strerror(err));
        }
        if (made) {
            made->next = xfer_pins;
            xfer_pins = made;
        }
    }
    if (pin) {  /* pinned now, or by another pool that this one relies on as well */
        pin->pools++;
        p->pin = pin;
    }
    return 0;
}

static void xfer_unpin_caller(struct xfer_pool *p)
{
    struct xfer_pin **at;

    if (!p->pin)
        return;
    pthread_mutex_lock(&xfer_pins_lock);
    if (--p->pin->pools == 0) {
        sched_setaffinity(p->pin->tid, sizeof(p->pin->saved), &p->pin->saved);
        for (at = &xfer_pins; *at != p->pin; at = &(*at)->next)
            ;
        *at = p->pin->next;
        free(p->pin);
    }
    pthread_mutex_unlock(&xfer_pins_lock);
    p->pin = NULL;
}

static int xfer_pick_cpus(const cpu_set_t *cpus, int *list, int max)
{
    int n = 0;

    for (int c = 0; c < CPU_SETSIZE && n < max; c++)
        if (CPU_ISSET(c, cpus))
            list[n++] = c;
    return n;
}

int xfer_pool_start(struct kv_ctx *ctx, const char *who, uint32_t n, const cpu_set_t *cpus,
                    struct xfer_pool **out)
{
    struct xfer_pool *p;
    int list[CPU_SETSIZE], n_cpus, err;

    *out = NULL;
    if (n < 2 || n > XFER_MAX_WORKERS)
        return kv_fail(ctx, -EINVAL, "%s: a worker pool needs 2..%u workers, got %u", who,
                       XFER_MAX_WORKERS, n);
    n_cpus = xfer_pick_cpus(cpus, list, CPU_SETSIZE);
    if (n_cpus == 0)
        return kv_fail(ctx, -EINVAL, "%s: no CPU to run transfer workers on", who);
    p = calloc(1, sizeof(*p));
    if (!p)
        return kv_fail(ctx, -ENOMEM, "%s: cannot allocate the worker pool", who);
    p->n = n;
    p->cpu = calloc(n, sizeof(*p->cpu));
    p->threads = calloc(n, sizeof(*p->threads));
    if (!p->cpu || !p->threads) {
        xfer_pool_stop(p);
        return kv_fail(ctx, -ENOMEM, "%s: cannot allocate the worker pool", who);
    }
    pthread_mutex_lock(&xfer_pins_lock);
    err = xfer_pin_caller(ctx, who, p, list, n_cpus);
    pthread_mutex_unlock(&xfer_pins_lock);
    if (err < 0) {
        xfer_pool_stop(p);
        return err;
    }
    for (uint32_t k = 0; k < n; k++)
        p->cpu[k] = list[k % (uint32_t)n_cpus];
    for (uint32_t k = 1; k < n; k++) {
        struct xfer_helper *h = malloc(sizeof(*h));
        pthread_attr_t attr;
        cpu_set_t one;

        if (!h) {
            xfer_pool_stop(p);
            return kv_fail(ctx, -ENOMEM, "%s: cannot start transfer worker %u", who, k);
        }
        h->p = p;
        h->k = k;
        CPU_ZERO(&one);
        CPU_SET(p->cpu[k], &one);
        pthread_attr_init(&attr);
        pthread_attr_setaffinity_np(&attr, sizeof(one), &one);
        pthread_attr_setstacksize(&attr, 64u << 10);
        err = pthread_create(&p->threads[k], &attr, xfer_helper_main, h);
        pthread_attr_destroy(&attr);
        if (err) {
            free(h);
            xfer_pool_stop(p);
            return kv_fail(ctx, -err, "%s: cannot start transfer worker %u on CPU %d: %s", who, k,
                           p->cpu[k], strerror(err));
        }
        p->started = k;
    }
    *out = p;
    return 0;
}

void xfer_pool_run(struct xfer_pool *p, xfer_fn fn, void *arg, uint32_t n_active)
{
    unsigned spins = 0;

    if (n_active > p->n)
        n_active = p->n;
    if (n_active < 1)
        n_active = 1;
    p->fn = fn;
    p->arg = arg;
    atomic_store(&p->remaining, n_active - 1);
    /* seq_cst: publishes fn and arg with the job's sequence and worker count */
    atomic_store(&p->gen, (((atomic_load(&p->gen) >> 8) + 1) << 8) | (n_active - 1));
    if (n_active > 1 && atomic_load(&p->sleepers))
        xfer_futex(&p->gen, FUTEX_WAKE_PRIVATE, INT_MAX);
    fn(arg, 0, n_active);
    while (atomic_load(&p->remaining) != 0) {
        XFER_PAUSE();
        /* A helper preempted by another process: let the kernel run it. */
        if (++spins % 4096u == 0)
            sched_yield();
    }
}

int xfer_pool_cpu(const struct xfer_pool *p, uint32_t k)
{
    if (!p || k >= p->n)
        return -1;
    return p->cpu[k];
}

void xfer_pool_stop(struct xfer_pool *p)
{
    if (!p)
        return;
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->gen, 1u << 8);
    xfer_futex(&p->gen, FUTEX_WAKE_PRIVATE, INT_MAX);
    for (uint32_t k = 1; k <= p->started; k++)
        pthread_join(p->threads[k], NULL);
    xfer_unpin_caller(p);
    free(p->cpu);
    free(p->threads);
    free(p);
}
