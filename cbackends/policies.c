/*
 * policies.c - FIFO and optimal (Belady's MIN) caches over a reference stream, for
 * the capacity analysis: one simulation per capacity, each reference O(1) for FIFO
 * (a ring of the cached blocks in insertion order) and O(log n) for MIN (a lazy
 * max-heap of next-reference positions; an entry is stale once its block was
 * referenced again or left the cache, and is dropped when it reaches the top),
 * and S3-FIFO (kvemu/policies/s3fifo.py states the rules; this loop is its fast
 * path: rings for the small and main FIFOs, an append-only queue with lazy
 * deletion for the ghost FIFO, a 2-bit frequency per block).
 */
#include <errno.h>
#include <stdlib.h>

#include "kvemu.h"

static int64_t fifo_hits(const int64_t *ids, uint64_t n, uint64_t id_space, uint64_t capacity, uint8_t *hit)
{
    uint8_t *cached = calloc(id_space ? id_space : 1, 1);
    uint64_t ring_len = capacity < n ? capacity : n;
    int64_t *ring = malloc((ring_len ? ring_len : 1) * sizeof(*ring));
    uint64_t head = 0, count = 0;
    int64_t hits = 0;

    if (!cached || !ring) {
        free(cached);
        free(ring);
        return -ENOMEM;
    }
    for (uint64_t i = 0; i < n; i++) {
        int64_t b = ids[i];

        hit[i] = cached[b];
        if (cached[b]) {
            hits++;
            continue;
        }
        if (!ring_len)
            continue;
        if (count == ring_len) { /* the oldest insertion leaves; its place takes the new one */
            cached[ring[head]] = 0;
            ring[head] = b;
            head = (head + 1) % ring_len;
        } else {
            ring[(head + count) % ring_len] = b;
            count++;
        }
        cached[b] = 1;
    }
    free(cached);
    free(ring);
    return hits;
}

/* Max-heap of keys; a key k < n is the position of a block's next reference (the block is ids[k]),
 * a key n + i stands for "never again" for the block referenced at i (ids[i]). */
static void heap_push(uint64_t *heap, uint64_t *len, uint64_t key)
{
    uint64_t i = (*len)++;

    while (i > 0 && heap[(i - 1) / 2] < key) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap[i] = key;
}

static void heap_pop(uint64_t *heap, uint64_t *len)
{
    uint64_t key = heap[--(*len)], i = 0, n = *len;

    for (;;) {
        uint64_t c = 2 * i + 1;

        if (c >= n)
            break;
        if (c + 1 < n && heap[c + 1] > heap[c])
            c++;
        if (heap[c] <= key)
            break;
        heap[i] = heap[c];
        i = c;
    }
    if (n)
        heap[i] = key;
}

static int64_t optimal_hits(const int64_t *ids, uint64_t n, uint64_t id_space, uint64_t capacity, uint8_t *hit)
{
    uint64_t space = id_space ? id_space : 1, len = 0, count = 0;
    uint64_t *next = malloc((n ? n : 1) * sizeof(*next));
    uint64_t *heap = malloc((n ? n : 1) * sizeof(*heap));
    uint64_t *cur = malloc(space * sizeof(*cur)); /* a cached block's key, UINT64_MAX when not cached */
    int64_t hits = 0;

    if (!next || !heap || !cur) {
        free(next);
        free(heap);
        free(cur);
        return -ENOMEM;
    }
    for (uint64_t b = 0; b < space; b++)
        cur[b] = UINT64_MAX; /* first as "not seen after", for the backward pass */
    for (uint64_t i = n; i-- > 0;) {
        int64_t b = ids[i];

        next[i] = cur[b] == UINT64_MAX ? n + i : cur[b];
        cur[b] = i;
    }
    for (uint64_t b = 0; b < space; b++)
        cur[b] = UINT64_MAX;
    for (uint64_t i = 0; i < n; i++) {
        int64_t b = ids[i];
        uint64_t key = next[i];

        hit[i] = cur[b] != UINT64_MAX;
        if (hit[i]) {
            hits++;
            cur[b] = key; /* the heap's old entry for b is now stale */
            heap_push(heap, &len, key);
            continue;
        }
        if (!capacity)
            continue;
        if (count == capacity) {
            uint64_t top, victim;

            for (;;) { /* the furthest next reference among the cached blocks */
                top = heap[0];
                victim = (uint64_t)ids[top < n ? top : top - n];
                if (cur[victim] == top)
                    break;
                heap_pop(heap, &len);
            }
            if (top < key)
                continue; /* the missed block is needed last (or never): it is not stored */
            heap_pop(heap, &len);
            cur[victim] = UINT64_MAX;
            count--;
        }
        cur[b] = key;
        heap_push(heap, &len, key);
        count++;
    }
    free(next);
    free(heap);
    free(cur);
    return hits;
}

/* S3-FIFO: where each block is (0 not held, 1 small, 2 main), its frequency (0..3); small and main
 * are rings of `cap` slots (together they never hold more than the capacity); the ghost is a queue
 * of every block ever sent there (at most one per miss, so n slots), an entry live while gpos[block]
 * is its index. */
struct ring {
    int64_t *v;
    uint64_t cap, head, len; /* v[head] is the tail (oldest) */
};

static void ring_push(struct ring *r, int64_t b)
{
    r->v[(r->head + r->len) % r->cap] = b;
    r->len++;
}

static int64_t ring_pop(struct ring *r)
{
    int64_t b = r->v[r->head];

    r->head = (r->head + 1) % r->cap;
    r->len--;
    return b;
}

struct s3 {
    uint8_t *where, *freq;
    uint64_t *gpos;
    int64_t *gq;
    uint64_t ghead, gtail, glive, main_cap;
    struct ring small, main;
};

static void s3_evict_main(struct s3 *c)
{
    while (c->main.len) {
        int64_t t = ring_pop(&c->main);

        if (c->freq[t]) {
            c->freq[t]--;
            ring_push(&c->main, t);
        } else {
            c->where[t] = 0;
            return;
        }
    }
}

static void s3_evict_small(struct s3 *c)
{
    while (c->small.len) {
        int64_t t = ring_pop(&c->small);

        if (c->freq[t]) {
            c->freq[t] = 0;
            c->where[t] = 2;
            ring_push(&c->main, t);
            if (c->main.len > c->main_cap)
                s3_evict_main(c);
        } else {
            c->where[t] = 0;
            c->gpos[t] = c->gtail;
            c->gq[c->gtail++] = t;
            c->glive++;
            while (c->glive > c->main_cap) { /* the oldest live ghost leaves */
                int64_t g = c->gq[c->ghead];

                if (c->gpos[g] == c->ghead) {
                    c->gpos[g] = UINT64_MAX;
                    c->glive--;
                }
                c->ghead++;
            }
            return;
        }
    }
}

static int64_t s3fifo_hits(const int64_t *ids, uint64_t n, uint64_t id_space, uint64_t capacity, uint8_t *hit)
{
    uint64_t space = id_space ? id_space : 1, slots = capacity < n ? capacity : n;
    uint64_t small_cap = (capacity + 9) / 10;
    struct s3 c = {0};
    int64_t hits = 0;

    slots = slots ? slots : 1;
    c.main_cap = capacity - small_cap;
    c.where = calloc(space, 1);
    c.freq = calloc(space, 1);
    c.gpos = malloc(space * sizeof(*c.gpos));
    c.gq = malloc((n ? n : 1) * sizeof(*c.gq));
    c.small = (struct ring){malloc(slots * sizeof(int64_t)), slots, 0, 0};
    c.main = (struct ring){malloc(slots * sizeof(int64_t)), slots, 0, 0};
    if (!c.where || !c.freq || !c.gpos || !c.gq || !c.small.v || !c.main.v) {
        hits = -ENOMEM;
        goto out;
    }
    for (uint64_t b = 0; b < space; b++)
        c.gpos[b] = UINT64_MAX;
    for (uint64_t i = 0; i < n; i++) {
        int64_t b = ids[i];

        hit[i] = c.where[b] != 0;
        if (hit[i]) {
            hits++;
            if (c.freq[b] < 3)
                c.freq[b]++;
            continue;
        }
        if (!capacity)
            continue;
        while (c.small.len + c.main.len >= capacity) {
            if (c.small.len >= small_cap || !c.main.len)
                s3_evict_small(&c);
            else
                s3_evict_main(&c);
        }
        c.freq[b] = 0;
        if (c.gpos[b] != UINT64_MAX) { /* remembered by the ghost: into main */
            c.gpos[b] = UINT64_MAX;
            c.glive--;
            c.where[b] = 2;
            ring_push(&c.main, b);
        } else {
            c.where[b] = 1;
            ring_push(&c.small, b);
        }
    }
out:
    free(c.where);
    free(c.freq);
    free(c.gpos);
    free(c.gq);
    free(c.small.v);
    free(c.main.v);
    return hits;
}

int64_t kv_policy_hits(const int64_t *ids, uint64_t n, uint64_t id_space, uint64_t capacity, int policy,
                       uint8_t *hit_out)
{
    if ((!ids || !hit_out) && n)
        return -EINVAL;
    for (uint64_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint64_t)ids[i] >= id_space)
            return -EINVAL;
    if (policy == KV_POLICY_FIFO)
        return fifo_hits(ids, n, id_space, capacity, hit_out);
    if (policy == KV_POLICY_OPTIMAL)
        return optimal_hits(ids, n, id_space, capacity, hit_out);
    if (policy == KV_POLICY_S3FIFO)
        return s3fifo_hits(ids, n, id_space, capacity, hit_out);
    return -EINVAL;
}
