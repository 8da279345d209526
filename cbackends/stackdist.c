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
 * range updates (off at prev..prev+len, on at i..i+len) of a Fenwick tree over
 * only the positions the segments name. Where segments are not much fewer than
 * references, the plain form runs: one Fenwick tree over every position, a
 * query and two updates per reference. Both O(n log n) at worst.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvemu.h"

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
static int distances_plain(const int64_t *ids, uint64_t n, int64_t *last, uint64_t *dist_out)
{
    int32_t *tree = calloc(n ? n : 1, sizeof(*tree));

    if (!tree)
        return -ENOMEM;
    for (uint64_t i = 0; i < n; i++) {
        int64_t prev = last[ids[i]];

        if (prev < 0) {
            dist_out[i] = UINT64_MAX;
        } else {
            /* distinct blocks whose latest reference lies strictly between prev and i */
            dist_out[i] = fenwick_prefix(tree, i) - fenwick_prefix(tree, (uint64_t)prev + 1);
            fenwick_add(tree, n, (uint64_t)prev, -1);
        }
        fenwick_add(tree, n, i, 1);
        last[ids[i]] = (int64_t)i;
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

/* Index of x among the k sorted distinct coordinates (x is one of them). */
static uint64_t coord_index(const int64_t *coords, uint64_t k, int64_t x)
{
    uint64_t lo = 0, hi = k;

    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;

        if (coords[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Range-update, prefix-query Fenwick trees over the coordinates: marks[j] is the sum of the
 * differences d[k], k <= j, so marks at positions below x sum to x * sum(d[k]) - sum(d[k] * k)
 * over coordinates k < x. */
struct ranges {
    const int64_t *coords;
    uint64_t k;
    int64_t *t1, *t2;
};

static void ranges_point(struct ranges *r, int64_t x, int64_t v)
{
    for (uint64_t i = coord_index(r->coords, r->k, x) + 1; i <= r->k; i += i & (~i + 1)) {
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

/* Marks at positions [0, x). */
static int64_t ranges_prefix(const struct ranges *r, int64_t x)
{
    int64_t s1 = 0, s2 = 0;

    for (uint64_t i = coord_index(r->coords, r->k, x); i > 0; i -= i & (~i + 1)) {
        s1 += r->t1[i - 1];
        s2 += r->t2[i - 1];
    }
    return x * s1 - s2;
}

/* The segment form; 1 where the segments are too many for it to pay (nothing written), 0 done. */
static int distances_segments(const int64_t *ids, uint64_t n, int64_t *last, uint64_t *dist_out)
{
    uint64_t cap = n / 8 + 64, ns = 0, nc = 0, k = 0;
    struct segment *seg = malloc(cap * sizeof(*seg));
    int64_t *coords = NULL, *t1 = NULL, *t2 = NULL, pp = -1;
    int rc = -ENOMEM;

    if (!seg)
        return -ENOMEM;
    for (uint64_t i = 0; i < n; i++) {
        int64_t p = last[ids[i]];

        last[ids[i]] = (int64_t)i;
        if (i > 0 && ((p >= 0 && pp >= 0 && p == pp + 1) || (p < 0 && pp < 0))) {
            seg[ns - 1].len++;
        } else {
            if (ns == cap) {
                free(seg);
                return 1;
            }
            seg[ns++] = (struct segment){(int64_t)i, p < 0 ? -1 : p, 1};
        }
        pp = p;
    }
    coords = malloc((5 * ns + 1) * sizeof(*coords));
    if (!coords)
        goto out;
    for (uint64_t s = 0; s < ns; s++) {
        coords[nc++] = seg[s].at;
        coords[nc++] = seg[s].at + seg[s].len;
        if (seg[s].prev >= 0) {
            coords[nc++] = seg[s].prev;
            coords[nc++] = seg[s].prev + 1;
            coords[nc++] = seg[s].prev + seg[s].len;
        }
    }
    qsort(coords, nc, sizeof(*coords), cmp_i64);
    for (uint64_t j = 0; j < nc; j++)
        if (k == 0 || coords[j] != coords[k - 1])
            coords[k++] = coords[j];
    t1 = calloc(k ? k : 1, sizeof(*t1));
    t2 = calloc(k ? k : 1, sizeof(*t2));
    if (!t1 || !t2)
        goto out;
    struct ranges r = {coords, k, t1, t2};
    for (uint64_t s = 0; s < ns; s++) {
        int64_t at = seg[s].at, len = seg[s].len, p = seg[s].prev;
        uint64_t d = UINT64_MAX;

        if (p >= 0) {
            d = (uint64_t)(ranges_prefix(&r, at) - ranges_prefix(&r, p + 1));
            ranges_add(&r, p, p + len, -1);
        }
        ranges_add(&r, at, at + len, 1);
        for (int64_t j = 0; j < len; j++)
            dist_out[at + j] = d;
    }
    rc = 0;
out:
    free(seg);
    free(coords);
    free(t1);
    free(t2);
    return rc;
}

static int distances(const int64_t *ids, uint64_t n, uint64_t id_space, uint64_t *dist_out)
{
    int64_t *last;
    int rc;

    if ((!ids || !dist_out) && n)
        return -EINVAL;
    for (uint64_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint64_t)ids[i] >= id_space)
            return -EINVAL;
    if (n > (uint64_t)INT32_MAX)
        return -E2BIG; /* the plain form's tree counts in int32 */
    last = malloc((id_space ? id_space : 1) * sizeof(*last));
    if (!last)
        return -ENOMEM;
    memset(last, 0xff, (id_space ? id_space : 1) * sizeof(*last)); /* -1: not referenced yet */
    rc = distances_segments(ids, n, last, dist_out);
    if (rc == 1) {
        memset(last, 0xff, (id_space ? id_space : 1) * sizeof(*last));
        rc = distances_plain(ids, n, last, dist_out);
    }
    free(last);
    return rc;
}

int kv_stack_distances(const int64_t *ids, uint64_t n, uint64_t id_space, uint64_t *dist_out)
{
    return distances(ids, n, id_space, dist_out);
}

int64_t kv_prefix_thresholds(const int64_t *ids, uint64_t n, uint64_t id_space, const int64_t *offsets,
                             uint64_t n_req, int64_t clamp, int64_t *thr_out)
{
    uint64_t *dist = (uint64_t *)thr_out;
    int64_t unique = 0;
    int rc;

    if (!offsets || clamp < 0 || offsets[0] != 0 || (uint64_t)offsets[n_req] != n)
        return -EINVAL;
    for (uint64_t r = 0; r < n_req; r++)
        if (offsets[r + 1] < offsets[r])
            return -EINVAL;
    rc = distances(ids, n, id_space, dist);
    if (rc < 0)
        return rc;
    for (uint64_t r = 0; r < n_req; r++) {
        int64_t run = 0;

        for (int64_t j = offsets[r]; j < offsets[r + 1]; j++) {
            uint64_t d = dist[j];
            int64_t v;

            unique += d == UINT64_MAX;
            v = d >= (uint64_t)clamp ? clamp : (int64_t)d;
            if (v > run)
                run = v;
            thr_out[j] = run;
        }
    }
    return unique;
}
