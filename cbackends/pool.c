/*
 * pool.c - the engine's block pool's reference counts (kv_pool in kvemu.h): a
 * hash map from block id to a node holding the block's count of running
 * requests, and a doubly linked list, in the order they became unused, of the
 * blocks no request uses (the least recently used first). Every operation is
 * O(1) per block; a call takes a batch of blocks. The Python side
 * (engine/pool.py's BlockPool) keeps the capacity and the reserved blocks.
 */
#include <errno.h>
#include <stdlib.h>

#include "kvemu.h"

#define NONE (-1)

struct kv_pool {
    int64_t *key;               /* [cap]: node -> block id */
    int32_t *ref, *prev, *next; /* [cap]: its count; its neighbours on the unused list (next: free list too) */
    int32_t *slot;              /* [mask + 1]: hash table of nodes, NONE where empty */
    uint64_t mask;
    int32_t cap, free_head;
    int32_t head, tail;         /* the unused list: head first to go */
    uint64_t registered, idle;
};

static uint64_t home(const struct kv_pool *p, int64_t key)
{
    uint64_t h = (uint64_t)key * 0x9e3779b97f4a7c15ull;
    return (h ^ (h >> 29)) & p->mask;
}

/* The table position holding `key`'s node, or its empty position when absent (*found 0). */
static uint64_t find(const struct kv_pool *p, int64_t key, int *found)
{
    uint64_t i = home(p, key);
    while (p->slot[i] != NONE) {
        if (p->key[p->slot[i]] == key) {
            *found = 1;
            return i;
        }
        i = (i + 1) & p->mask;
    }
    *found = 0;
    return i;
}

static int grow_table(struct kv_pool *p, uint64_t size)
{
    int32_t *slot = malloc(size * sizeof(*slot));
    if (!slot)
        return -ENOMEM;
    for (uint64_t i = 0; i < size; i++)
        slot[i] = NONE;
    int32_t *old = p->slot;
    uint64_t old_size = old ? p->mask + 1 : 0;
    p->slot = slot;
    p->mask = size - 1;
    for (uint64_t i = 0; i < old_size; i++) {
        if (old[i] == NONE)
            continue;
        uint64_t j = home(p, p->key[old[i]]);
        while (slot[j] != NONE)
            j = (j + 1) & p->mask;
        slot[j] = old[i];
    }
    free(old);
    return 0;
}

static int grow_nodes(struct kv_pool *p)
{
    if (p->cap >= (INT32_MAX >> 1))
        return -ENOMEM;
    int32_t cap = p->cap ? 2 * p->cap : 1024;
    int64_t *key = realloc(p->key, cap * sizeof(*key));
    if (key)
        p->key = key;
    int32_t *ref = realloc(p->ref, cap * sizeof(*ref));
    if (ref)
        p->ref = ref;
    int32_t *prev = realloc(p->prev, cap * sizeof(*prev));
    if (prev)
        p->prev = prev;
    int32_t *next = realloc(p->next, cap * sizeof(*next));
    if (next)
        p->next = next;
    if (!key || !ref || !prev || !next)
        return -ENOMEM;
    for (int32_t n = cap - 1; n >= p->cap; n--) {  /* the new nodes onto the free list */
        p->next[n] = p->free_head;
        p->free_head = n;
    }
    p->cap = cap;
    return grow_table(p, 4 * (uint64_t)cap);   /* at most half full */
}

/* A node for `key` (absent; its table position `i`) with count 0, not on the unused list. */
static int32_t insert(struct kv_pool *p, int64_t key, uint64_t i)
{
    if (p->free_head == NONE) {
        if (grow_nodes(p) < 0)
            return NONE;
        int found;
        i = find(p, key, &found);
    }
    int32_t n = p->free_head;
    p->free_head = p->next[n];
    p->key[n] = key;
    p->ref[n] = 0;
    p->prev[n] = p->next[n] = NONE;
    p->slot[i] = n;
    p->registered++;
    return n;
}

/* Drops the node at table position `i` (linear probing's backward-shift deletion). */
static void erase(struct kv_pool *p, uint64_t i)
{
    int32_t n = p->slot[i];
    p->next[n] = p->free_head;
    p->free_head = n;
    p->registered--;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & p->mask;
        if (p->slot[j] == NONE)
            break;
        uint64_t k = home(p, p->key[p->slot[j]]);
        /* the entry at j may move to i unless its home lies cyclically in (i, j] */
        if ((j > i && (k <= i || k > j)) || (j < i && k <= i && k > j)) {
            p->slot[i] = p->slot[j];
            i = j;
        }
    }
    p->slot[i] = NONE;
}

static void unlink_unused(struct kv_pool *p, int32_t n)
{
    if (p->prev[n] != NONE)
        p->next[p->prev[n]] = p->next[n];
    else
        p->head = p->next[n];
    if (p->next[n] != NONE)
        p->prev[p->next[n]] = p->prev[n];
    else
        p->tail = p->prev[n];
    p->prev[n] = p->next[n] = NONE;
    p->idle--;
}

static void append_unused(struct kv_pool *p, int32_t n)
{
    p->prev[n] = p->tail;
    p->next[n] = NONE;
    if (p->tail != NONE)
        p->next[p->tail] = n;
    else
        p->head = n;
    p->tail = n;
    p->idle++;
}

struct kv_pool *kv_pool_new(void)
{
    struct kv_pool *p = calloc(1, sizeof(*p));
    if (!p)
        return NULL;
    p->free_head = p->head = p->tail = NONE;
    if (grow_nodes(p) < 0) {
        kv_pool_free(p);
        return NULL;
    }
    return p;
}

void kv_pool_free(struct kv_pool *p)
{
    if (!p)
        return;
    free(p->key);
    free(p->ref);
    free(p->prev);
    free(p->next);
    free(p->slot);
    free(p);
}

uint64_t kv_pool_prefix_hit(const struct kv_pool *p, const int64_t *ids, uint64_t n, uint64_t *idle_out)
{
    uint64_t k = 0, idle = 0;
    int found;
    for (; k < n; k++) {
        uint64_t i = find(p, ids[k], &found);
        if (!found)
            break;
        idle += p->ref[p->slot[i]] == 0;
    }
    *idle_out = idle;
    return k;
}

int kv_pool_pin(struct kv_pool *p, const int64_t *ids, uint64_t n)
{
    int found;
    for (uint64_t k = 0; k < n; k++) {
        uint64_t i = find(p, ids[k], &found);
        if (!found)
            return -ENOENT;
        int32_t b = p->slot[i];
        if (p->ref[b] == 0)
            unlink_unused(p, b);
        p->ref[b]++;
    }
    return 0;
}

int kv_pool_register(struct kv_pool *p, const int64_t *ids, uint64_t n)
{
    int found;
    for (uint64_t k = 0; k < n; k++) {
        uint64_t i = find(p, ids[k], &found);
        int32_t b;
        if (!found) {
            b = insert(p, ids[k], i);
            if (b == NONE)
                return -ENOMEM;
        } else {
            b = p->slot[i];
            if (p->ref[b] == 0)
                unlink_unused(p, b);
        }
        p->ref[b]++;
    }
    return 0;
}

int kv_pool_unregister(struct kv_pool *p, const int64_t *ids, uint64_t n)
{
    int found;
    for (uint64_t k = 0; k < n; k++) {
        uint64_t i = find(p, ids[k], &found);
        if (!found || p->ref[p->slot[i]] <= 0)
            return -ENOENT;
        if (--p->ref[p->slot[i]] == 0)
            erase(p, i);
    }
    return 0;
}

int kv_pool_release(struct kv_pool *p, const int64_t *ids, uint64_t n)
{
    int found;
    for (uint64_t k = n; k-- > 0;) {
        uint64_t i = find(p, ids[k], &found);
        if (!found || p->ref[p->slot[i]] <= 0)
            return -ENOENT;
        int32_t b = p->slot[i];
        if (--p->ref[b] == 0)
            append_unused(p, b);
    }
    return 0;
}

uint64_t kv_pool_evict(struct kv_pool *p, uint64_t n)
{
    uint64_t k = 0;
    int found;
    for (; k < n && p->head != NONE; k++) {
        int32_t b = p->head;
        unlink_unused(p, b);
        erase(p, find(p, p->key[b], &found));
    }
    return k;
}

uint64_t kv_pool_registered(const struct kv_pool *p)
{
    return p->registered;
}

uint64_t kv_pool_idle(const struct kv_pool *p)
{
    return p->idle;
}

int64_t kv_pool_ref(const struct kv_pool *p, int64_t id)
{
    int found;
    uint64_t i = find(p, id, &found);
    return found ? p->ref[p->slot[i]] : -1;
}

uint64_t kv_pool_dump(const struct kv_pool *p, int64_t *ids_out, int64_t *refs_out, uint64_t cap)
{
    uint64_t k = 0;
    for (uint64_t i = 0; i <= p->mask && k < cap; i++) {
        if (p->slot[i] == NONE)
            continue;
        ids_out[k] = p->key[p->slot[i]];
        refs_out[k] = p->ref[p->slot[i]];
        k++;
    }
    return k;
}
