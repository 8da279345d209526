/*
 * uring.c - a tier reached by block I/O: local NVMe, NVMe-oF, any storage a KV
 * cache offloads to through a file or block device (LMCache's local disk
 * backend, Mooncake's SSD tier). The arena is a region of a file (or block
 * device) read and written with io_uring and O_DIRECT; the staging buffer (the
 * HBM stand-in) is host memory.
 *
 * Measures, per block-layer access, the time from submitting its SQE (the
 * io_uring_enter call that hands it to the kernel) to reaping its CQE:
 * load = O_DIRECT read of the block into its staging slot, store = O_DIRECT
 * write from it, read = O_DIRECT read into a scratch buffer whose contents are
 * discarded (storage cannot be read in place: a read is an I/O). Up to qd
 * accesses are in flight together; busy_ns is the time at least one of the
 * batch's accesses was in flight (first submit to last completion unless the
 * queue drained in between), so at qd=1 it equals the sum of the latencies.
 *
 * Caveats:
 *  - The device. On the development VM the file lives on a virtio disk, not
 *    NVMe, and the hypervisor may cache the disk image: figures there stand
 *    for "storage reached by I/O" in general, not for any NVMe drive.
 *  - Queue depth is per replay thread and per batch of at most KV_BATCH
 *    accesses of one op and one layer: qd=32 with a 4-block layer keeps 4 in
 *    flight. Between batches the queue drains. A serving engine with several
 *    transfer threads keeps more in flight.
 *  - O_DIRECT needs offsets, sizes and buffer addresses aligned to the file's
 *    direct-I/O alignment (statx STATX_DIOALIGN, BLKSSZGET for block devices,
 *    else 512): block_bytes must be a multiple of it. prepare checks the arena
 *    and staging sizes (it cannot see block_bytes); access checks every
 *    access before any is submitted.
 *  - The page cache. O_DIRECT bypasses it on ext4, xfs and block devices, but
 *    some filesystems fall back to buffered I/O (tmpfs's O_DIRECT is a no-op
 *    since Linux 6.6; ext4 with data=journal; some network filesystems).
 *    tmpfs and ramfs are refused outright; elsewhere prepare drops the
 *    region's cached pages, reads the start of it through the ring and checks
 *    with mincore() that no page became resident, and refuses otherwise.
 *    Caches below the page cache (a hypervisor's, ZFS's ARC, a drive's DRAM)
 *    cannot be seen from here.
 *  - Interrupt-driven completions: no IOPOLL (not supported by virtio-blk),
 *    no SQPOLL (it would take a CPU of its own); each wait is a system call,
 *    timed out after KV_CANCEL_POLL_NS to poll for kv_cancel (kernels with
 *    IORING_FEAT_EXT_ARG, 5.11 on). A cancel stops submissions and waits for
 *    what the kernel holds, as a failure does; fdatasync is not interrupted.
 *  - prepare writes the whole arena region once (reads of never-written or
 *    fallocated blocks can skip the device), which takes arena / write
 *    bandwidth. With size=existing, the first arena bytes of the file or
 *    device are overwritten: by that pre-write and by every store.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <linux/fs.h>
#include <linux/io_uring.h>
#include <linux/magic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "backend.h"

#define URING_QD_DEFAULT 32u
/* SQEs per io_uring_enter: one, as fio's iodepth_batch_submit default (see uring_run). */
#define URING_BATCH_DEFAULT 1u
#define URING_QD_MAX 4096u
/* One SQE moves at most this much; longer accesses continue as short I/O would. */
#define URING_SQE_MAX_BYTES (1u << 30)
/* The pre-write moves the arena in chunks this size (or the staging size, if smaller). */
#define URING_PREWRITE_CHUNK_BYTES (4ull << 20)
/* How much of the region the page-cache check reads and inspects. */
#define URING_PROBE_BYTES (1ull << 20)
/* -EAGAIN / -EINTR completions resubmitted before an access is declared failed. */
#define URING_MAX_RETRIES 1000u
/* O_DIRECT alignment assumed when neither statx nor the block device reports one. */
#define URING_DEFAULT_ALIGN 512u

#ifndef RAMFS_MAGIC
#define RAMFS_MAGIC 0x858458f6
#endif
#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif

enum uring_size_mode { URING_CREATE = 0, URING_EXISTING = 1 };

struct uring_ring {
    int fd;
    uint32_t features;          /* io_uring_params.features */
    uint32_t sq_entries, cq_entries;
    void *sq_map, *cq_map;      /* equal with IORING_FEAT_SINGLE_MMAP */
    size_t sq_map_bytes, cq_map_bytes;
    struct io_uring_sqe *sqes;
    size_t sqes_bytes;
    unsigned *sq_head, *sq_tail, *sq_array, sq_mask;
    unsigned *cq_head, *cq_tail, cq_mask;
    struct io_uring_cqe *cqes;
    unsigned sq_tail_local;     /* SQEs written so far; published to *sq_tail before each enter */
};

/* One I/O in flight: a block-layer access, or a chunk of the pre-write or the probe. */
struct uring_job {
    uint64_t off;               /* file offset of the next byte to move */
    uint8_t *buf;               /* memory of the next byte */
    uint8_t *start;             /* memory of the first byte */
    uint64_t left;              /* bytes still to move */
    uint64_t t_submit;          /* ticks when first submitted */
    uint32_t retries;
    int buf_index;              /* registered buffer holding buf, or -1 */
};

struct uring_data {
    /* options */
    char *path;
    uint32_t qd;
    uint32_t batch;             /* SQEs handed to the kernel per io_uring_enter */
    int size_mode;
    int register_requested;
    int keep;

    struct uring_ring ring;
    int broken;                 /* a failed io_uring_enter left I/O in an unknown state */

    /* prepared file */
    int fd;
    int created;                /* we created path; close unlinks it unless keep */
    dev_t dev;
    ino_t ino;
    int is_blkdev;
    uint64_t file_bytes;        /* size of the file or device after prepare */
    uint64_t region_bytes;      /* the arena: [0, region_bytes) of the file */
    uint32_t offset_align, mem_align;
    const char *align_source;   /* "statx", "BLKSSZGET" or "default" */
    uint64_t prewritten_bytes;
    double prewrite_s;

    /* host memory: staging (the HBM stand-in) then scratch (destination of reads) */
    uint8_t *mem;
    size_t mem_bytes;
    uint8_t *staging, *scratch;
    uint64_t staging_bytes, scratch_bytes;

    int buffers_registered, files_registered;
    int register_buffers_errno, register_files_errno;

    /* page-cache check */
    const char *page_cache_check;   /* "mincore", "inconclusive", "unavailable" */
    uint64_t probe_pages, probe_resident_before, probe_resident_after;

    struct uring_job jobs[KV_BATCH];
    uint32_t retry[KV_BATCH];
    uint32_t sq_job[KV_BATCH];  /* job of each SQE written, by sq_tail_local % KV_BATCH */
    uint64_t lat_scratch[KV_BATCH];
};

/* ------------------------------------------------------------------ rings */

static int uring_setup_sys(unsigned entries, struct io_uring_params *p)
{
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int uring_enter_sys(int fd, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

/*
 * Sleeps until a completion is waiting, but no longer than KV_CANCEL_POLL_NS
 * (then -1 with errno ETIME), so that the loop can poll for a cancel. Kernels
 * without IORING_FEAT_EXT_ARG (before 5.11) have no timed wait: it blocks
 * until the device completes something.
 */
static int uring_wait_sys(const struct uring_ring *r)
{
    if (r->features & IORING_FEAT_EXT_ARG) {
        struct __kernel_timespec ts = { .tv_sec = 0, .tv_nsec = (long long)KV_CANCEL_POLL_NS };
        struct io_uring_getevents_arg arg = { .ts = (uint64_t)(uintptr_t)&ts };

        return (int)syscall(__NR_io_uring_enter, r->fd, 0, 1,
                            IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG, &arg, sizeof(arg));
    }
    return uring_enter_sys(r->fd, 0, 1, IORING_ENTER_GETEVENTS);
}

static int uring_register_sys(int fd, unsigned opcode, const void *arg, unsigned nr_args)
{
    return (int)syscall(__NR_io_uring_register, fd, opcode, arg, nr_args);
}

/* The io_uring_disabled sysctl (0 on, 1 for io_uring_group only, 2 off), -1 when unreadable. */
static int uring_disabled_sysctl(void)
{
    FILE *f = fopen("/proc/sys/kernel/io_uring_disabled", "r");
    int v = -1;

    if (f) {
        if (fscanf(f, "%d", &v) != 1)
            v = -1;
        fclose(f);
    }
    return v;
}

static void uring_ring_unmap(struct uring_ring *r)
{
    if (r->sqes)
        munmap(r->sqes, r->sqes_bytes);
    if (r->cq_map && r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_map_bytes);
    if (r->sq_map)
        munmap(r->sq_map, r->sq_map_bytes);
    if (r->fd >= 0)
        close(r->fd);
    memset(r, 0, sizeof(*r));
    r->fd = -1;
}

static void *uring_map_ring(int fd, size_t bytes, uint64_t offset)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                   (off_t)offset);

    return p == MAP_FAILED ? NULL : p;
}

static int uring_ring_init(struct kv_ctx *ctx, struct uring_ring *r, unsigned entries)
{
    struct io_uring_params p;
    int err, fd;

    memset(r, 0, sizeof(*r));
    r->fd = -1;
    memset(&p, 0, sizeof(p));
    fd = uring_setup_sys(entries, &p);
    if (fd < 0) {
        err = errno;
        if (err == ENOSYS || err == EPERM) {
            int disabled = uring_disabled_sysctl();

            return kv_fail(ctx, -err,
                           "uring: io_uring unavailable: io_uring_setup failed: %s "
                           "(kernel.io_uring_disabled=%d; seccomp or a container may block it)",
                           strerror(err), disabled);
        }
        return kv_fail(ctx, -err, "uring: io_uring_setup(%u entries) failed: %s", entries,
                       strerror(err));
    }
    r->fd = fd;
    r->features = p.features;
    r->sq_entries = p.sq_entries;
    r->cq_entries = p.cq_entries;
    r->sq_map_bytes = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_bytes = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_map_bytes > r->sq_map_bytes)
            r->sq_map_bytes = r->cq_map_bytes;
        r->cq_map_bytes = r->sq_map_bytes;
    }
    r->sq_map = uring_map_ring(fd, r->sq_map_bytes, IORING_OFF_SQ_RING);
    if (!r->sq_map)
        goto map_failed;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_map = r->sq_map;
    } else {
        r->cq_map = uring_map_ring(fd, r->cq_map_bytes, IORING_OFF_CQ_RING);
        if (!r->cq_map)
            goto map_failed;
    }
    r->sqes_bytes = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = uring_map_ring(fd, r->sqes_bytes, IORING_OFF_SQES);
    if (!r->sqes)
        goto map_failed;

    r->sq_head = (unsigned *)((char *)r->sq_map + p.sq_off.head);
    r->sq_tail = (unsigned *)((char *)r->sq_map + p.sq_off.tail);
    r->sq_mask = *(unsigned *)((char *)r->sq_map + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)((char *)r->sq_map + p.sq_off.array);
    r->cq_head = (unsigned *)((char *)r->cq_map + p.cq_off.head);
    r->cq_tail = (unsigned *)((char *)r->cq_map + p.cq_off.tail);
    r->cq_mask = *(unsigned *)((char *)r->cq_map + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)((char *)r->cq_map + p.cq_off.cqes);
    /* SQEs are used in ring order, so the indirection array is the identity, set once. */
    for (unsigned i = 0; i < p.sq_entries; i++)
        r->sq_array[i] = i;
    r->sq_tail_local = *r->sq_tail;
    return 0;

map_failed:
    err = errno;
    uring_ring_unmap(r);
    return kv_fail(ctx, -err, "uring: cannot map the io_uring rings: %s", strerror(err));
}

/* --------------------------------------------------------------- options */

/* The qd and batch syntax names their range: URING_QD_MAX, written out for the message. */
_Static_assert(URING_QD_MAX == 4096u, "update uring_keys");
static const struct kv_opt_key uring_keys[] = {
    { "qd", "1..4096" },
    { "batch", "1..4096" },
    { "size", "create|existing" },
    { "register", "0|1" },
    { "keep", "0|1" },
    { NULL, NULL },
};

#define URING_USAGE \
    "uring:PATH[,qd=N][,batch=N][,size=create|existing][,register=0|1][,keep=0|1]"

static int uring_parse(struct kv_ctx *ctx, struct uring_data *d, const char *args)
{
    const char *rest;
    size_t n = kv_opt_positional(args, &rest);
    struct kv_opts opts;
    struct kv_opt o;
    int rc;

    if (n == 0)
        return kv_fail(ctx, -EINVAL, "uring: needs a file or block device path: " URING_USAGE);
    if (n >= PATH_MAX)
        return kv_fail(ctx, -EINVAL, "uring: path of %zu bytes is too long", n);
    d->path = strndup(args, n);
    if (!d->path)
        return kv_fail(ctx, -ENOMEM, "uring: cannot allocate the path");
    d->qd = URING_QD_DEFAULT;
    d->batch = URING_BATCH_DEFAULT;
    d->size_mode = URING_CREATE;
    d->register_requested = 1;
    d->keep = 0;

    kv_opts_init(&opts, ctx, "uring", rest, uring_keys, NULL);
    rc = 0;
    while (rc == 0 && (rc = kv_opts_next(&opts, &o)) > 0) {
        uint64_t v;
        int choice;

        if (kv_opt_is(&o, "qd") || kv_opt_is(&o, "batch")) {
            rc = kv_opt_u64(ctx, &o, 1, URING_QD_MAX, &v);
            if (rc == 0)
                *(kv_opt_is(&o, "qd") ? &d->qd : &d->batch) = (uint32_t)v;
        } else if (kv_opt_is(&o, "size")) {
            rc = kv_opt_choice(ctx, &o, &choice);
            if (rc == 0)
                d->size_mode = choice ? URING_EXISTING : URING_CREATE;
        } else if (kv_opt_is(&o, "register")) {
            rc = kv_opt_bool(ctx, &o, &d->register_requested);
        } else {
            rc = kv_opt_bool(ctx, &o, &d->keep);
        }
    }
    if (rc < 0)
        return rc;
    if (d->batch > d->qd)
        d->batch = d->qd;
    return 0;
}

/* Checks the path against the size mode now, so a wrong spec fails before any arena is sized. */
static int uring_check_path(struct kv_ctx *ctx, const struct uring_data *d)
{
    struct stat st;

    if (d->size_mode == URING_EXISTING) {
        if (stat(d->path, &st) < 0) {
            int err = errno;

            return kv_fail(ctx, -err, "uring: %s: %s (size=existing needs an existing file or "
                           "block device)", d->path, strerror(err));
        }
        if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode))
            return kv_fail(ctx, -EINVAL, "uring: %s is neither a regular file nor a block device",
                           d->path);
        return 0;
    }
    if (lstat(d->path, &st) == 0)
        return kv_fail(ctx, -EEXIST,
                       "uring: %s exists; refusing to overwrite it (a replay that was killed "
                       "leaves its tier file behind: remove that file, or pass size=existing to "
                       "replay on an existing file or block device, overwriting its first arena "
                       "bytes)", d->path);
    if (errno != ENOENT) {
        int err = errno;

        return kv_fail(ctx, -err, "uring: cannot use %s: %s", d->path, strerror(err));
    }
    {
        /* The file is created at prepare; a missing directory is a configuration error now. */
        char *dir = strdup(d->path), *slash;
        int rc = 0;

        if (!dir)
            return kv_fail(ctx, -ENOMEM, "uring: cannot allocate the path");
        slash = strrchr(dir, '/');
        if (slash) {
            if (slash == dir)
                slash[1] = '\0';
            else
                *slash = '\0';
            if (stat(dir, &st) < 0 || !S_ISDIR(st.st_mode))
                rc = kv_fail(ctx, -ENOENT, "uring: directory %s of %s does not exist", dir,
                             d->path);
        }
        free(dir);
        return rc;
    }
}

static void uring_free(struct uring_data *d)
{
    free(d->path);
    free(d);
}

static int uring_open(struct kv_ctx *ctx, const char *args)
{
    struct uring_data *d = calloc(1, sizeof(*d));
    int rc;

    if (!d)
        return kv_fail(ctx, -ENOMEM, "uring: cannot allocate backend state");
    d->fd = -1;
    d->ring.fd = -1;
    rc = uring_parse(ctx, d, args);
    if (rc == 0)
        rc = uring_check_path(ctx, d);
    /* The ring is set up now so that a kernel without io_uring is reported before prepare. */
    if (rc == 0)
        rc = uring_ring_init(ctx, &d->ring, d->qd);
    if (rc < 0) {
        uring_free(d);
        return rc;
    }
    d->page_cache_check = "unavailable";
    d->align_source = "default";
    ctx->backend_data = d;
    return 0;
}

/* ------------------------------------------------------------ the I/O loop */

static const char *uring_op_verb(int is_write)
{
    return is_write ? "write" : "read";
}

static void uring_prep(struct uring_data *d, int is_write, const struct uring_job *j, uint32_t k)
{
    struct uring_ring *r = &d->ring;
    struct io_uring_sqe *sqe = &r->sqes[r->sq_tail_local & r->sq_mask];
    uint64_t len = j->left < URING_SQE_MAX_BYTES ? j->left : URING_SQE_MAX_BYTES;

    memset(sqe, 0, sizeof(*sqe));
    if (j->buf_index >= 0) {
        sqe->opcode = is_write ? IORING_OP_WRITE_FIXED : IORING_OP_READ_FIXED;
        sqe->buf_index = (uint16_t)j->buf_index;
    } else {
        sqe->opcode = is_write ? IORING_OP_WRITE : IORING_OP_READ;
    }
    if (d->files_registered) {
        sqe->fd = 0;
        sqe->flags = IOSQE_FIXED_FILE;
    } else {
        sqe->fd = d->fd;
    }
    sqe->off = j->off;
    sqe->addr = (uint64_t)(uintptr_t)j->buf;
    sqe->len = (uint32_t)len;
    sqe->user_data = k;
    d->sq_job[r->sq_tail_local % KV_BATCH] = k;
    r->sq_tail_local++;
}

/* SQEs written but not yet taken by the kernel. */
static uint32_t uring_sq_pending(const struct uring_ring *r)
{
    return r->sq_tail_local - __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
}

/* What is in flight may still complete into our buffers: the ring is not used again. */
static int uring_enter_failed(struct kv_ctx *ctx, struct uring_data *d, const char *what)
{
    int e = errno;

    d->broken = 1;
    return kv_fail(ctx, -e, "uring: %s: io_uring_enter failed: %s", what, strerror(e));
}

static int uring_enter_retryable(int ret)
{
    return ret >= 0 || errno == EINTR || errno == EAGAIN || errno == EBUSY || errno == ETIME;
}

/*
 * Performs jobs[0..n) (all reads or all writes), up to qd in flight, writing
 * each job's latency (first submit to final completion) into lat_ns and the
 * time at least one was in flight into *busy_ns. Short transfers and
 * -EAGAIN/-EINTR are resubmitted for the rest, keeping the first submit time;
 * the first other failure stops new submissions, waits for what the kernel
 * holds, and is returned.
 *
 * The loop is fio's default one: SQEs go to the kernel d->batch per
 * io_uring_enter (1 unless batch= says otherwise), each stamped just before its
 * own call, and the loop sleeps (enter with min_complete 1) only when no
 * completion is waiting in the CQ ring. Handing a burst of SQEs over in one
 * call was measured 20-25 % slower at 4 KiB QD32 on the development VM
 * (docs/performance.md): the device starts on the first one later.
 */
static int uring_run(struct kv_ctx *ctx, struct uring_data *d, const char *what, int is_write,
                     struct uring_job *jobs, uint32_t n, uint64_t *lat_ns, uint64_t *busy_ns)
{
    const struct kv_timer *t = &ctx->timer;
    struct uring_ring *r = &d->ring;
    uint32_t next = 0, done = 0, in_kernel = 0, outstanding = 0, n_retry = 0;
    uint64_t busy_ticks = 0, busy_start = 0;
    int err = 0;

    if (d->broken)
        return kv_fail(ctx, -EIO, "uring: the ring is unusable after an earlier failure");
    *busy_ns = 0;
    for (;;) {
        uint32_t queued;
        unsigned head, tail;
        uint64_t t1;
        int ret;

        /* A cancel is an error like any other: nothing new goes out, what is in flight drains. */
        if (!err && kv_cancelled(ctx))
            err = kv_cancelled_fail(ctx, "uring");
        if (!err) {
            while (n_retry && in_kernel + uring_sq_pending(r) < d->qd) {
                uint32_t k = d->retry[--n_retry];

                uring_prep(d, is_write, &jobs[k], k);
            }
            while (next < n && in_kernel + uring_sq_pending(r) < d->qd) {
                jobs[next].t_submit = 0;
                uring_prep(d, is_write, &jobs[next], next);
                next++;
            }
        }
        queued = uring_sq_pending(r);
        if (err ? in_kernel == 0 && queued == 0 : done == n)
            break;
        if (queued == 0 && in_kernel == 0)
            return kv_fail(ctx, -EIO, "uring: %s: nothing in flight with %u of %u done",
                           what, done, n);
        if (queued)
            __atomic_store_n(r->sq_tail, r->sq_tail_local, __ATOMIC_RELEASE);
        while (queued) {
            uint32_t chunk = queued < d->batch ? queued : d->batch, left;
            unsigned first = r->sq_tail_local - queued;
            uint64_t t0 = kv_timer_ticks(t);

            for (uint32_t c = 0; c < chunk; c++) {
                struct uring_job *j = &jobs[d->sq_job[(first + c) % KV_BATCH]];

                if (j->t_submit == 0) {     /* a first submission, not a resubmission */
                    j->t_submit = t0;
                    if (outstanding++ == 0)
                        busy_start = t0;
                }
            }
            ret = uring_enter_sys(r->fd, chunk, 0, IORING_ENTER_GETEVENTS);
            if (!uring_enter_retryable(ret))
                return uring_enter_failed(ctx, d, what);
            /* The kernel's SQ head says how many it took, whatever enter returned. */
            left = uring_sq_pending(r);
            in_kernel += queued - left;
            if (left == queued)
                break;                      /* the kernel is full for now: reap first */
            queued = left;
        }
        /* Sleep only when nothing has completed yet. */
        if (in_kernel && *r->cq_head == __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) {
            ret = uring_wait_sys(r);
            if (!uring_enter_retryable(ret))
                return uring_enter_failed(ctx, d, what);
        }
        t1 = kv_timer_ticks(t);

        head = *r->cq_head;
        tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            const struct io_uring_cqe *cqe = &r->cqes[head & r->cq_mask];
            uint64_t k = cqe->user_data;
            int32_t res = cqe->res;
            struct uring_job *j;

            if (in_kernel)
                in_kernel--;
            if (k >= n) {
                if (!err)
                    err = kv_fail(ctx, -EIO, "uring: %s: completion for unknown I/O %" PRIu64,
                                  what, k);
                continue;
            }
            j = &jobs[k];
            if (res > 0 && (uint64_t)res < j->left) {
                /* Short transfer: the rest goes out again. */
                j->off += (uint64_t)res;
                j->buf += res;
                j->left -= (uint64_t)res;
                d->retry[n_retry++] = (uint32_t)k;
                continue;
            }
            if ((res == -EAGAIN || res == -EINTR) && ++j->retries <= URING_MAX_RETRIES) {
                d->retry[n_retry++] = (uint32_t)k;
                continue;
            }
            if (res == 0 && !err)
                err = kv_fail(ctx, -EIO,
                              "uring: %s: %s of %" PRIu64 " bytes at offset %" PRIu64
                              " of %s moved nothing (end of file?)", what,
                              uring_op_verb(is_write), j->left, j->off, d->path);
            else if (res < 0 && !err)
                err = kv_fail(ctx, res,
                              "uring: %s: %s of %" PRIu64 " bytes at offset %" PRIu64
                              " of %s failed: %s", what, uring_op_verb(is_write), j->left,
                              j->off, d->path, strerror(-res));
            else if (res > 0)
                j->left = 0;
            lat_ns[k] = kv_timer_ns(t, t1 - j->t_submit);
            done++;
            if (--outstanding == 0)
                busy_ticks += t1 - busy_start;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    if (err < 0)
        return err;
    *busy_ns = kv_timer_ns(t, busy_ticks);
    return (int)n;
}

/* Moves [off, off + bytes) of the file from or to buf in chunks, up to qd at a time. */
static int uring_span(struct kv_ctx *ctx, struct uring_data *d, const char *what, int is_write,
                      uint64_t off, uint64_t bytes, uint8_t *buf, uint64_t buf_bytes,
                      int buf_index)
{
    uint64_t busy;

    while (bytes) {
        uint32_t n = 0;
        int rc;

        while (bytes && n < KV_BATCH) {
            uint64_t len = bytes < buf_bytes ? bytes : buf_bytes;
            struct uring_job *j = &d->jobs[n++];

            j->off = off;
            j->buf = j->start = buf;
            j->left = len;
            j->retries = 0;
            j->buf_index = buf_index;
            off += len;
            bytes -= len;
        }
        rc = uring_run(ctx, d, what, is_write, d->jobs, n, d->lat_scratch, &busy);
        if (rc < 0)
            return rc;
    }
    return 0;
}

/* ------------------------------------------------------------ preparation */

/* Undoes prepare; a file we created goes unless keep asks otherwise (or discard overrides). */
static void uring_release_file(struct uring_data *d, int discard)
{
    struct uring_ring *r = &d->ring;

    if (d->files_registered)
        uring_register_sys(r->fd, IORING_UNREGISTER_FILES, NULL, 0);
    if (d->buffers_registered)
        uring_register_sys(r->fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
    d->files_registered = d->buffers_registered = 0;
    if (d->mem)
        munmap(d->mem, d->mem_bytes);
    d->mem = d->staging = d->scratch = NULL;
    d->mem_bytes = 0;
    if (d->fd >= 0) {
        struct stat st;

        /* Unlink only the file we created, not one that has replaced it since. */
        if (d->created && (discard || !d->keep) && stat(d->path, &st) == 0 && st.st_dev == d->dev &&
            st.st_ino == d->ino)
            unlink(d->path);
        close(d->fd);
    }
    d->fd = -1;
    d->created = 0;
}

/* Opens (creating when asked) the file with O_DIRECT; sets fd, created, dev/ino, is_blkdev. */
static int uring_open_file(struct kv_ctx *ctx, struct uring_data *d)
{
    struct stat st;
    int fd, err, flags;

    if (d->size_mode == URING_CREATE) {
        /*
         * Created without O_DIRECT and switched to it after: an open that
         * refuses O_DIRECT would otherwise leave an empty file behind.
         */
        fd = open(d->path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0) {
            err = errno;
            if (err == EEXIST)
                return kv_fail(ctx, -EEXIST, "uring: %s exists; refusing to overwrite it (a "
                               "replay that was killed leaves its tier file behind: remove that "
                               "file, or pass size=existing to replay on it)", d->path);
            return kv_fail(ctx, -err, "uring: cannot create %s: %s", d->path, strerror(err));
        }
        d->fd = fd;
        d->created = 1;
        if (fstat(fd, &st) == 0) {
            d->dev = st.st_dev;
            d->ino = st.st_ino;
        }
        flags = fcntl(fd, F_GETFL);
        if (flags < 0 || fcntl(fd, F_SETFL, flags | O_DIRECT) < 0) {
            err = errno;
            if (err == EINVAL)
                return kv_fail(ctx, -EOPNOTSUPP, "uring: %s's filesystem does not support "
                               "O_DIRECT (tmpfs?)", d->path);
            return kv_fail(ctx, -err, "uring: cannot set O_DIRECT on %s: %s", d->path,
                           strerror(err));
        }
    } else {
        if (stat(d->path, &st) < 0) {
            err = errno;
            return kv_fail(ctx, -err, "uring: %s: %s", d->path, strerror(err));
        }
        /* O_EXCL on a block device: refused (EBUSY) while it is mounted or otherwise claimed. */
        fd = open(d->path, O_RDWR | O_DIRECT | O_CLOEXEC | (S_ISBLK(st.st_mode) ? O_EXCL : 0));
        if (fd < 0) {
            err = errno;
            if (err == EINVAL)
                return kv_fail(ctx, -EOPNOTSUPP, "uring: %s's filesystem does not support "
                               "O_DIRECT (tmpfs?)", d->path);
            if (err == EBUSY)
                return kv_fail(ctx, -EBUSY, "uring: block device %s is in use (mounted?); "
                               "refusing to overwrite it", d->path);
            return kv_fail(ctx, -err, "uring: cannot open %s with O_DIRECT: %s", d->path,
                           strerror(err));
        }
        d->fd = fd;
    }
    if (fstat(d->fd, &st) < 0) {
        err = errno;
        return kv_fail(ctx, -err, "uring: cannot stat %s: %s", d->path, strerror(err));
    }
    if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode))
        return kv_fail(ctx, -EINVAL, "uring: %s is neither a regular file nor a block device",
                       d->path);
    d->dev = st.st_dev;
    d->ino = st.st_ino;
    d->is_blkdev = S_ISBLK(st.st_mode);
    if (!d->is_blkdev) {
        struct statfs sf;

        /* Their O_DIRECT is accepted and ignored (Linux >= 6.6): every read is a memcpy. */
        if (fstatfs(d->fd, &sf) == 0 &&
            ((unsigned long)sf.f_type == TMPFS_MAGIC || (unsigned long)sf.f_type == RAMFS_MAGIC))
            return kv_fail(ctx, -EOPNOTSUPP, "uring: %s's filesystem does not support O_DIRECT "
                           "(tmpfs?): it is memory, not storage", d->path);
    }
    return 0;
}

/* Direct-I/O alignment of the open file: statx where the kernel reports it, else the device's. */
static int uring_alignment(struct kv_ctx *ctx, struct uring_data *d)
{
    d->offset_align = d->mem_align = URING_DEFAULT_ALIGN;
    d->align_source = "default";
#ifdef STATX_DIOALIGN
    {
        struct statx sx;

        memset(&sx, 0, sizeof(sx));
        if (statx(d->fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
            (sx.stx_mask & STATX_DIOALIGN)) {
            if (sx.stx_dio_offset_align == 0)
                return kv_fail(ctx, -EOPNOTSUPP, "uring: %s's filesystem does not support "
                               "O_DIRECT (tmpfs?)", d->path);
            d->offset_align = sx.stx_dio_offset_align;
            d->mem_align = sx.stx_dio_mem_align ? sx.stx_dio_mem_align : 1;
            d->align_source = "statx";
            return 0;
        }
    }
#endif
    if (d->is_blkdev) {
        int lbs = 0;

        if (ioctl(d->fd, BLKSSZGET, &lbs) == 0 && lbs > 0) {
            d->offset_align = d->mem_align = (uint32_t)lbs;
            d->align_source = "BLKSSZGET";
        }
    }
    return 0;
}

/* Sizes a created file to the region, or checks an existing one is large enough. */
static int uring_size_file(struct kv_ctx *ctx, struct uring_data *d, uint64_t bytes)
{
    struct stat st;
    int err;

    if (d->size_mode == URING_CREATE) {
        /*
         * fallocate reserves the blocks now, so ENOSPC comes here and not
         * mid-replay; where it is unsupported the pre-write allocates them.
         */
        err = fallocate(d->fd, 0, 0, (off_t)bytes) == 0 ? 0 : errno;
        if (err == EOPNOTSUPP || err == ENOSYS)
            err = ftruncate(d->fd, (off_t)bytes) == 0 ? 0 : errno;
        if (err)
            return kv_fail(ctx, -err, "uring: cannot allocate %" PRIu64 " bytes for %s: %s",
                           bytes, d->path, strerror(err));
        d->file_bytes = bytes;
        return 0;
    }
    if (d->is_blkdev) {
        uint64_t dev_bytes = 0;

        if (ioctl(d->fd, BLKGETSIZE64, &dev_bytes) < 0) {
            err = errno;
            return kv_fail(ctx, -err, "uring: cannot read the size of block device %s: %s",
                           d->path, strerror(err));
        }
        d->file_bytes = dev_bytes;
    } else {
        if (fstat(d->fd, &st) < 0) {
            err = errno;
            return kv_fail(ctx, -err, "uring: cannot stat %s: %s", d->path, strerror(err));
        }
        d->file_bytes = (uint64_t)st.st_size;
    }
    if (d->file_bytes < bytes)
        return kv_fail(ctx, -ENOSPC,
                       "uring: %s holds %" PRIu64 " bytes, the arena needs %" PRIu64
                       " (size=existing never extends a file)", d->path, d->file_bytes, bytes);
    return 0;
}

/* Page-aligned host memory for staging and scratch, pre-faulted with a non-zero pattern. */
static int uring_alloc_memory(struct kv_ctx *ctx, struct uring_data *d, uint64_t staging_bytes)
{
    long pg = sysconf(_SC_PAGESIZE);
    size_t page = pg > 0 ? (size_t)pg : 4096, half;
    void *p;

    if (d->mem_align > page)
        return kv_fail(ctx, -EINVAL, "uring: %s needs buffers aligned to %u bytes, more than "
                       "a page", d->path, d->mem_align);
    half = (size_t)((staging_bytes + page - 1) / page * page);
    d->mem_bytes = 2 * half;
    p = mmap(NULL, d->mem_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        int err = errno;

        d->mem_bytes = 0;
        return kv_fail(ctx, -err, "uring: cannot map %zu bytes of staging and scratch: %s",
                       2 * half, strerror(err));
    }
    d->mem = p;
    d->staging = d->mem;
    d->scratch = d->mem + half;
    d->staging_bytes = d->scratch_bytes = staging_bytes;
    /* Every page written: no fault inside a timed access, and the pre-write writes non-zeros. */
    for (size_t i = 0; i < d->mem_bytes / sizeof(uint64_t); i++)
        ((uint64_t *)d->mem)[i] = 0x6b76656d75000000ull ^ (uint64_t)i;
    return 0;
}

static void uring_register(struct uring_data *d)
{
    struct iovec iov[2] = {
        { .iov_base = d->staging, .iov_len = (size_t)d->staging_bytes },
        { .iov_base = d->scratch, .iov_len = (size_t)d->scratch_bytes },
    };

    d->register_buffers_errno = d->register_files_errno = 0;
    if (!d->register_requested)
        return;
    if (uring_register_sys(d->ring.fd, IORING_REGISTER_BUFFERS, iov, 2) == 0)
        d->buffers_registered = 1;
    else
        d->register_buffers_errno = errno;
    if (uring_register_sys(d->ring.fd, IORING_REGISTER_FILES, &d->fd, 1) == 0)
        d->files_registered = 1;
    else
        d->register_files_errno = errno;
}

static uint64_t uring_resident_pages(uint8_t *map, size_t bytes, size_t page,
                                     unsigned char *vec)
{
    uint64_t n = 0, pages = (bytes + page - 1) / page;

    if (mincore(map, bytes, vec) < 0)
        return UINT64_MAX;
    for (uint64_t i = 0; i < pages; i++)
        n += vec[i] & 1;
    return n;
}

/*
 * Drops the region's cached pages, reads its start through the ring and asks
 * mincore whether those reads left pages in the page cache: a filesystem that
 * quietly turns O_DIRECT into buffered I/O would, and its timings would be
 * memory copies. Refuses such a file; notes when the check cannot be made.
 */
static int uring_check_page_cache(struct kv_ctx *ctx, struct uring_data *d)
{
    long pg = sysconf(_SC_PAGESIZE);
    size_t page = pg > 0 ? (size_t)pg : 4096;
    uint64_t bytes = d->region_bytes < URING_PROBE_BYTES ? d->region_bytes : URING_PROBE_BYTES;
    uint64_t before, after;
    unsigned char *vec;
    uint8_t *map;
    int rc;

    /* Whole scratch-sized chunks: both are multiples of the O_DIRECT alignment. */
    if (bytes > d->scratch_bytes)
        bytes -= bytes % d->scratch_bytes;
    d->page_cache_check = "unavailable";
    d->probe_pages = (bytes + page - 1) / page;
    posix_fadvise(d->fd, 0, (off_t)d->region_bytes, POSIX_FADV_DONTNEED);
    vec = calloc(d->probe_pages, 1);
    if (!vec)
        return kv_fail(ctx, -ENOMEM, "uring: cannot allocate the page-cache probe");
    map = mmap(NULL, (size_t)bytes, PROT_READ, MAP_SHARED, d->fd, 0);
    if (map == MAP_FAILED) {
        free(vec);
        return 0;
    }
    before = uring_resident_pages(map, (size_t)bytes, page, vec);
    rc = uring_span(ctx, d, "page-cache probe", 0, 0, bytes, d->scratch, d->scratch_bytes,
                    d->buffers_registered ? 1 : -1);
    after = rc < 0 ? UINT64_MAX : uring_resident_pages(map, (size_t)bytes, page, vec);
    munmap(map, (size_t)bytes);
    free(vec);
    if (rc < 0)
        return rc;
    if (before == UINT64_MAX || after == UINT64_MAX)
        return 0;
    d->probe_resident_before = before;
    d->probe_resident_after = after;
    if (after > before)
        return kv_fail(ctx, -EOPNOTSUPP,
                       "uring: O_DIRECT reads of %s went through the page cache (%" PRIu64
                       " of %" PRIu64 " pages became resident): its filesystem falls back to "
                       "buffered I/O, so timings would be memory copies", d->path,
                       after - before, d->probe_pages);
    /* Pages someone else holds cached would hide a fallback; say the check proved nothing. */
    d->page_cache_check = after == 0 ? "mincore" : "inconclusive";
    return 0;
}

static int uring_prepare(struct kv_ctx *ctx, uint64_t arena_bytes, uint64_t staging_bytes)
{
    struct uring_data *d = ctx->backend_data;
    uint64_t chunk, t0;
    int rc;

    if (arena_bytes == 0 || staging_bytes == 0)
        return kv_fail(ctx, -EINVAL, "uring: refusing an empty arena");
    if (arena_bytes > (uint64_t)INT64_MAX)
        return kv_fail(ctx, -EFBIG, "uring: arena of %" PRIu64 " bytes exceeds a file offset",
                       arena_bytes);
    d->region_bytes = arena_bytes;
    d->page_cache_check = "unavailable";
    d->prewritten_bytes = 0;

    rc = uring_open_file(ctx, d);
    if (rc == 0)
        rc = uring_alignment(ctx, d);
    if (rc < 0)
        goto fail;
    /*
     * block_bytes divides both sizes, so a size that is not a multiple of the
     * alignment proves the block is not. (A future core that fills ctx->geom
     * before calling prepare lets us check the block itself.)
     */
    if (arena_bytes % d->offset_align || staging_bytes % d->offset_align ||
        (ctx->geom.block_bytes && ctx->geom.block_bytes % d->offset_align)) {
        rc = kv_fail(ctx, -EINVAL,
                     "uring: O_DIRECT on %s moves multiples of %u bytes (%s), but the arena is "
                     "%" PRIu64 " bytes and staging %" PRIu64 " bytes: block_bytes must be a "
                     "multiple of %u", d->path, d->offset_align, d->align_source, arena_bytes,
                     staging_bytes, d->offset_align);
        goto fail;
    }
    rc = uring_size_file(ctx, d, arena_bytes);
    if (rc == 0)
        rc = uring_alloc_memory(ctx, d, staging_bytes);
    if (rc < 0)
        goto fail;
    uring_register(d);

    /* Write the region once, so no read of it lands on a hole or an unwritten extent. */
    chunk = staging_bytes < URING_PREWRITE_CHUNK_BYTES ? staging_bytes
                                                       : URING_PREWRITE_CHUNK_BYTES;
    chunk -= chunk % d->offset_align;
    if (chunk == 0)
        chunk = staging_bytes;
    t0 = kv_timer_ticks(&ctx->timer);
    rc = uring_span(ctx, d, "pre-write", 1, 0, arena_bytes, d->staging, chunk,
                    d->buffers_registered ? 0 : -1);
    if (rc < 0)
        goto fail;
    /* Extent conversions and the device's write cache, settled before anything is timed. */
    if (fdatasync(d->fd) < 0) {
        int err = errno;

        rc = kv_fail(ctx, -err, "uring: fdatasync of %s failed: %s", d->path, strerror(err));
        goto fail;
    }
    d->prewritten_bytes = arena_bytes;
    d->prewrite_s = (double)kv_timer_ns(&ctx->timer, kv_timer_ticks(&ctx->timer) - t0) * 1e-9;

    rc = uring_check_page_cache(ctx, d);
    if (rc < 0)
        goto fail;
    /* The pattern the pre-write left is what staging holds; tests poke over it. */
    ctx->staging_host = d->staging;
    ctx->arena_host = NULL;
    return 0;

fail:
    /* A file this call created is removed even with keep=1: it holds no replay. */
    uring_release_file(d, 1);
    d->file_bytes = 0;
    d->prewritten_bytes = 0;
    d->page_cache_check = "unavailable";
    return rc;
}

/* ----------------------------------------------------------------- access */

static int uring_access(struct kv_ctx *ctx, int op, const struct kv_access *acc, uint32_t n,
                        uint64_t *lat_ns, uint64_t *busy_ns)
{
    struct uring_data *d = ctx->backend_data;
    const int is_write = op == KV_OP_STORE;
    uint64_t sink = 0;
    int rc;

    if (op < 0 || op >= KV_N_OPS)
        return kv_fail(ctx, -EINVAL, "uring: unknown op %d", op);
    if (n > KV_BATCH)
        return kv_fail(ctx, -EINVAL, "uring: batch of %u accesses exceeds %u", n, KV_BATCH);
    for (uint32_t i = 0; i < n; i++) {
        const struct kv_access *a = &acc[i];
        struct uring_job *j = &d->jobs[i];

        if (a->arena_off % d->offset_align || a->bytes % d->offset_align || a->bytes == 0)
            return kv_fail(ctx, -EINVAL,
                           "uring: access of %" PRIu64 " bytes at offset %" PRIu64 " of %s is "
                           "not aligned to its O_DIRECT alignment of %u bytes (%s): block_bytes "
                           "must be a multiple of %u", a->bytes, a->arena_off, d->path,
                           d->offset_align, d->align_source, d->offset_align);
        if (op == KV_OP_READ) {
            /* Reads land in a scratch slot; concurrent reads take successive slots. */
            uint64_t slots = d->scratch_bytes / a->bytes;

            if (slots == 0)
                return kv_fail(ctx, -EINVAL, "uring: read of %" PRIu64 " bytes exceeds the "
                               "%" PRIu64 "-byte scratch buffer", a->bytes, d->scratch_bytes);
            j->buf = d->scratch + (i % slots) * a->bytes;
            j->buf_index = d->buffers_registered ? 1 : -1;
        } else {
            j->buf = d->staging + a->staging_off;
            j->buf_index = d->buffers_registered ? 0 : -1;
        }
        if ((uintptr_t)j->buf % d->mem_align)
            return kv_fail(ctx, -EINVAL,
                           "uring: staging offset %" PRIu64 " is not aligned to the %u-byte "
                           "O_DIRECT memory alignment of %s", a->staging_off, d->mem_align,
                           d->path);
        j->start = j->buf;
        j->off = a->arena_off;
        j->left = a->bytes;
        j->retries = 0;
    }
    rc = uring_run(ctx, d, op == KV_OP_LOAD ? "load" : op == KV_OP_STORE ? "store" : "read",
                   is_write, d->jobs, n, lat_ns, busy_ns);
    if (rc < 0)
        return rc;
    if (!is_write) {
        /* After timing: what the reads brought in, so the data is observed. */
        for (uint32_t i = 0; i < n; i++) {
            uint64_t v;

            memcpy(&v, d->jobs[i].start, sizeof(v));
            sink += v;
        }
        ctx->read_sink += sink;
    }
    return (int)n;
}

/* --------------------------------------------------------------- describe */

static void uring_append_json_string(char *buf, size_t len, size_t *pos, const char *s)
{
    kv_appendf(buf, len, pos, "\"");
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;

        if (c == '"' || c == '\\')
            kv_appendf(buf, len, pos, "\\%c", c);
        else if (c < 0x20)
            kv_appendf(buf, len, pos, "\\u%04x", c);
        else
            kv_appendf(buf, len, pos, "%c", c);
    }
    kv_appendf(buf, len, pos, "\"");
}

static const struct {
    uint32_t bit;
    const char *name;
} uring_feature_names[] = {
    { IORING_FEAT_SINGLE_MMAP, "single_mmap" },
    { IORING_FEAT_NODROP, "nodrop" },
    { IORING_FEAT_SUBMIT_STABLE, "submit_stable" },
    { IORING_FEAT_RW_CUR_POS, "rw_cur_pos" },
    { IORING_FEAT_CUR_PERSONALITY, "cur_personality" },
    { IORING_FEAT_FAST_POLL, "fast_poll" },
    { IORING_FEAT_POLL_32BITS, "poll_32bits" },
    { IORING_FEAT_SQPOLL_NONFIXED, "sqpoll_nonfixed" },
    { IORING_FEAT_EXT_ARG, "ext_arg" },
    { IORING_FEAT_NATIVE_WORKERS, "native_workers" },
    { IORING_FEAT_RSRC_TAGS, "rsrc_tags" },
#ifdef IORING_FEAT_CQE_SKIP
    { IORING_FEAT_CQE_SKIP, "cqe_skip" },
#endif
#ifdef IORING_FEAT_LINKED_FILE
    { IORING_FEAT_LINKED_FILE, "linked_file" },
#endif
};

static void uring_append_errno(char *buf, size_t len, size_t *pos, const char *key, int err)
{
    kv_appendf(buf, len, pos, ",\"%s\":", key);
    if (err)
        uring_append_json_string(buf, len, pos, strerror(err));
    else
        kv_appendf(buf, len, pos, "null");
}

static int uring_describe(struct kv_ctx *ctx, char *buf, size_t len)
{
    const struct uring_data *d = ctx->backend_data;
    const int ready = d->fd >= 0;
    size_t pos = 0;
    int first = 1;

    kv_appendf(buf, len, &pos, ",\"path\":");
    uring_append_json_string(buf, len, &pos, d->path);
    kv_appendf(buf, len, &pos,
               ",\"file\":\"%s\",\"keep\":%s,\"queue_depth\":%u,\"submit_batch\":%u"
               ",\"sq_entries\":%u",
               d->size_mode == URING_CREATE ? "created" : "existing", d->keep ? "true" : "false",
               d->qd, d->batch, d->ring.sq_entries);
    kv_appendf(buf, len, &pos, ",\"io_uring_features\":[");
    for (size_t i = 0; i < sizeof(uring_feature_names) / sizeof(uring_feature_names[0]); i++) {
        if (d->ring.features & uring_feature_names[i].bit) {
            kv_appendf(buf, len, &pos, "%s\"%s\"", first ? "" : ",", uring_feature_names[i].name);
            first = 0;
        }
    }
    kv_appendf(buf, len, &pos, "],\"io_uring_features_mask\":%" PRIu32
               ",\"sqpoll\":false,\"iopoll\":false,\"o_direct\":true,\"register_requested\":%s",
               d->ring.features, d->register_requested ? "true" : "false");
    if (!ready) {
        kv_appendf(buf, len, &pos, ",\"file_kind\":null,\"file_bytes\":null");
        return (int)pos;
    }
    kv_appendf(buf, len, &pos,
               ",\"file_kind\":\"%s\",\"file_bytes\":%" PRIu64 ",\"prewritten_bytes\":%" PRIu64
               ",\"prewrite_s\":%.3f,\"dio_offset_align\":%u,\"dio_mem_align\":%u"
               ",\"alignment_source\":\"%s\",\"registered_buffers\":%s"
               ",\"registered_files\":%s",
               d->is_blkdev ? "block_device" : "regular", d->file_bytes, d->prewritten_bytes,
               d->prewrite_s, d->offset_align, d->mem_align, d->align_source,
               d->buffers_registered ? "true" : "false", d->files_registered ? "true" : "false");
    uring_append_errno(buf, len, &pos, "register_buffers_error", d->register_buffers_errno);
    uring_append_errno(buf, len, &pos, "register_files_error", d->register_files_errno);
    kv_appendf(buf, len, &pos,
               ",\"scratch_bytes\":%" PRIu64 ",\"page_cache_check\":\"%s\""
               ",\"page_cache_probe_pages\":%" PRIu64
               ",\"page_cache_resident_before\":%" PRIu64
               ",\"page_cache_resident_after\":%" PRIu64,
               d->scratch_bytes, d->page_cache_check, d->probe_pages, d->probe_resident_before,
               d->probe_resident_after);
    return (int)pos;
}

static void uring_close(struct kv_ctx *ctx)
{
    struct uring_data *d = ctx->backend_data;

    if (!d)
        return;
    uring_release_file(d, 0);
    uring_ring_unmap(&d->ring);
    uring_free(d);
    ctx->backend_data = NULL;
    ctx->arena_host = ctx->staging_host = NULL;
}

const struct kv_backend_ops kv_uring_ops = {
    .version = KV_OPS_VERSION,
    .name = "uring",
    .open = uring_open,
    .prepare = uring_prepare,
    .access = uring_access,
    .describe = uring_describe,
    .close = uring_close,
};
