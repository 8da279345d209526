/*
 * stackdist.c - LRU stack distances of a reference stream (Mattson et al., 1970),
 * for the capacity analysis: a reference hits in an LRU cache of C blocks exactly
 * when fewer than C distinct other blocks were referenced since the previous
 * reference to the same block. The distance is the count of "latest reference"
 * marks at positions strictly between the previous reference and this one.
 *
 * Prompt streams repeat whole runs of blocks: a reference whose previous
 * reference sits right after the previous reference of the reference before it
 * (prev[i] == prev[i-1] + 1) has the same distance as that one (the window
 * (prev, i) loses the block at prev[i-1] + 1, which is the one referenced at i,
 * and gains the block at i - 1, seen nowhere in the old window). So the stream
 * is cut into segments of such references (and of first references), one
 * distance is counted per segment, and each segment moves its marks as two
 * range updates (off at prev..prev+len, on at i..i+len) of Fenwick trees over
 * only the positions the segments name. Where segments are not much fewer than
 * references, the plain form runs: one Fenwick tree over every position, a
 * query and two updates per reference. Both O(n log n) at worst.
 *
 * The stream comes as runs of consecutive ids (start, count), or as one id per
 * reference (counts NULL).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvemu.h"

/* The reference stream: run r holds ids start[r] .. start[r] + count[r] - 1 (count NULL: 1). */
struct stream {
    const int64_t *start, *count;
    uint64_t runs, n;
};

#define RUN_COUNT(s, r) ((s)->count ? (uint64_t)(s)->count[r] : 1)

/* Where the distances go: emit(ctx, at, len, d) for references at..at+len, in stream order. */
struct sink {
    void (*emit)(void *ctx, uint64_t at, uint64_t len, uint64_t d);
    void *ctx;
};

static void fenwick_add(int32_t *tree, uint64_t n, uint64_t pos, int32_t delta)
{
    for (uint64_t i = pos + 1; i <= n; i += i & (~i + 1))
        tree[i - 1] += delta;
}

/* Markers at positions [0, pos). */
static uint64_t fenwick_prefix(const int32_t *tree, uint64_t pos)
{
    int64_t s = 0;

    for (uint64_t i = pos; i > 0; i -= i & (~i + 1))
        s += tree[i - 1];
    return (uint64_t)s;
}

/* The plain form: a query and two updates per reference. */
static int distances_plain(const struct stream *s, int32_t *last, const struct sink *out)
{
    uint64_t n = s->n, i = 0;
    int32_t *tree = calloc(n ? n : 1, sizeof(*tree));

    if (!tree)
        return -ENOMEM;
    for (uint64_t r = 0; r < s->runs; r++) {
        for (uint64_t j = 0, c = RUN_COUNT(s, r); j < c; j++, i++) {
            int64_t id = s->start[r] + (int64_t)j;
            int32_t prev = last[id];
            uint64_t d = UINT64_MAX;

            if (prev >= 0) {
                /* distinct blocks whose latest reference lies strictly between prev and i */
                d = fenwick_prefix(tree, i) - fenwick_prefix(tree, (uint64_t)prev + 1);
                fenwick_add(tree, n, (uint64_t)prev, -1);
            }
            fenwick_add(tree, n, i, 1);
            last[id] = (int32_t)i;
            out->emit(out->ctx, i, 1, d);
        }
    }
    free(tree);
    return 0;
}

/* A segment: references at..at+len, each one after the previous reference of the one before it
 * (or all first references: prev < 0). */
struct segment {
    int64_t at, prev, len;
};

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;

    return (x > y) - (x < y);
}

/* Range-update, prefix-query Fenwick trees over the k sorted distinct coordinates: marks[j] is the
 * sum of differences d[x], x <= j, so the marks at positions below y sum to
 * y * sum(d[x]) - sum(d[x] * x) over coordinates x < y. */
struct ranges {
    const int64_t *coords;
    uint64_t k;
    int64_t *t1, *t2;
};

/* Index of x among the coordinates (x is one of them). */
static uint64_t coord_index(const struct ranges *r, int64_t x)
{
    uint64_t lo = 0, hi = r->k;

    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;

        if (r->coords[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void ranges_point(struct ranges *r, int64_t x, int64_t v)
{
    for (uint64_t i = coord_index(r, x) + 1; i <= r->k; i += i & (~i + 1)) {
        r->t1[i - 1] += v;
        r->t2[i - 1] += v * x;
    }
}

/* marks[a..b) += v */
static void ranges_add(struct ranges *r, int64_t a, int64_t b, int64_t v)
{
    ranges_point(r, a, v);
    ranges_point(r, b, -v);
}

/* Marks at positions [0, y). */
static int64_t ranges_prefix(const struct ranges *r, int64_t y)
{
    int64_t s1 = 0, s2 = 0;

    for (uint64_t i = coord_index(r, y); i > 0; i -= i & (~i + 1)) {
        s1 += r->t1[i - 1];
        s2 += r->t2[i - 1];
    }
    return y * s1 - s2;
}

/* The segment form; 1 where the segments are too many for it to pay (nothing emitted), 0 done. */
static int distances_segments(const struct stream *s, int32_t *last, const struct sink *out)
{
    uint64_t cap = s->n / 8 + 64, ns = 0, nc = 0, k = 0, i = 0;
    struct segment *seg = malloc(cap * sizeof(*seg));
    int64_t *coords = NULL, *t1 = NULL, *t2 = NULL, pp = -1;
    int rc = -ENOMEM;

    if (!seg)
        return -ENOMEM;
    for (uint64_t r = 0; r < s->runs; r++) {
        for (uint64_t j = 0, c = RUN_COUNT(s, r); j < c; j++, i++) {
            int64_t id = s->start[r] + (int64_t)j, p = last[id];

            last[id] = (int32_t)i;
            if (i > 0 && ((p >= 0 && pp >= 0 && p == pp + 1) || (p < 0 && pp < 0))) {
                seg[ns - 1].len++;
            } else {
                if (ns == cap) {
                    free(seg);
                    return 1;
                }
                seg[ns++] = (struct segment){(int64_t)i, p, 1};
            }
            pp = p;
        }
    }
    coords = malloc((5 * ns + 1) * sizeof(*coords));
    if (!coords)
        goto done;
    for (uint64_t g = 0; g < ns; g++) {
        coords[nc++] = seg[g].at;
        coords[nc++] = seg[g].at + seg[g].len;
        if (seg[g].prev >= 0) {
            coords[nc++] = seg[g].prev;
            coords[nc++] = seg[g].prev + 1;
            coords[nc++] = seg[g].prev + seg[g].len;
        }
    }
    qsort(coords, nc, sizeof(*coords), cmp_i64);
    for (uint64_t j = 0; j < nc; j++)
        if (k == 0 || coords[j] != coords[k - 1])
            coords[k++] = coords[j];
    t1 = calloc(k ? k : 1, sizeof(*t1));
    t2 = calloc(k ? k : 1, sizeof(*t2));
    if (!t1 || !t2)
        goto done;
    struct ranges m = {coords, k, t1, t2};
    for (uint64_t g = 0; g < ns; g++) {
        int64_t at = seg[g].at, len = seg[g].len, p = seg[g].prev;
        uint64_t d = UINT64_MAX;

        if (p >= 0) {
            d = (uint64_t)(ranges_prefix(&m, at) - ranges_prefix(&m, p + 1));
            ranges_add(&m, p, p + len, -1);
        }
        ranges_add(&m, at, at + len, 1);
        out->emit(out->ctx, (uint64_t)at, (uint64_t)len, d);
    }
    rc = 0;
done:
    free(seg);
    free(coords);
    free(t1);
    free(t2);
    return rc;
}

/* Checks the stream (ids below id_space, counts >= 0, n below 2^31) and sets s->n. */
static int check_stream(struct stream *s, uint64_t id_space)
{
    uint64_t n = 0;

    if (!s->start && s->runs)
        return -EINVAL;
    for (uint64_t r = 0; r < s->runs; r++) {
        int64_t c = s->count ? s->count[r] : 1;

        if (c < 0)
            return -EINVAL;
        if (c > 0 && (s->start[r] < 0 || (uint64_t)s->start[r] >= id_space
                      || (uint64_t)c > id_space - (uint64_t)s->start[r]))
            return -EINVAL;
        n += (uint64_t)c;
        if (n > (uint64_t)INT32_MAX)
            return -E2BIG; /* positions are int32 */
    }
    s->n = n;
    return 0;
}

static int distances(const struct stream *s, uint64_t id_space, const struct sink *out, uint64_t *first_refs)
{
    size_t bytes = (id_space ? id_space : 1) * sizeof(int32_t);
    int32_t *last = malloc(bytes);
    int rc;

    if (!last)
        return -ENOMEM;
    memset(last, 0xff, bytes); /* -1: not referenced yet */
    rc = distances_segments(s, last, out);
    if (rc == 1) {
        memset(last, 0xff, bytes);
        rc = distances_plain(s, last, out);
    }
    if (rc == 0 && first_refs) {
        /* the ids referenced at all: those with a latest reference */
        uint64_t u = 0;

        for (uint64_t b = 0; b < id_space; b++)
            u += last[b] >= 0;
        *first_refs = u;
    }
    free(last);
    return rc;
}

static void emit_fill(void *ctx, uint64_t at, uint64_t len, uint64_t d)
{
    uint64_t *dist = ctx;

    for (uint64_t j = 0; j < len; j++)
        dist[at + j] = d;
}

int kv_stack_distances(const int64_t *ids, uint64_t n, uint64_t id_space, uint64_t *dist_out)
{
    struct stream s = {ids, NULL, n, 0};
    struct sink out = {emit_fill, dist_out};
    int rc;

    if ((!ids || !dist_out) && n)
        return -EINVAL;
    rc = check_stream(&s, id_space);
    if (rc < 0)
        return rc;
    return distances(&s, id_space, &out, NULL);
}

/* The thresholds' runs, built as the segments' distances arrive. */
struct runs {
    const int64_t *offsets;
    uint64_t n_req, req, k, cap;
    int64_t clamp, running; /* the request's running maximum so far */
    int64_t *value, *end, *request;
    int overflow;
};

static void emit_runs(void *ctx, uint64_t at, uint64_t len, uint64_t d)
{
    struct runs *o = ctx;
    int64_t v = d >= (uint64_t)o->clamp ? o->clamp : (int64_t)d;

    while (len > 0) {
        uint64_t part;

        while ((uint64_t)o->offsets[o->req + 1] <= at) /* requests that end before at (some empty) */
            o->req++;
        part = (uint64_t)o->offsets[o->req + 1] - at;
        if (part > len)
            part = len;
        /* a new run at a request's first reference, or where the running maximum grows */
        if ((uint64_t)o->offsets[o->req] == at || v > o->running) {
            if (o->k == o->cap) {
                o->overflow = 1;
                return;
            }
            o->running = v;
            o->value[o->k] = v;
            o->request[o->k] = (int64_t)o->req;
            o->k++;
        }
        o->end[o->k - 1] = (int64_t)(at + part);
        at += part;
        len -= part;
    }
}

int64_t kv_prefix_threshold_runs(const int64_t *run_start, const int64_t *run_count, uint64_t n_runs,
                                 uint64_t id_space, const int64_t *offsets, uint64_t n_req, int64_t clamp,
                                 int64_t *value_out, int64_t *end_out, int64_t *request_out, uint64_t out_cap,
                                 uint64_t *unique_out)
{
    struct stream s = {run_start, run_count, n_runs, 0};
    struct runs o = {offsets, n_req, 0, 0, out_cap, clamp, 0, value_out, end_out, request_out, 0};
    struct sink out = {emit_runs, &o};
    int rc;

    if (!run_count || !offsets || !unique_out || clamp < 0 || ((!value_out || !end_out || !request_out) && out_cap))
        return -EINVAL;
    rc = check_stream(&s, id_space);
    if (rc < 0)
        return rc;
    if (offsets[0] != 0 || (uint64_t)offsets[n_req] != s.n)
        return -EINVAL;
    for (uint64_t r = 0; r < n_req; r++)
        if (offsets[r + 1] < offsets[r])
            return -EINVAL;
    rc = distances(&s, id_space, &out, unique_out);
    if (rc < 0)
        return rc;
    return o.overflow ? -ENOSPC : (int64_t)o.k;
}
