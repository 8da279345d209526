/*
 * stackdist.c - LRU stack distances of a reference stream (Mattson et al., 1970),
 * for the capacity analysis: a reference hits in an LRU cache of C blocks exactly
 * when fewer than C distinct other blocks were referenced since the previous
 * reference to the same block. One pass, O(n log n), with a Fenwick tree over
 * reference positions that marks each block's latest reference.
 */
#include <errno.h>
#include <stdlib.h>

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

int kv_stack_distances(const int64_t *ids, uint64_t n, uint64_t id_space, uint64_t *dist_out)
{
    int64_t *last;
    int32_t *tree;

    if ((!ids || !dist_out) && n)
        return -EINVAL;
    for (uint64_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint64_t)ids[i] >= id_space)
            return -EINVAL;
    if (n > (uint64_t)INT32_MAX)
        return -E2BIG; /* the tree counts in int32 */
    last = malloc((id_space ? id_space : 1) * sizeof(*last));
    tree = calloc(n ? n : 1, sizeof(*tree));
    if (!last || !tree) {
        free(last);
        free(tree);
        return -ENOMEM;
    }
    for (uint64_t b = 0; b < id_space; b++)
        last[b] = -1;
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
    free(last);
    free(tree);
    return 0;
}
