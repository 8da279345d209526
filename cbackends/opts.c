/*
 * opts.c - the one parser of backend option strings (see backend.h): a
 * comma-separated list of key=value, checked against the keys a backend
 * declares, with the same messages for every backend.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

size_t kv_opt_positional(const char *args, const char **rest)
{
    size_t n = strcspn(args, ",");

    *rest = args[n] ? args + n + 1 : args + n;
    return n;
}

int kv_parse_u64(const char *s, size_t len, uint64_t *out)
{
    uint64_t v = 0;

    if (!s || len == 0)
        return -EINVAL;
    for (size_t i = 0; i < len; i++) {
        if (s[i] < '0' || s[i] > '9' || __builtin_mul_overflow(v, 10u, &v) ||
            __builtin_add_overflow(v, (uint64_t)(s[i] - '0'), &v))
            return -EINVAL;
    }
    *out = v;
    return 0;
}

void kv_opts_init(struct kv_opts *s, struct kv_ctx *ctx, const char *backend, const char *args,
                  const struct kv_opt_key *keys, const struct kv_opt_key *more)
{
    memset(s, 0, sizeof(*s));
    s->ctx = ctx;
    s->backend = backend;
    s->keys[0] = keys;
    s->keys[1] = more;
    s->p = args ? args : "";
}

/* The declared key named text[0 .. n): its index over keys[0] then keys[1], or -1. */
static int kv_opts_find(const struct kv_opts *s, const char *text, size_t n, int *table,
                        const struct kv_opt_key **decl)
{
    int id = 0;

    for (int t = 0; t < 2; t++) {
        for (const struct kv_opt_key *k = s->keys[t]; k && k->key; k++, id++) {
            if (strlen(k->key) == n && strncmp(k->key, text, n) == 0) {
                *table = t;
                *decl = k;
                return id;
            }
        }
    }
    return -1;
}

static int kv_opts_unknown(struct kv_opts *s, const char *text, size_t len)
{
    char known[512];
    size_t pos = 0;

    known[0] = '\0';
    for (int t = 0; t < 2; t++)
        for (const struct kv_opt_key *k = s->keys[t]; k && k->key; k++)
            kv_appendf(known, sizeof(known), &pos, "%s%s=%s", pos ? ", " : "", k->key, k->syntax);
    return kv_fail(s->ctx, -EINVAL, "%s: unknown option '%.*s' (known: %s)", s->backend, (int)len,
                   text, known);
}

int kv_opts_next(struct kv_opts *s, struct kv_opt *o)
{
    const char *p = s->p, *eq;
    size_t len, key_len;
    int id;

    while (*p == ',')
        p++;
    if (!*p) {
        s->p = p;
        return 0;
    }
    len = strcspn(p, ",");
    s->p = p + len;
    eq = memchr(p, '=', len);
    key_len = eq ? (size_t)(eq - p) : len;
    memset(o, 0, sizeof(*o));
    id = kv_opts_find(s, p, key_len, &o->table, &o->decl);
    if (id < 0)
        return kv_opts_unknown(s, p, len);
    if (!eq)
        return kv_fail(s->ctx, -EINVAL, "%s: option %s needs a value: %s=%s", s->backend,
                       o->decl->key, o->decl->key, o->decl->syntax);
    if (id < 64 && (s->seen & (1ull << id)))
        return kv_fail(s->ctx, -EINVAL, "%s: option %s given twice", s->backend, o->decl->key);
    if (id < 64)
        s->seen |= 1ull << id;
    o->backend = s->backend;
    o->key = o->decl->key;
    o->text = p;
    o->len = len;
    o->val = eq + 1;
    o->val_len = len - key_len - 1;
    return 1;
}

int kv_opt_is(const struct kv_opt *o, const char *key)
{
    return strcmp(o->key, key) == 0;
}

int kv_opt_bad(struct kv_ctx *ctx, const struct kv_opt *o, const char *must)
{
    return kv_fail(ctx, -EINVAL, "%s: option %s is '%.*s', must be %s", o->backend, o->key,
                   (int)o->val_len, o->val, must);
}

int kv_opt_u64(struct kv_ctx *ctx, const struct kv_opt *o, uint64_t min, uint64_t max, uint64_t *out)
{
    char must[80];
    uint64_t v;

    if (kv_parse_u64(o->val, o->val_len, &v) == 0 && v >= min && v <= max) {
        *out = v;
        return 0;
    }
    if (min == 0 && max == UINT64_MAX)
        snprintf(must, sizeof(must), "a decimal integer");
    else
        snprintf(must, sizeof(must), "an integer in %" PRIu64 "..%" PRIu64, min, max);
    return kv_opt_bad(ctx, o, must);
}

int kv_opt_double(struct kv_ctx *ctx, const struct kv_opt *o, double *out)
{
    char buf[64], *end;
    double x;

    if (o->val_len > 0 && o->val_len < sizeof(buf)) {
        memcpy(buf, o->val, o->val_len);
        buf[o->val_len] = '\0';
        errno = 0;
        x = strtod(buf, &end);
        if (*end == '\0' && errno == 0 && isfinite(x) && x >= 0) {
            *out = x;
            return 0;
        }
    }
    return kv_opt_bad(ctx, o, "a finite number >= 0");
}

int kv_opt_choice(struct kv_ctx *ctx, const struct kv_opt *o, int *out)
{
    const char *c = o->decl->syntax;
    char must[160];
    size_t pos = 0;
    int i = 0, n = 0;

    must[0] = '\0';
    for (const char *q = c; *q; q += strcspn(q, "|"), q += *q == '|')
        n++;
    for (const char *q = c; *q; i++) {
        size_t len = strcspn(q, "|");

        if (len == o->val_len && strncmp(q, o->val, len) == 0) {
            *out = i;
            return 0;
        }
        kv_appendf(must, sizeof(must), &pos, "%s%.*s", i == 0 ? "" : i + 1 == n ? " or " : ", ",
                   (int)len, q);
        q += len;
        q += *q == '|';
    }
    return kv_opt_bad(ctx, o, must);
}

int kv_opt_bool(struct kv_ctx *ctx, const struct kv_opt *o, int *out)
{
    if (o->val_len == 1 && (o->val[0] == '0' || o->val[0] == '1')) {
        *out = o->val[0] == '1';
        return 0;
    }
    return kv_opt_bad(ctx, o, "0 or 1");
}
