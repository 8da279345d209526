/*
 * fuzz_replay.c - random batches into kv_replay under AddressSanitizer and
 * UndefinedBehaviorSanitizer. Every call must either replay (return n_steps)
 * or fail with -EINVAL and a message; any memory error aborts the run.
 *
 * usage: fuzz_replay ITERATIONS SEED
 * Built and run by tests/test_c_fuzz.py (short) and tools/fuzz_campaign.py (long).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvemu.h"

static uint64_t rng_state;

static uint64_t rnd(void)
{
    /* xorshift64*: deterministic per seed, no libc rand() state */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static uint32_t pick(uint32_t n) { return n ? (uint32_t)(rnd() % n) : 0; }

/* Mostly valid values, sometimes just out of range, rarely absurd. */
static uint32_t fuzz_u32(uint32_t valid_max)
{
    uint32_t r = pick(100);

    if (r < 85)
        return pick(valid_max + 1);
    if (r < 97)
        return valid_max + 1 + pick(3);
    return (uint32_t)rnd();
}

int main(int argc, char **argv)
{
    long iters = argc > 1 ? atol(argv[1]) : 1000;
    long ok = 0, refused = 0;
    struct kv_ctx *ctx;
    struct kv_geom g = { .block_bytes = 256, .n_slots = 16, .n_layers_model = 6, .n_layers_replay = 3 };

    rng_state = argc > 2 ? strtoull(argv[2], NULL, 10) * 2654435761ull + 1 : 88172645463325252ull;
    ctx = kv_ctx_new();
    if (!ctx || kv_backend_open(ctx, "dram", "") < 0 || kv_prepare(ctx, &g) < 0) {
        fprintf(stderr, "setup failed: %s\n", ctx ? kv_errmsg(ctx) : "no ctx");
        return 2;
    }
    for (long it = 0; it < iters; it++) {
        uint32_t n_req = 1 + pick(6), n_steps = pick(5), n_entries = pick(12);
        uint64_t table_off[8], n_table; /* at most 6 requests x 8 blocks < 64 slots */
        uint32_t slots[64], span[3] = { 2, 2, 2 };
        struct kv_step steps[5];
        struct kv_entry entries[12];
        struct kv_step_out so[5];
        struct kv_entry_out eo[12];
        struct kv_layer layer[3];
        struct kv_req req[8];
        struct kv_layers kv = { .layer = layer, .req = req, .block_tokens = 1 + pick(32),
                                .checkpoint_blocks = pick(5), .store_all = pick(2) };
        int64_t rc;

        /* Half the calls with per-layer KV kinds: mostly valid tables, sometimes not. */
        for (uint32_t j = 0; j < 3; j++) {
            uint32_t kind = pick(100) < 95 ? pick(4) : 4 + pick(3);

            layer[j] = (struct kv_layer){ .kind = kind };
            /* whole lines mostly; an odd size now and then, which must be refused */
            if (kind == KV_LAYER_LINEAR)
                layer[j].state_bytes = 64 * (1 + fuzz_u32((uint32_t)(g.n_slots * g.block_bytes / 64) - 1)) +
                                       (pick(20) ? 0 : 1);
            else
                layer[j].block_bytes = 64 * (1 + fuzz_u32((uint32_t)g.block_bytes / 64 - 1)) + (pick(20) ? 0 : 1);
            if (kind == KV_LAYER_SLIDING || kind == KV_LAYER_CHUNKED)
                layer[j].window_tokens = 1 + pick(200);
        }
        for (uint32_t r = 0; r < 8; r++)
            req[r] = (struct kv_req){ .base_block = pick(4) ? pick(40) : (uint32_t)rnd(),
                                      .prompt_blocks = pick(4) ? pick(40) : (uint32_t)rnd(),
                                      .all_layers = pick(10) ? 0 : fuzz_u32(1) };

        table_off[0] = 0;
        for (uint32_t r = 0; r < n_req; r++)
            table_off[r + 1] = table_off[r] + pick(9);
        n_table = table_off[n_req];
        for (uint64_t i = 0; i < 64; i++)
            slots[i] = pick((uint32_t)g.n_slots);
        /* A valid batch first: ranges inside each request's table, steps tiling the entries. */
        for (uint32_t e = 0; e < n_entries; e++) {
            uint32_t r = pick(n_req), len = (uint32_t)(table_off[r + 1] - table_off[r]);
            uint32_t *f[3] = { &entries[e].load_first, &entries[e].store_first, &entries[e].read_first };
            uint32_t *c[3] = { &entries[e].load_count, &entries[e].store_count, &entries[e].read_count };

            entries[e].req = r;
            for (int op = 0; op < 3; op++) {
                *f[op] = pick(len + 1);
                *c[op] = pick(len - *f[op] + 1);
            }
        }
        for (uint32_t s = 0, at = 0; s < n_steps; s++) {
            uint32_t len = s + 1 == n_steps ? n_entries - at : pick(n_entries - at + 1);

            steps[s].entry_begin = at;
            steps[s].entry_end = at + len;
            steps[s].compute_ns = (int64_t)pick(100000);
            at += len;
        }
        /* Then, half the time, one to three corruptions. */
        for (uint32_t m = pick(2) ? 1 + pick(3) : 0; m > 0; m--) {
            uint32_t e = pick(n_entries), s = pick(n_steps);

            switch (pick(8)) {
            case 0: slots[pick(64)] = fuzz_u32((uint32_t)g.n_slots - 1); break;
            case 1: if (n_entries) entries[e].req = fuzz_u32(n_req); break;
            case 2: if (n_entries) entries[e].load_count = fuzz_u32(12); break;
            case 3: if (n_entries) entries[e].read_first = (uint32_t)rnd(); break;
            case 4: if (n_steps) steps[s].entry_end = fuzz_u32(n_entries + 1); break;
            case 5: if (n_steps) steps[s].compute_ns = -1 - (int64_t)pick(5); break;
            case 6: span[pick(3)] = pick(4); break;
            default: table_off[1 + pick(n_req)] += 1 + pick(5); break;
            }
        }
        rc = kv_replay(ctx, table_off, n_req, slots, n_table, steps, n_steps, entries, n_entries, span,
                       pick(2) ? &kv : NULL,
                       so, pick(4) ? eo : NULL);
        if (rc == (int64_t)n_steps) {
            ok++;
        } else if (rc == -EINVAL && kv_errmsg(ctx)[0]) {
            refused++;
        } else {
            fprintf(stderr, "iteration %ld: unexpected rc %lld (%s)\n", it, (long long)rc, kv_errmsg(ctx));
            return 1;
        }
    }
    kv_ctx_free(ctx);
    printf("ok %ld replayed %ld refused %ld\n", iters, ok, refused);
    return 0;
}
