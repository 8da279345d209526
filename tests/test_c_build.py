"""The C core builds warning-free with plain gcc, and its error paths are memory-safe.

A small C driver exercises the public API directly (no Python in between) under AddressSanitizer
and UndefinedBehaviorSanitizer, once with the TSC timer and once with the clock_gettime fallback.
"""
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CB = os.path.join(ROOT, "cbackends")
SOURCES = sorted(glob.glob(os.path.join(CB, "*.c")))  # every backend file is part of the module

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")

DRIVER = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "kvemu.h"

static int failures;
#define EXPECT(cond) do { if (!(cond)) { failures++; \
    fprintf(stderr, "line %d: %s (msg: %s)\n", __LINE__, #cond, kv_errmsg(ctx)); } } while (0)

int main(int argc, char **argv)
{
    const char *want_timer = argc > 1 ? argv[1] : "";
    struct kv_ctx *ctx = kv_ctx_new();
    struct kv_geom g = { .block_bytes = 4096, .n_slots = 4, .n_layers_model = 3, .n_layers_replay = 2 };
    struct kv_geom huge = { .block_bytes = 1ull << 40, .n_slots = 1ull << 40, .n_layers_model = 1,
                            .n_layers_replay = 1 };
    uint64_t off[3] = { 0, 2, 5 }, bad_off[3] = { 0, 7, 5 };
    uint32_t slots[5] = { 0, 1, 2, 3, 1 }, span[2] = { 2, 1 }, bad_span[2] = { 2, 2 };
    struct kv_entry e[2] = { { 0, 0, 2, 1, 1, 0, 2 }, { 1, 1, 2, 0, 3, 2, 1 } };
    struct kv_entry bad_e = { 1, 2, 2, 0, 0, 0, 0 };
    struct kv_step st[2] = { { 0, 1, 1000 }, { 1, 2, 0 } };
    struct kv_step_out so[2];
    struct kv_entry_out eo[2];
    uint64_t counts[4096], tot[4];
    char buf[1024], tiny[8], pat[4096];

    EXPECT(ctx != NULL);
    EXPECT(kv_errmsg(ctx)[0] == '\0');
    EXPECT(kv_replay(ctx, off, 2, slots, 5, st, 2, e, 2, span, NULL, so, eo) == -EINVAL);
    EXPECT(kv_prepare(ctx, &g) == -EINVAL);
    EXPECT(kv_backend_open(ctx, "nope", "") == -ENOENT);
    EXPECT(strstr(kv_errmsg(ctx), "known: dram") != NULL);
    EXPECT(kv_backend_open(ctx, "dram", "hugepages=7") == -EINVAL);
    EXPECT(kv_backend_open(ctx, "dram", NULL) == 0);
    EXPECT(kv_backend_open(ctx, "dram", "") == -EBUSY);
    EXPECT(kv_prepare(ctx, &huge) == -EINVAL);
    EXPECT(kv_prepare(ctx, &g) == 0);

    EXPECT(kv_replay(ctx, bad_off, 2, slots, 5, st, 2, e, 2, span, NULL, so, eo) == -EINVAL);
    EXPECT(kv_replay(ctx, off, 2, slots, 5, st, 2, e, 2, bad_span, NULL, so, eo) == -EINVAL);
    EXPECT(kv_replay(ctx, off, 2, slots, 5, st, 2, &bad_e, 1, span, NULL, so, eo) == -EINVAL);
    EXPECT(kv_replay(ctx, off, 2, slots, 5, st, 2, e, 2, NULL, NULL, so, eo) == -EINVAL);
    EXPECT(kv_replay(ctx, off, 2, NULL, 5, st, 2, e, 2, span, NULL, so, eo) == -EINVAL);
    EXPECT(kv_op_stats(ctx, KV_OP_LOAD, NULL, 0, tot) == 0 && tot[0] == 0);

    memset(pat, 0x5a, sizeof(pat));
    EXPECT(kv_debug_poke(ctx, KV_REGION_STAGING, 0, pat, sizeof(pat)) == 0);
    EXPECT(kv_replay(ctx, off, 2, slots, 5, st, 2, e, 2, span, NULL, so, eo) == 2);
    EXPECT(kv_replay(ctx, off, 2, slots, 5, st, 2, e, 2, span, NULL, so, NULL) == 2);
    EXPECT(kv_op_stats(ctx, KV_OP_LOAD, counts, kv_hist_n_buckets(), tot) == 0);
    EXPECT(tot[0] == 2 * 2 * (2 + 2) && tot[1] == tot[0] * 4096 && tot[3] == tot[2]);
    EXPECT(kv_op_stats(ctx, KV_OP_READ, counts, 7, tot) == -EINVAL);
    EXPECT(kv_op_stats(ctx, 9, NULL, 0, tot) == -EINVAL);
    EXPECT(so[0].step_ns >= 1000 && eo[0].store_ns > 0);

    EXPECT(kv_describe(ctx, tiny, sizeof(tiny)) == -ENOSPC);
    EXPECT(kv_describe(ctx, buf, sizeof(buf)) > 0);
    EXPECT(strstr(buf, want_timer) != NULL);
    EXPECT(kv_debug_peek(ctx, KV_REGION_ARENA, UINT64_MAX, buf, 2) == -EINVAL);
    EXPECT(kv_debug_peek(ctx, 5, 0, buf, 2) == -EINVAL);
    EXPECT(kv_hist_bucket_lower_ns(kv_hist_n_buckets()) == UINT64_MAX);

    /* A cancelled context stays cancelled: the long calls return -EINTR, the others still work. */
    kv_cancel(NULL);
    kv_cancel(ctx);
    EXPECT(kv_replay(ctx, off, 2, slots, 5, st, 2, e, 2, span, NULL, so, eo) == -EINTR);
    EXPECT(strcmp(kv_errmsg(ctx), "replay: cancelled") == 0);
    EXPECT(kv_chase(ctx, 100, (double[1]){0}) == -EINTR);
    EXPECT(kv_describe(ctx, buf, sizeof(buf)) > 0);

    kv_ctx_free(ctx);
    kv_ctx_free(NULL);
    if (failures == 0)
        printf("ok %s\n", buf);
    return failures != 0;
}
"""


def _gcc(*args, cwd):
    r = subprocess.run(["gcc", *args], cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.parametrize("std", ["c11", "gnu11"])
def test_sources_compile_without_warnings(tmp_path, std):
    for src in SOURCES:
        _gcc(f"-std={std}", "-O2", "-Wall", "-Wextra", "-Wpedantic", "-Wshadow", "-Werror",
             "-c", src, "-o", str(tmp_path / (os.path.basename(src) + ".o")), cwd=tmp_path)


@pytest.mark.parametrize("defines,timer", [([], '"timer":"'), (["-DKV_NO_TSC"], '"timer":"clock_gettime"')])
def test_api_under_sanitizers(tmp_path, defines, timer):
    (tmp_path / "driver.c").write_text(DRIVER)
    exe = str(tmp_path / "driver")
    _gcc("-std=gnu11", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         *defines, f"-I{CB}", "driver.c", *SOURCES, "-o", exe, cwd=tmp_path)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1")
    r = subprocess.run([exe, timer], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok {")
