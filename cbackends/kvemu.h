/*
 * kvemu.h - public API of the kvemu replay core.
 *
 * A trace is replayed as a batch of engine steps. Each step lists entries (one
 * request of the batch), and each entry names three contiguous ranges of
 * positions in that request's block table: blocks to load (tier -> staging),
 * blocks to store (staging -> tier) and blocks to read in place. Python maps
 * block ids to arena slots; this API sees slots only.
 *
 * Conventions (liburing's): functions return a count >= 0 or -errno, and the
 * human-readable reason for the last failure is kept in the context
 * (kv_errmsg). There is no global state: everything lives in a kv_ctx, and a
 * kv_ctx is used by one thread at a time.
 *
 * The region between the cffi markers is fed verbatim to cffi's cdef by
 * cbackends/build_ffi.py, so Python and C read one declaration of each struct.
 * Keep it to what cffi parses: integer #defines, enums, structs, prototypes.
 */
#ifndef KVEMU_H
#define KVEMU_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cffi-cdef-begin */

#define KV_ABI_VERSION 6      /* bump on any change of the structs or functions below */
#define KV_OPS_VERSION 1      /* version of struct kv_backend_ops */

enum kv_op { KV_OP_LOAD = 0, KV_OP_STORE = 1, KV_OP_READ = 2, KV_N_OPS = 3 };

/* Regions kv_debug_peek/kv_debug_poke address. */
enum kv_region { KV_REGION_ARENA = 0, KV_REGION_STAGING = 1 };

struct kv_ctx;  /* opaque */

/*
 * One request of one step. Each (first, count) pair is a range of positions in
 * the request's block table: positions first .. first+count-1.
 */
struct kv_entry {
    uint32_t req;
    uint32_t load_first, load_count;
    uint32_t store_first, store_count;
    uint32_t read_first, read_count;
};

/*
 * Entries [entry_begin, entry_end) form one engine step; steps may not overlap.
 * ready_ns: the earliest time the step may start on the context's timeline
 * (its requests' latest arrival); 0 when only the order of steps matters.
 */
struct kv_step {
    uint64_t entry_begin, entry_end;
    int64_t compute_ns;             /* GPU compute time of the whole step, all layers */
    int64_t ready_ns;
};

/*
 * KV times scaled to all model layers, each the larger of the tier's (medium)
 * time and the link's (struct kv_timing); step_ns composes them with
 * compute_ns. start_ns/end_ns place the step on the context's timeline
 * (start = max(previous end, ready_ns)); stall_ns is the part of step_ns the
 * step waited for asynchronous stores to drain (their bound on bytes in flight).
 */
struct kv_step_out {
    int64_t step_ns, load_ns, store_ns, read_ns;
    int64_t start_ns, end_ns, stall_ns;
};

/* This entry's own measured KV time, scaled to all model layers. */
struct kv_entry_out {
    int64_t load_ns, store_ns, read_ns;
};

/*
 * Arena geometry. The arena is layer-major over the replayed layers: the chunk
 * of (replayed layer j, slot s) lies at byte (j * n_slots + s) * block_bytes.
 * overlap: 0 = loads before each layer's compute, 1 = layer-wise pipelining.
 * chunk_blocks: the transfer unit of loads and stores; consecutive positions
 * of an entry whose slots are consecutive and in one chunk (slot / chunk_blocks
 * equal) move as one transfer of their blocks of one layer. 0 or 1: one
 * transfer per block (reads are always one access per block and layer).
 * reserved must be 0.
 */
struct kv_geom {
    uint64_t block_bytes;
    uint64_t n_slots;
    uint32_t n_layers_model;
    uint32_t n_layers_replay;
    uint32_t overlap;
    uint32_t chunk_blocks;
    uint32_t layout;
    uint32_t reserved;
};

/*
 * layout KV_LAYOUT_PER_LAYER: the arena is layer-major, as above, and loads
 * and stores move one layer of a chunk at a time. KV_LAYOUT_CROSS_LAYER (vLLM's
 * cross-layer blocks): slot-major, the chunk of (layer j, slot s) at byte
 * (s * n_layers_replay + j) * block_bytes, so a block's layers are contiguous;
 * loads and stores move a chunk's blocks of all layers as one transfer, loads
 * before the step's first layer and stores after its last; it needs every
 * model layer replayed (n_layers_replay == n_layers_model). Reads stay one
 * block of one layer, inside that layer's attention.
 */
enum { KV_LAYOUT_PER_LAYER = 0, KV_LAYOUT_CROSS_LAYER = 1 };

/*
 * How KV work is composed with compute (docs/replay.md). A context starts
 * with the CPU link (no link limit) and serial stores: times are the medium's.
 *
 * Link (GPU <-> tier): each backend batch of loads or stores takes
 *   link = bytes / gbps_dir + ceil(transfers / engines) * setup_ns
 * and an in-place read batch
 *   link = max(bytes / read_gbps, bytes * (read_latency_ns + tier_latency_ns)
 *                                  / (outstanding * line_bytes))      (Little's law)
 * and is charged max(medium, link), medium being the backend's busy time.
 * A gbps of 0 means no link limit on that op. A staged tier (storage reached
 * by I/O: NVMe, RDMA into a host buffer, then a copy to the GPU) moves each
 * transfer over the medium and then the link, in series, pipelined across the
 * batch's n transfers: max(medium, link) + min(medium, link) / n.
 *
 * store_mode 0 (serial): stores of layer l run after its compute, in one
 * stream, and the step ends when its last compute and its last store are done
 * (overlap 0: step = compute + all fetches + all stores). store_mode 1
 * (async, as vLLM's OffloadingConnector and LMCache save KV): a layer's stores
 * are issued when its compute ends into a store stream that outlives the step
 * and overlaps later compute; the compute stream stalls only when issuing
 * would put more than store_inflight_bytes in flight. Reads (the resident
 * policy) are part of the layer's attention: compute_l + read_l.
 */
struct kv_timing {
    double load_gbps, store_gbps, read_gbps;    /* bytes per ns per direction; 0 = unlimited */
    double setup_ns;                /* per transfer, per copy engine */
    double read_latency_ns;         /* the link's round trip for an in-place read */
    double tier_latency_ns;         /* the tier medium's idle latency */
    uint32_t engines;               /* copy engines sharing a batch's transfers (>= 1) */
    uint32_t outstanding;           /* in-place line requests the GPU keeps in flight; 0 = no bound */
    uint32_t line_bytes;            /* bytes per in-place request (64, 128, ...) */
    uint32_t store_mode;            /* 0 serial, 1 async */
    uint64_t store_inflight_bytes;  /* async: bound on bytes in flight (>= 1) */
    uint32_t staged;                /* 1: storage reached by I/O, through a host bounce buffer */
    uint32_t reserved;              /* must be 0 */
};

/*
 * What each replayed layer caches, for models whose layers do not all cache
 * every token (kv_replay's kv argument; NULL: full attention in every layer,
 * each block geom.block_bytes). Positions below are a request's block-table
 * positions counted from its first block (base_block + the local position),
 * B = block_tokens, W = window_tokens, e = an op range's end:
 *   KV_LAYER_FULL:    every block of the range (full attention, MLA; with
 *                     DeepSeek-V3.2's indexer keys inside block_bytes).
 *   KV_LAYER_SLIDING: loads and reads from e - ceil(W / B); stores (store_all
 *                     0) only within the last ceil(W / B) blocks before
 *                     prompt_blocks, store_all 1 every block.
 *   KV_LAYER_CHUNKED: loads and reads from the first block of the chunk that
 *                     block e falls in ((e * B / W) * W / B); stores (store_all
 *                     0) those of prompt_blocks' chunk before prompt_blocks.
 *   KV_LAYER_LINEAR:  no blocks: one state of state_bytes per range that
 *                     loads or reads any block (a load with load_end set:
 *                     only the range that ends at load_end, the block the
 *                     state belongs to), and one per checkpoint a
 *                     store range passes (e / C - first / C, C =
 *                     checkpoint_blocks; 0: one per store range), each one
 *                     transfer at the arena offset of the range's last block
 *                     in that layer, moved back to fit inside the layer.
 * Each block moves the layer's block_bytes (a multiple of 64 up to
 * geom.block_bytes, the arena's stride); state_bytes is a multiple of 64 too.
 * A request's load_end, when not 0, stands for e in the load rules above (the
 * window of a split load is the whole load's), the range still bounding what
 * moves. A request with all_layers 1 (weights in the tier) moves
 * geom.block_bytes of every position in every layer whatever its kind.
 * reserved fields must be 0; the layout must be KV_LAYOUT_PER_LAYER.
 */
enum kv_layer_kind { KV_LAYER_FULL = 0, KV_LAYER_SLIDING = 1, KV_LAYER_CHUNKED = 2,
                     KV_LAYER_LINEAR = 3 };

struct kv_layer {
    uint32_t kind;
    uint32_t window_tokens;     /* sliding: tokens kept; chunked: tokens a chunk; else 0 */
    uint64_t block_bytes;       /* bytes one block of this layer moves; 0 for linear */
    uint64_t state_bytes;       /* linear: one request's state; else 0 */
};

struct kv_req {
    uint32_t base_block;        /* position, from the request's first block, of its local position 0 */
    uint32_t prompt_blocks;     /* full prompt blocks: where a store's window ends */
    uint32_t all_layers;        /* 1: every layer moves every position, geom.block_bytes each */
    uint32_t load_end;          /* loads: where the windows end (a prefix load split over several
                                   entries, a tier stack's levels: the whole load's end); 0: each
                                   range's own end; else at least every load range's end */
};

struct kv_layers {
    const struct kv_layer *layer;   /* [n_layers_replay] */
    const struct kv_req *req;       /* [n_req] */
    uint32_t block_tokens;
    uint32_t checkpoint_blocks;
    uint32_t store_all;             /* 1 (resident): windowed layers store every block */
    uint32_t reserved;
};

/* One block-layer access handed to a backend. staging_off is unused by reads. */
struct kv_access {
    uint64_t arena_off, staging_off, bytes;
};

/* NULL only on ENOMEM. Calibrates the timer (about 20 ms). */
struct kv_ctx *kv_ctx_new(void);

/*
 * Closes the backend, unmaps its memory, frees the context. NULL-safe. A
 * context other contexts are attached to (kv_prepare_attached) keeps its
 * arena, and the rest of its backend, until the last of them is freed too:
 * the caller may not use ctx again, but their replays never touch freed memory.
 */
void kv_ctx_free(struct kv_ctx *ctx);

/*
 * Asks the call running on ctx (in another thread) to stop: every wait and
 * long loop of the core and the backends (busy-waits of emulated tiers,
 * io_uring completion waits, pre-faulting, pointer chases, the replay's
 * batches) checks at least every 50 ms of its own time, and the call returns
 * -EINTR with "...: cancelled" as its message, leaving its outputs
 * unspecified. The only function that may be called on ctx while another
 * thread uses it. The cancel is not undone: every later kv_prepare,
 * kv_prepare_attached, kv_replay or kv_chase on ctx returns -EINTR at its
 * first check. NULL-safe.
 */
void kv_cancel(struct kv_ctx *ctx);

/* Message of the last failure on ctx, "" if none. Stays valid until the next call on ctx. */
const char *kv_errmsg(const struct kv_ctx *ctx);

/*
 * Opens backend `name` with its option string `args` ("" or NULL for defaults).
 * Backends and their args are documented in docs/backends.md: "dram", "numa"
 * (NODE[,...]), "mmap" (PATH[,...]), "uring" (PATH[,qd=N,...]), "emu" and "vemu"
 * (numeric profile args, resolved from a profile name by kvemu/backends.py).
 * Unknown name: -ENOENT; bad args: -EINVAL; a backend already open on ctx: -EBUSY.
 */
int kv_backend_open(struct kv_ctx *ctx, const char *name, const char *args);

/*
 * Validates the geometry (block_bytes > 0 and a multiple of 64, arena size
 * n_slots * n_layers_replay * block_bytes without overflow, 1 <= n_layers_replay
 * <= n_layers_model <= 65536) and has the backend allocate and pre-fault the
 * arena and a staging buffer of min(64 MiB, arena) rounded down to whole blocks,
 * at least one block. Once per context: a second call gives -EBUSY.
 */
int kv_prepare(struct kv_ctx *ctx, const struct kv_geom *g);

/*
 * Prepares ctx to replay another serving instance on owner's tier: the same
 * arena (one copy of every block, touched by every instance concurrently, each
 * from its own thread) with a staging buffer of its own. owner must be open on
 * the same backend, prepared with the same geometry g; it outlives ctx (see
 * kv_ctx_free).
 * -EOPNOTSUPP when the backend cannot share (uring), -EINVAL otherwise.
 */
int kv_prepare_attached(struct kv_ctx *ctx, const struct kv_geom *g, const struct kv_ctx *owner);

/*
 * Writes a JSON object of facts (backend, geometry, arena_bytes, staging_bytes,
 * timer "tsc" or "clock_gettime", tsc_ghz, and the backend's own facts such as
 * page_size, hugepage advice, prefaulted) into buf. Returns its length, or
 * -ENOSPC when len is too small.
 */
int kv_describe(struct kv_ctx *ctx, char *buf, size_t len);

/*
 * Replays n_steps steps; returns n_steps or -errno. Every argument is validated
 * before any memory is touched (-EINVAL with a precise message):
 *   table_off[n_req + 1]: CSR offsets into table_slots, table_off[0] == 0,
 *     non-decreasing, table_off[n_req] == n_table; request r's block table is
 *     table_slots[table_off[r] .. table_off[r+1]), every slot < n_slots.
 *   entries[n_entries]: req < n_req, every range within its request's table.
 *   steps[n_steps]: entry_begin <= entry_end <= n_entries, each step starting
 *     at or after the previous step's end, compute_ns >= 0.
 *   layer_span[n_layers_replay]: the model layers each replayed layer stands
 *     for, none 0, summing to n_layers_model; replayed layer j stands for the
 *     span_j consecutive model layers after those of layers 0 .. j-1.
 *   kv: NULL (every layer full attention) or what each replayed layer
 *     caches (struct kv_layers), checked as that struct documents.
 *   step_out[n_steps] is required; entry_out[n_entries] may be NULL.
 *
 * Per step and replayed layer: all loads of all entries, then all reads, then
 * all stores, in entry order, handed to the backend in batches of up to 256.
 * Loads and stores use successive blocks of the staging buffer, a cursor that
 * starts at 0 with the context and wraps when the next block would not fit.
 *
 * Composition per step, L = n_layers_model, each op's time the charged one
 * (max of medium and link, struct kv_timing), fetch_l = load + read time and
 * store_l = store time of the replayed layer standing for model layer l, and
 * comp_l = compute_ns / L with the remainder spread one ns each over the first
 * compute_ns % L layers. Serial stores (store_mode 0):
 *   overlap 0: step_ns = compute_ns + sum_l (fetch_l + store_l)
 *   overlap 1: fd_l = fd_{l-1} + fetch_l; ce_l = max(ce_{l-1}, fd_l) + comp_l;
 *              se_l = max(se_{l-1}, ce_l) + store_l; step_ns = max(ce_{L-1}, se_{L-1})
 * Async stores (store_mode 1), from start = max(previous end, ready_ns):
 *   overlap 0: ce_l = ce_{l-1} + load_l + comp_l + read_l
 *   overlap 1: fd_l = fd_{l-1} + load_l; ce_l = max(ce_{l-1}, fd_l) + comp_l + read_l
 *   then layer l's stores enter the store stream at ce_l (waiting first, while
 *   more than store_inflight_bytes would be in flight, for the oldest); the
 *   step ends at ce_{L-1}.
 * Sums saturate at INT64_MAX.
 */
int64_t kv_replay(struct kv_ctx *ctx,
                  const uint64_t *table_off, uint32_t n_req,
                  const uint32_t *table_slots, uint64_t n_table,
                  const struct kv_step *steps, uint64_t n_steps,
                  const struct kv_entry *entries, uint64_t n_entries,
                  const uint32_t *layer_span, const struct kv_layers *kv,
                  struct kv_step_out *step_out, struct kv_entry_out *entry_out);

/*
 * Sets the link model and the composition (struct kv_timing) for the next
 * kv_replay calls; -EINVAL for non-finite or negative numbers, engines or
 * line_bytes 0, store_mode > 1, or async stores with store_inflight_bytes 0.
 */
int kv_set_timing(struct kv_ctx *ctx, const struct kv_timing *t);

/*
 * Data-path totals of op since the last kv_stats_reset, into out6:
 * {transfers, bytes, medium_ns, link_ns, time_ns, medium_bound_ns}: backend
 * calls' busy time, the link's time for the same batches, what was charged
 * (their maximum), and the charged time of batches where the medium took
 * longer than a limiting link. Unscaled (replayed layers only). 0 or -EINVAL.
 */
int kv_datapath_stats(const struct kv_ctx *ctx, int op, uint64_t *out6);

/*
 * The context's timeline: *clock_ns the end of the last step replayed,
 * *stores_done_ns when the asynchronous stores issued so far complete, and
 * *inflight_bytes what is still in flight at the clock. 0 or -EINVAL.
 */
int kv_timeline(const struct kv_ctx *ctx, int64_t *clock_ns, int64_t *stores_done_ns,
                uint64_t *inflight_bytes);

/*
 * Latency histogram: values below 64 ns have a bucket each; above, every power
 * of two is split into 64 buckets (relative width <= 1/64) up to 2^40 ns; larger
 * values land in the last bucket. Lower bound of bucket i; UINT64_MAX past the end.
 */
uint32_t kv_hist_n_buckets(void);
uint64_t kv_hist_bucket_lower_ns(uint32_t i);

/*
 * Copies the latency histogram of op into counts (n_buckets must equal
 * kv_hist_n_buckets(); counts may be NULL) and, when totals4 is not NULL,
 * {accesses, bytes, time_ns, busy_ns} accumulated over all kv_replay calls
 * since the last kv_stats_reset: time_ns sums the accesses' latencies, busy_ns
 * the time the tier was busy with them (less than time_ns when a backend
 * keeps several accesses in flight). Returns 0 or -EINVAL (no message: ctx is
 * const).
 */
int kv_op_stats(const struct kv_ctx *ctx, int op, uint64_t *counts, uint32_t n_buckets,
                uint64_t *totals4);
void kv_stats_reset(struct kv_ctx *ctx);

/*
 * Idle latency of the prepared tier, as Intel MLC measures it: cache lines
 * spread evenly over the whole arena (every line, or every k-th so that there
 * are at most 4 Mi) are linked into one random cycle, and hops dependent loads
 * follow it after an untimed warm-up of min(hops / 8, 65536); *ns_per_hop gets
 * the mean time of one. The arena's contents are overwritten. A backend may measure this its own way
 * (emulated tiers apply their profile to each hop). Returns 0, -EINVAL before
 * prepare or for hops == 0, -EOPNOTSUPP when the tier is not host-addressable
 * and the backend has no way of its own.
 */
int kv_chase(struct kv_ctx *ctx, uint64_t hops, double *ns_per_hop);

/* Timer ticks per ns: the calibrated TSC rate, or 1.0 when timing with clock_gettime. */
double kv_timer_ghz(const struct kv_ctx *ctx);

/*
 * For tests only: copy n bytes between dst/src and a region (enum kv_region) at
 * offset off, so tests can see that bytes really moved. Returns 0, -EINVAL out
 * of bounds or before prepare, -EOPNOTSUPP when the backend's memory is not
 * addressable from the host. Not for timing or production paths.
 */
int kv_debug_peek(struct kv_ctx *ctx, int which, uint64_t off, void *dst, uint64_t n);
int kv_debug_poke(struct kv_ctx *ctx, int which, uint64_t off, const void *src, uint64_t n);

/*
 * LRU stack distance of each reference in ids[0..n) (block ids below id_space):
 * the number of distinct other ids referenced since the previous reference to
 * the same id, UINT64_MAX for a first reference. A reference hits in an LRU
 * cache of C blocks exactly when its distance is below C. Returns 0, -EINVAL
 * (an id out of range), -E2BIG (n >= 2^31) or -ENOMEM. Used by the capacity
 * analysis; needs no context.
 */
int kv_stack_distances(const int64_t *ids, uint64_t n, uint64_t id_space, uint64_t *dist_out);

/*
 * Whether a batch of n entry rows passes the checks of a trace's first read
 * (entries.c; kvemu/schema.py _EntryCheck and kvemu/validation.py
 * RequestAccounting): steps in order from prev_step and below n_steps, requests
 * below n_req, phase 0 or 1, tokens positive, context_tokens + tokens within
 * tokens_max[request], each op's first + count within table_len[request]; and
 * each request's entries adding up as an engine computes them, from its state
 * (next[r]: where its next entry starts, req_phase[r], last_step[r]). Returns 0
 * (passes; the state updated), 1 (a check fails; the state as it was, for the
 * Python checks to word the error), -EINVAL or -ENOMEM.
 */
int kv_entry_batch_ok(uint64_t n, const int32_t *step, const int32_t *request, const int8_t *phase,
                      const int32_t *tokens, const int32_t *context, const int32_t *load_first,
                      const int32_t *load_count, const int32_t *store_first, const int32_t *store_count,
                      const int32_t *read_first, const int32_t *read_count, int64_t prev_step, int64_t n_steps,
                      int64_t n_req, const int64_t *table_len, const int64_t *tokens_max, const int64_t *input,
                      const int64_t *output, int64_t *next, int8_t *req_phase, int64_t *last_step);

/*
 * The capacity curve's thresholds (stackdist.c), as runs: the reference stream
 * is given as runs of consecutive ids, run r holding run_start[r] ..
 * run_start[r] + run_count[r] - 1 (counts >= 0, ids below id_space), and comes a
 * request at a time, request q's references at positions offsets[q] ..
 * offsets[q + 1] (offsets[0] = 0, offsets[n_req] = the references, non-
 * decreasing). A reference's threshold is the running maximum, within its
 * request, of the LRU stack distances (kv_stack_distances) each clamped to
 * `clamp` (a first reference's too): with prefix caching it hits in an LRU
 * cache of C blocks exactly when its threshold is below C (C <= clamp). Output
 * run k (k below the returned count): references up to end_out[k] (from the
 * end of run k - 1, or 0) of request request_out[k], whose thresholds are all
 * value_out[k]; a new run starts at each request's first reference and where
 * the running maximum grows. out_cap: room for at least the references' count
 * of runs. *unique_out: the distinct ids referenced. Returns the runs, -EINVAL
 * (an id out of range, bad counts or offsets, clamp < 0), -E2BIG (2^31
 * references or more), -ENOSPC (out_cap too small) or -ENOMEM.
 */
int64_t kv_prefix_threshold_runs(const int64_t *run_start, const int64_t *run_count, uint64_t n_runs,
                                 uint64_t id_space, const int64_t *offsets, uint64_t n_req, int64_t clamp,
                                 int64_t *value_out, int64_t *end_out, int64_t *request_out, uint64_t out_cap,
                                 uint64_t *unique_out);

/*
 * Cache policies for the capacity analysis (policies.c): whether each reference
 * in ids[0..n) (block ids below id_space) hits in a cache of `capacity` blocks
 * that starts empty, hit_out[i] = 1 on a hit. KV_POLICY_FIFO: a miss inserts
 * the block, evicting the one inserted longest ago; a hit changes nothing.
 * KV_POLICY_OPTIMAL: Belady's MIN with bypass: on a miss with the cache full,
 * of the cached blocks and the missed one, the one whose next reference is
 * furthest in the future (or never comes) is left out. KV_POLICY_S3FIFO:
 * S3-FIFO (Yang et al., SOSP 2023) as kvemu/policies/s3fifo.py states it.
 * Returns the hits, -EINVAL (an id out of range) or -ENOMEM. Needs no context.
 */
#define KV_POLICY_FIFO 1
#define KV_POLICY_OPTIMAL 2
#define KV_POLICY_S3FIFO 3
int64_t kv_policy_hits(const int64_t *ids, uint64_t n, uint64_t id_space, uint64_t capacity, int policy,
                       uint8_t *hit_out);

/*
 * The tier's slot allocator (lru.c): an arena of `capacity` slots standing for
 * a tier of that capacity, whose slots are reused as it evicts, least recently
 * used first. kv_lru_map maps keys[0..n) (each < key_space) in order: a
 * resident key keeps its slot and becomes the most recently used; another
 * takes a free slot, else the least recently used key's. fresh_out[i] is 1
 * where keys[i] entered the tier during this call (absent before it, or
 * evicted earlier in it by another key): its data was not in the tier when
 * the call began to use it. A call evicts a key it mapped itself only when its
 * distinct keys exceed the capacity: they then evict one another in order (the
 * tier keeps the last `capacity`), and kv_lru_overflow counts those evictions
 * (cumulative). Returns the evictions of this call (those included) or -EINVAL. kv_lru_new: NULL on ENOMEM or
 * a capacity outside 1..2^32-2 or key_space outside 1..2^40.
 */
struct kv_lru;
struct kv_lru *kv_lru_new(uint64_t capacity, uint64_t key_space);
void kv_lru_free(struct kv_lru *l);
int64_t kv_lru_map(struct kv_lru *l, const int64_t *keys, uint64_t n, uint32_t *slots_out,
                   uint8_t *fresh_out);
uint64_t kv_lru_resident(const struct kv_lru *l);
uint64_t kv_lru_overflow(const struct kv_lru *l);

/*
 * The engine's block pool's reference counts (pool.c; engine/pool.py's
 * BlockPool): per registered block id, how many running requests use it, and
 * the blocks none uses in the order they became unused (released tail first),
 * the first to be evicted. kv_pool_prefix_hit: how many of ids[0..n) are
 * registered, in order from the first (and, in *idle_out, how many of those
 * no request uses). kv_pool_pin: each of ids (registered) gains a user;
 * kv_pool_register: each gains a user, registered first if absent;
 * kv_pool_unregister: each loses a user, and is dropped at none;
 * kv_pool_release: each, from the last to the first, loses a user, and at none
 * joins the end of the unused blocks. Each id in order, as one at a time;
 * 0, -ENOENT (an id not registered, or without a user; the call stops there)
 * or -ENOMEM. kv_pool_evict drops up to n unused blocks, the longest unused
 * first, and returns how many. kv_pool_ref: an id's users, -1 when not
 * registered. kv_pool_dump writes up to cap (id, users) pairs, in no order.
 */
struct kv_pool;
struct kv_pool *kv_pool_new(void);
void kv_pool_free(struct kv_pool *p);
uint64_t kv_pool_prefix_hit(const struct kv_pool *p, const int64_t *ids, uint64_t n, uint64_t *idle_out);
int kv_pool_pin(struct kv_pool *p, const int64_t *ids, uint64_t n);
int kv_pool_register(struct kv_pool *p, const int64_t *ids, uint64_t n);
int kv_pool_unregister(struct kv_pool *p, const int64_t *ids, uint64_t n);
int kv_pool_release(struct kv_pool *p, const int64_t *ids, uint64_t n);
uint64_t kv_pool_evict(struct kv_pool *p, uint64_t n);
uint64_t kv_pool_registered(const struct kv_pool *p);
uint64_t kv_pool_idle(const struct kv_pool *p);
int64_t kv_pool_ref(const struct kv_pool *p, int64_t id);
uint64_t kv_pool_dump(const struct kv_pool *p, int64_t *ids_out, int64_t *refs_out, uint64_t cap);

/* cffi-cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* KVEMU_H */
