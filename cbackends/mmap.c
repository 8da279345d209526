/*
 * mmap.c - a tier the CPU reaches through a shared mapping of a file or a
 * device: /dev/daxX.Y (device DAX: persistent memory, or CXL memory given to
 * device DAX rather than to the page allocator), a file on a DAX-mounted pmem
 * file system, on tmpfs or hugetlbfs (shared memory that several processes
 * map, as a host-side memory pool), or on an ordinary file system (then the
 * tier is the page cache in front of it). Spec:
 * mmap:PATH[,offset=BYTES][,size=create|existing][,keep=0|1][,populate=0|1]
 *      [,hugepages=0|1][,cold=0|1]
 *
 * Measures what dram measures, with memtier.c's access loop, on a MAP_SHARED
 * mapping of PATH from offset: stores reach the file or device, and every
 * process mapping it sees them.
 *
 * Caveats:
 *  - dram.c's: one thread, each access timed alone, arena lines flushed after
 *    each access (cold=1), store buffers not drained, nothing mlocked.
 *  - size=create (the default) creates PATH, refusing one that exists,
 *    reserves its blocks (fallocate) and pre-faults it with write faults that
 *    leave the data as it is (zeros); it is removed at close unless keep=1.
 *    size=existing maps what is there, never truncates it and never writes it
 *    to pre-fault: it is pre-faulted by reading, so on a file system that
 *    tracks dirty pages (ext4, xfs) the first store to each page still takes a
 *    write fault inside the timed access.
 *  - A file on an ordinary file system is served from the page cache once
 *    pre-faulted; the disk shows up only when the kernel writes dirty pages
 *    back (which write-protects them again) or reclaims them (the next access
 *    is a disk read). populate=0 skips pre-faulting, to measure first touch.
 *  - Alignment: offset must be a multiple of the page the mapping uses (the
 *    base page; hugetlbfs's huge page; device DAX's align, 2 MiB unless sysfs
 *    says otherwise); the mapping is the arena rounded up to that page.
 *  - A process truncating the file under the mapping turns accesses into
 *    SIGBUS, which ends the replay. PATH is everything before the first comma.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/magic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "memtier.h"

/* Device DAX's default alignment, and the x86-64 PMD size. */
#define MMAP_DEVDAX_ALIGN_BYTES (2ull << 20)

#ifndef STATX_ATTR_DAX
#define STATX_ATTR_DAX 0x00200000
#endif

enum mmap_kind { MMAP_FILE, MMAP_TMPFS, MMAP_HUGETLBFS, MMAP_DEVDAX };
static const char *const mmap_kind_names[] = { "file", "tmpfs", "hugetlbfs", "devdax" };

struct mmap_data {
    struct memtier mt;          /* first: memtier's hooks find it at backend_data */
    char *path;
    uint64_t offset_bytes;      /* of the arena in the file or device */
    int existing;               /* size=existing: map what is there */
    int keep;                   /* keep=1: leave a created file at close */
    int lazy;                   /* populate=0: no pre-fault of the arena */
    enum mmap_kind kind;
    unsigned long fs_magic;     /* statfs f_type of the file system holding PATH */
    size_t align_bytes;         /* offset and length granularity: the mapping's page */
    uint64_t size_bytes;        /* of the file or device as prepare found it */
    int created;                /* prepare created PATH; close removes it unless keep */
    dev_t dev;                  /* identity of the created file, so close removes only it */
    ino_t ino;
    int dax;                    /* STATX_ATTR_DAX: 1 yes, 0 no, -1 unknown */
};
_Static_assert(offsetof(struct mmap_data, mt) == 0, "memtier's hooks read mt at backend_data");

static struct mmap_data *mmap_data(struct kv_ctx *ctx)
{
    return memtier_container(ctx->backend_data, struct mmap_data);
}

static const struct kv_opt_key mmap_keys[] = {
    { "offset", "BYTES" },
    { "size", "create|existing" },
    { "keep", "0|1" },
    { "populate", "0|1" },
    { NULL, NULL },
};

static int mmap_option(struct kv_ctx *ctx, struct memtier *m, const struct kv_opt *o)
{
    struct mmap_data *d = memtier_container(m, struct mmap_data);
    int rc, v = 0;

    if (kv_opt_is(o, "offset"))
        return kv_opt_u64(ctx, o, 0, UINT64_MAX, &d->offset_bytes);
    if (kv_opt_is(o, "size"))
        return kv_opt_choice(ctx, o, &d->existing);     /* create: 0, existing: 1 */
    if (kv_opt_is(o, "keep"))
        return kv_opt_bool(ctx, o, &d->keep);
    rc = kv_opt_bool(ctx, o, &v);                       /* populate */
    if (rc == 0)
        d->lazy = !v;
    return rc;
}

static const struct memtier_kind mmap_kind = {
    .ops = &kv_mmap_ops,
    .data_bytes = sizeof(struct mmap_data),
    .keys = mmap_keys,
    .option = mmap_option,
};

/* A decimal from a sysfs attribute of character device dev; 1 when read. */
static int mmap_char_attr(dev_t dev, const char *attr, uint64_t *v)
{
    char path[128];
    FILE *f;
    int ok;

    snprintf(path, sizeof(path), "/sys/dev/char/%u:%u/%s", major(dev), minor(dev), attr);
    f = fopen(path, "r");
    if (!f)
        return 0;
    ok = fscanf(f, "%" SCNu64, v) == 1;
    fclose(f);
    return ok;
}

/* Whether character device dev is a device-DAX instance (its sysfs subsystem is "dax"). */
static int mmap_is_devdax(dev_t dev)
{
    char path[128], link[256];
    ssize_t n;
    const char *base;

    snprintf(path, sizeof(path), "/sys/dev/char/%u:%u/subsystem", major(dev), minor(dev));
    n = readlink(path, link, sizeof(link) - 1);
    if (n <= 0)
        return 0;
    link[n] = '\0';
    base = strrchr(link, '/');
    return strcmp(base ? base + 1 : link, "dax") == 0;
}

/*
 * What PATH is (or, for size=create, the file system it will be created on)
 * and the granularity its mapping needs; checks the offset against it.
 */
static int mmap_inspect(struct kv_ctx *ctx, struct mmap_data *d)
{
    struct statfs sfs;
    struct stat st;
    int err;

    if (!d->existing) {
        char *dir, *slash;

        if (lstat(d->path, &st) == 0)
            return kv_fail(ctx, -EEXIST, "mmap: %s exists; size=create (the default) makes a new "
                           "file and never touches one that exists (a replay that was killed "
                           "leaves its tier file behind: remove that file, or pass size=existing "
                           "to map it)", d->path);
        if (errno != ENOENT) {
            err = errno;
            return kv_fail(ctx, -err, "mmap: cannot check %s: %s", d->path, strerror(err));
        }
        dir = strdup(d->path);
        if (!dir)
            return kv_fail(ctx, -ENOMEM, "mmap: out of memory");
        slash = strrchr(dir, '/');
        if (!slash)
            strcpy(dir, ".");
        else if (slash == dir)
            slash[1] = '\0';
        else
            *slash = '\0';
        err = statfs(dir, &sfs) == 0 ? 0 : errno;
        if (err)
            kv_fail(ctx, -err, "mmap: cannot create %s: directory %s: %s", d->path, dir,
                    strerror(err));
        free(dir);
        if (err)
            return -err;
    } else {
        if (stat(d->path, &st) != 0 || statfs(d->path, &sfs) != 0) {
            err = errno;
            return kv_fail(ctx, -err, "mmap: cannot map %s: %s", d->path, strerror(err));
        }
        if (S_ISCHR(st.st_mode) && !mmap_is_devdax(st.st_rdev))
            return kv_fail(ctx, -EINVAL, "mmap: %s is a character device but not device DAX "
                           "(/dev/daxX.Y)", d->path);
        if (!S_ISCHR(st.st_mode) && !S_ISREG(st.st_mode))
            return kv_fail(ctx, -EINVAL, "mmap: %s is neither a regular file nor a device-DAX "
                           "device", d->path);
    }
    d->fs_magic = (unsigned long)sfs.f_type;
    d->align_bytes = d->mt.page_bytes;
    if (d->existing && S_ISCHR(st.st_mode)) {
        uint64_t align = 0;

        d->kind = MMAP_DEVDAX;
        /* Per device since Linux 5.10; the region's before that. */
        if (!mmap_char_attr(st.st_rdev, "align", &align))
            mmap_char_attr(st.st_rdev, "device/align", &align);
        d->align_bytes = align ? (size_t)align : MMAP_DEVDAX_ALIGN_BYTES;
    } else if (d->fs_magic == HUGETLBFS_MAGIC) {
        d->kind = MMAP_HUGETLBFS;
        d->align_bytes = (size_t)sfs.f_bsize;   /* the mount's huge page size */
    } else if (d->fs_magic == TMPFS_MAGIC) {
        d->kind = MMAP_TMPFS;
    } else {
        d->kind = MMAP_FILE;
    }
    if (d->align_bytes == 0 || d->align_bytes % d->mt.page_bytes)
        d->align_bytes = d->mt.page_bytes;
    if (d->offset_bytes % d->align_bytes)
        return kv_fail(ctx, -EINVAL, "mmap: offset %" PRIu64 " is not a multiple of %zu bytes, "
                       "the page size of %s (%s)", d->offset_bytes, d->align_bytes, d->path,
                       mmap_kind_names[d->kind]);
    return 0;
}

static int mmap_open(struct kv_ctx *ctx, const char *args)
{
    const char *rest;
    size_t n = kv_opt_positional(args, &rest);
    struct mmap_data *d;
    int rc;

    if (n == 0)
        return kv_fail(ctx, -EINVAL, "mmap: give a path, as mmap:PATH[,offset=BYTES]"
                       "[,size=create|existing][,keep=0|1][,populate=0|1]");
    rc = memtier_open(ctx, &mmap_kind, rest);
    if (rc < 0)
        return rc;
    d = mmap_data(ctx);
    d->dax = -1;
    d->path = strndup(args, n);
    rc = d->path ? mmap_inspect(ctx, d) : kv_fail(ctx, -ENOMEM, "mmap: out of memory");
    if (rc < 0) {
        free(d->path);
        memtier_discard(ctx);
    }
    return rc;
}

/* Removes the file prepare created, unless PATH now names another one. */
static void mmap_remove_created(struct mmap_data *d)
{
    struct stat st;

    if (d->created && lstat(d->path, &st) == 0 && st.st_dev == d->dev && st.st_ino == d->ino)
        unlink(d->path);
    d->created = 0;
}

/* Opens (size=existing) or creates and reserves (size=create) PATH for end bytes. */
static int mmap_open_file(struct kv_ctx *ctx, struct mmap_data *d, uint64_t need, uint64_t end,
                          int *fd_out)
{
    struct stat st;
    int fd, err;

    if (d->existing) {
        fd = open(d->path, O_RDWR | O_CLOEXEC);
        if (fd < 0) {
            err = errno;
            return kv_fail(ctx, -err, "mmap: cannot open %s for reading and writing: %s", d->path,
                           strerror(err));
        }
        if (fstat(fd, &st) != 0)
            st.st_size = 0;
        d->size_bytes = (uint64_t)st.st_size;
        if (d->kind == MMAP_DEVDAX && !mmap_char_attr(st.st_rdev, "size", &d->size_bytes))
            d->size_bytes = UINT64_MAX;     /* unknown: let mmap decide */
        /* A device maps whole pages only; a file's last page may run past its end. */
        if (d->size_bytes < (d->kind == MMAP_DEVDAX ? end : need)) {
            close(fd);
            return kv_fail(ctx, -ENOSPC, "mmap: %s holds %" PRIu64 " bytes; the arena needs %"
                           PRIu64 " from offset %" PRIu64 ", up to byte %" PRIu64 "%s", d->path,
                           d->size_bytes, need - d->offset_bytes, d->offset_bytes,
                           d->kind == MMAP_DEVDAX ? end : need,
                           d->kind == MMAP_DEVDAX ? " (whole aligned pages)" : "");
        }
        *fd_out = fd;
        return 0;
    }
    fd = open(d->path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        err = errno;
        return kv_fail(ctx, -err, "mmap: cannot create %s: %s", d->path, strerror(err));
    }
    if (fstat(fd, &st) == 0) {
        d->dev = st.st_dev;
        d->ino = st.st_ino;
        d->created = 1;
    }
    /* Reserve the blocks, so a full file system fails here rather than as SIGBUS later. */
    err = fallocate(fd, 0, (off_t)d->offset_bytes, (off_t)(end - d->offset_bytes)) ? errno : 0;
    if (err == EOPNOTSUPP)
        err = ftruncate(fd, (off_t)end) == 0 ? 0 : errno;
    if (err) {
        close(fd);
        mmap_remove_created(d);
        return kv_fail(ctx, -err, "mmap: cannot size %s to %" PRIu64 " bytes: %s%s", d->path, end,
                       strerror(err), d->kind == MMAP_HUGETLBFS && err == ENOSPC
                       ? " (too few free huge pages? see /proc/sys/vm/nr_hugepages)" : "");
    }
    d->size_bytes = end;
    *fd_out = fd;
    return 0;
}

static int mmap_prepare(struct kv_ctx *ctx, uint64_t arena_bytes, uint64_t staging_bytes)
{
    struct mmap_data *d = mmap_data(ctx);
    struct memtier *m = &d->mt;
    struct statx stx;
    uint64_t map_bytes, end, need;
    uint8_t *base;
    int fd = -1, rc, err;

    if (arena_bytes == 0)
        return kv_fail(ctx, -EINVAL, "mmap: refusing an empty arena");
    map_bytes = (arena_bytes + d->align_bytes - 1) / d->align_bytes * d->align_bytes;
    if (map_bytes < arena_bytes || map_bytes > SIZE_MAX ||
        __builtin_add_overflow(d->offset_bytes, map_bytes, &end) || end > (uint64_t)INT64_MAX)
        return kv_fail(ctx, -EINVAL, "mmap: arena of %" PRIu64 " bytes from offset %" PRIu64
                       " does not fit a mapping", arena_bytes, d->offset_bytes);
    need = d->offset_bytes + arena_bytes;
    /* A new tmpfs file takes its pages from memory, like staging; anything else does not. */
    rc = memtier_check_memory(ctx, m, !d->existing && d->kind == MMAP_TMPFS ? map_bytes : 0,
                              staging_bytes, memtier_available_bytes());
    if (rc == 0)
        rc = mmap_open_file(ctx, d, need, end, &fd);
    if (rc < 0)
        return rc;

    base = mmap(NULL, (size_t)map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                (off_t)d->offset_bytes);
    err = base == MAP_FAILED ? errno : 0;
    if (!err && statx(fd, "", AT_EMPTY_PATH, STATX_BASIC_STATS, &stx) == 0 &&
        (stx.stx_attributes_mask & STATX_ATTR_DAX))
        d->dax = (stx.stx_attributes & STATX_ATTR_DAX) != 0;
    close(fd);      /* the mapping keeps the file */
    if (err) {
        rc = kv_fail(ctx, -err, "mmap: cannot map %" PRIu64 " bytes of %s at offset %" PRIu64
                     ": %s", map_bytes, d->path, d->offset_bytes, strerror(err));
        goto fail;
    }
    m->arena.base = base;
    m->arena.bytes = (size_t)map_bytes;
    m->arena_page_bytes = d->align_bytes;
    /* hugetlbfs and device DAX map huge pages by construction; advice is for the others. */
    if (d->kind == MMAP_FILE || d->kind == MMAP_TMPFS)
        memtier_advise(m, &m->arena);
    if (!d->lazy) {
        /* Write faults only on a file this backend created: an existing tier may be in use. */
        rc = memtier_prefault(ctx, m, "arena", &m->arena, !d->existing);
        if (rc < 0)
            goto fail;
        m->prefaulted = 1;
    }
    rc = memtier_map_staging(ctx, m, staging_bytes);
    if (rc < 0)
        goto fail;
    rc = memtier_finish(ctx, m);
    if (rc < 0)
        goto fail;
    return 0;

fail:
    memtier_release(ctx, m);
    m->prefaulted = 0;
    mmap_remove_created(d);
    return rc;
}

static int mmap_describe(struct kv_ctx *ctx, char *buf, size_t len)
{
    const struct mmap_data *d = mmap_data(ctx);
    size_t pos = (size_t)memtier_describe(ctx, buf, len);

    kv_appendf(buf, len, &pos, ",\"path\":");
    memtier_append_json_string(buf, len, &pos, d->path);
    kv_appendf(buf, len, &pos,
               ",\"kind\":\"%s\",\"fs_magic\":\"0x%lx\",\"dax\":%s,\"shared\":true"
               ",\"mapping_bytes\":%zu,\"offset\":%" PRIu64 ",\"size\":\"%s\",\"created\":%s"
               ",\"kept\":%s,\"prefault_access\":%s",
               mmap_kind_names[d->kind], d->fs_magic,
               d->kind == MMAP_DEVDAX ? "true" : d->dax < 0 ? "null" : d->dax ? "true" : "false",
               d->mt.arena.bytes, d->offset_bytes, d->existing ? "existing" : "create",
               d->created ? "true" : "false", d->existing || d->keep ? "true" : "false",
               !d->mt.prefaulted ? "null" : d->existing ? "\"read\"" : "\"write\"");
    return (int)pos;
}

static void mmap_close(struct kv_ctx *ctx)
{
    struct mmap_data *d;

    if (!ctx->backend_data)
        return;
    d = mmap_data(ctx);
    memtier_release(ctx, &d->mt);
    if (!d->keep)
        mmap_remove_created(d);
    free(d->path);
    memtier_close(ctx);
}

const struct kv_backend_ops kv_mmap_ops = {
    .version = KV_OPS_VERSION,
    .name = "mmap",
    .open = mmap_open,
    .prepare = mmap_prepare,
    .access = memtier_access,
    .describe = mmap_describe,
    .close = mmap_close,
    .attach = memtier_attach,
};
