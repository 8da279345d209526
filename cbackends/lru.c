/*
 * lru.c - the tier's own slot allocator: an arena the size of the tier, whose
 * slots are reused as the tier evicts, least recently used first (see
 * kv_lru_map in kvemu.h). O(1) per key: a slot per resident key, a doubly
 * linked recency list over slots, and the map from key to slot.
 */
#include <errno.h>
#include <stdlib.h>

#include "kvemu.h"

#define KV_LRU_NONE UINT32_MAX

struct kv_lru {
    uint64_t capacity, key_space, used;
    uint32_t *slot_of;      /* [key_space]: the key's slot, KV_LRU_NONE when not resident */
    int64_t *key_of;        /* [capacity] */
    uint32_t *prev, *next;  /* [capacity]: recency list, head = most recent */
    uint32_t *mapped, *inserted;    /* [capacity]: epoch of the call that last mapped / inserted it */
    uint32_t head, tail, epoch;
    uint64_t overflow;      /* keys evicted by a later key of the call that mapped them */
};

struct kv_lru *kv_lru_new(uint64_t capacity, uint64_t key_space)
{
    struct kv_lru *l;

    if (capacity == 0 || capacity >= KV_LRU_NONE || key_space == 0 || key_space > (1ull << 40))
        return NULL;
    l = calloc(1, sizeof(*l));
    if (!l)
        return NULL;
    l->capacity = capacity;
    l->key_space = key_space;
    l->slot_of = malloc(key_space * sizeof(*l->slot_of));
    l->key_of = malloc(capacity * sizeof(*l->key_of));
    l->prev = malloc(capacity * sizeof(*l->prev));
    l->next = malloc(capacity * sizeof(*l->next));
    l->mapped = calloc(capacity, sizeof(*l->mapped));
    l->inserted = calloc(capacity, sizeof(*l->inserted));
    if (!l->slot_of || !l->key_of || !l->prev || !l->next || !l->mapped || !l->inserted) {
        kv_lru_free(l);
        return NULL;
    }
    for (uint64_t k = 0; k < key_space; k++)
        l->slot_of[k] = KV_LRU_NONE;
    l->head = l->tail = KV_LRU_NONE;
    return l;
}

void kv_lru_free(struct kv_lru *l)
{
    if (!l)
        return;
    free(l->slot_of);
    free(l->key_of);
    free(l->prev);
    free(l->next);
    free(l->mapped);
    free(l->inserted);
    free(l);
}

static void lru_unlink(struct kv_lru *l, uint32_t s)
{
    if (l->prev[s] != KV_LRU_NONE)
        l->next[l->prev[s]] = l->next[s];
    else
        l->head = l->next[s];
    if (l->next[s] != KV_LRU_NONE)
        l->prev[l->next[s]] = l->prev[s];
    else
        l->tail = l->prev[s];
}

static void lru_push_front(struct kv_lru *l, uint32_t s)
{
    l->prev[s] = KV_LRU_NONE;
    l->next[s] = l->head;
    if (l->head != KV_LRU_NONE)
        l->prev[l->head] = s;
    l->head = s;
    if (l->tail == KV_LRU_NONE)
        l->tail = s;
}

int64_t kv_lru_map(struct kv_lru *l, const int64_t *keys, uint64_t n, uint32_t *slots_out,
                   uint8_t *fresh_out)
{
    uint64_t evicted = 0;

    if (!l || (n && (!keys || !slots_out || !fresh_out)))
        return -EINVAL;
    for (uint64_t i = 0; i < n; i++)
        if (keys[i] < 0 || (uint64_t)keys[i] >= l->key_space)
            return -EINVAL;
    if (++l->epoch == 0)
        l->epoch = 1;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t k = (uint64_t)keys[i];
        uint32_t s = l->slot_of[k];

        if (s != KV_LRU_NONE) {
            lru_unlink(l, s);
        } else if (l->used < l->capacity) {
            s = (uint32_t)l->used++;
            l->inserted[s] = l->epoch;
        } else {
            s = l->tail;
            /*
             * Every slot holds a key of this call: its keys do not fit the tier, so
             * they evict one another in order, as they would enter a tier of this
             * size (the least recently used first: the call's earliest keys).
             */
            if (l->mapped[s] == l->epoch)
                l->overflow++;
            lru_unlink(l, s);
            l->slot_of[l->key_of[s]] = KV_LRU_NONE;
            l->inserted[s] = l->epoch;
            evicted++;
        }
        l->slot_of[k] = s;
        l->key_of[s] = (int64_t)k;
        l->mapped[s] = l->epoch;
        lru_push_front(l, s);
        slots_out[i] = s;
        fresh_out[i] = l->inserted[s] == l->epoch;
    }
    return (int64_t)evicted;
}

uint64_t kv_lru_resident(const struct kv_lru *l)
{
    return l ? l->used : 0;
}

uint64_t kv_lru_overflow(const struct kv_lru *l)
{
    return l ? l->overflow : 0;
}
