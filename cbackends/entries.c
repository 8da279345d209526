/*
 * entries.c - whether a batch of a trace's entry rows passes the checks every
 * entry passes on its first read (kvemu/schema.py _EntryCheck, kvemu/validation.py
 * RequestAccounting), in one sequential pass. It only says yes or no: where a
 * check fails, the Python checks run on the same batch to word the error, so
 * the request state (next token, phase, last step of each request) is left as
 * it was before the batch (an undo log).
 */
#include <errno.h>
#include <stdlib.h>

#include "kvemu.h"

struct undo {
    int64_t r, next, last_step;
    int8_t phase;
};

int kv_entry_batch_ok(uint64_t n, const int32_t *step, const int32_t *request, const int8_t *phase,
                      const int32_t *tokens, const int32_t *context, const int32_t *load_first,
                      const int32_t *load_count, const int32_t *store_first, const int32_t *store_count,
                      const int32_t *read_first, const int32_t *read_count, int64_t prev_step, int64_t n_steps,
                      int64_t n_req, const int64_t *table_len, const int64_t *tokens_max, const int64_t *input,
                      const int64_t *output, int64_t *next, int8_t *req_phase, int64_t *last_step)
{
    const int32_t *first[3] = {load_first, store_first, read_first};
    const int32_t *count[3] = {load_count, store_count, read_count};
    struct undo *log;
    uint64_t done = 0;
    int bad = 0;

    if (n == 0)
        return 0;
    if (!step || !request || !phase || !tokens || !context || !load_first || !load_count || !store_first
        || !store_count || !read_first || !read_count || !table_len || !tokens_max || !input || !output || !next
        || !req_phase || !last_step)
        return -EINVAL;
    /* _EntryCheck: step order and range, requests, phases, tokens, contexts, ranges in the table */
    for (uint64_t i = 0; i < n && !bad; i++) {
        int64_t st = step[i], r = request[i], ctx = context[i];

        if (st < (i ? (int64_t)step[i - 1] : prev_step) || st < 0 || st >= n_steps || r < 0 || r >= n_req
            || phase[i] < 0 || phase[i] > 1 || tokens[i] <= 0 || ctx < 0 || ctx + tokens[i] > tokens_max[r]) {
            bad = 1;
            break;
        }
        for (int op = 0; op < 3; op++)
            if (first[op][i] < 0 || count[op][i] < 0 || (int64_t)first[op][i] + count[op][i] > table_len[r])
                bad = 1;
    }
    if (bad)
        return 1;
    /* RequestAccounting, entry by entry in step order (each request's entries in its order) */
    log = malloc(n * sizeof(*log));
    if (!log)
        return -ENOMEM;
    for (uint64_t i = 0; i < n; i++) {
        int64_t r = request[i], st = step[i], ctx = context[i], tok = tokens[i], end = ctx + tok;
        int8_t ph = phase[i];

        if (st == last_step[r] || ph < req_phase[r] || ctx != next[r] || (ph == 0 && end > input[r])
            || (ph == 1 && (ctx < input[r] || tok != 1 || end > input[r] + output[r] - 1))) {
            bad = 1;
            break;
        }
        log[done++] = (struct undo){r, next[r], last_step[r], req_phase[r]};
        next[r] = end;
        req_phase[r] = ph;
        last_step[r] = st;
    }
    if (bad)
        while (done > 0) {
            struct undo u = log[--done];

            next[u.r] = u.next;
            req_phase[u.r] = u.phase;
            last_step[u.r] = u.last_step;
        }
    free(log);
    return bad;
}
