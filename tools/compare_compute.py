#!/usr/bin/env python3
"""The two compute models side by side on the published points of tools/engine_fit/points.csv.

For every usable point whose model aiconfigurator has a configuration for (kvemu's presets
llama3-8b, llama3-70b, deepseek-v3; the Llama 2 / InternLM points are config.json files, not
folders it reads), both models time the steps tools/fit_engine.py times (a prefill of B
prompts of N tokens is one step of B chunks; a decode point the mean decode step at batch B while
the context grows from N; a static batch one prefill plus O - 1 decode steps), the roofline with
its fitted factors of both engine eras (2024 and 2025), aiconfigurator with the database of the point's framework (TensorRT-LLM and
NIM: trtllm; SGLang: sglang; vLLM: vllm) at its current version. Both figures are modelled, not
measured here; the measured figure is the source's. Prints a Markdown table (tools/engine_fit/README.md).

    python tools/compare_compute.py
"""

from __future__ import annotations

import csv
import sys

import numpy as np

from fit_engine import ERA_2024, POINTS, PhaseFactors, kvemu_ms, load_points, steps, timing

from kvemu.engine.aic import AIC_MODELS
from kvemu.engine.compute import make_compute


def framework(engine: str) -> str:
    e = engine.lower()
    if "sglang" in e:
        return "sglang"
    if "vllm" in e:
        return "vllm"
    return "trtllm"  # TensorRT-LLM and NIM (TensorRT-LLM based)


def aic_ms(p, backend: str) -> tuple[float | None, str]:
    t = make_compute(f"aiconfigurator:{backend}", timing(p, ERA_2024), p.model, p.kv_dtype)
    if t.fallback:
        return None, "no entry: " + t.fallback.rsplit("(", 1)[-1].rstrip(")")[:40]
    is_dec, new, pairs, touched = steps(p)
    total = 0.0
    for d, a, c, k in zip(is_dec, new, pairs, touched):
        a = int(a)
        if d:  # a decode step of batch a: each attends its context + 1 = k / a tokens
            total += t.step_ns(a, float(c), int(k), a, int(k))
        else:  # a prefill of B prompts: B chunks on nothing cached
            total += t.step_ns(a, float(c), int(k), 0, 0, p.batch, 0)
    if t.steps["roofline"]:
        why = ("a prefill of several chunks (MLA)" if t.mla_multi_chunk_steps else
               "prefill steps with DP attention" if t.dp_prefill_steps else f"{t.steps['roofline']} steps outside its tables")
        return None, why
    return total / (len(new) if p.phase == "decode" else 1) / 1e6, f"{t.backend} {t.version}"


def main() -> int:
    engines = {r["id"]: r["engine"] for r in csv.DictReader(l for l in open(POINTS) if not l.startswith("#"))}
    rows = []
    for p in load_points():
        if not p.usable or p.model not in AIC_MODELS:
            continue
        roof = (kvemu_ms(p, ERA_2024), kvemu_ms(p, PhaseFactors.of_era("2025")))
        aic, how = aic_ms(p, framework(engines[p.id]))
        rows.append((p, roof, aic, how))
    print("| point | model, GPUs, dtype | phase B/N/O | measured ms | roofline 2024 ms (err) | roofline 2025 ms (err) "
          "| aiconfigurator ms (err) | database |")
    print("|---|---|---|---|---|---|---|---|")
    err = {"roofline 2024": [], "roofline 2025": [], "aiconfigurator": []}
    for p, roof, aic, how in rows:
        cells = []
        for era, r in zip(("2024", "2025"), roof):
            e_r = (r / p.measured_ms - 1) * 100
            err[f"roofline {era}"].append(abs(e_r))
            cells.append(f"{r:,.1f} ({e_r:+.0f} %)")
        a = "—"
        if aic is not None:
            e_a = (aic / p.measured_ms - 1) * 100
            err["aiconfigurator"].append(abs(e_a))
            a = f"{aic:,.1f} ({e_a:+.0f} %)"
        dtype = p.weight_dtype + (f", KV {p.kv_dtype}" if p.kv_dtype != p.weight_dtype else "")
        print(f"| {p.id} | {p.model}, {p.n_gpus} x {p.gpu}, {dtype} | {p.phase} {p.batch}/{p.input_tokens}/"
              f"{p.output_tokens} | {p.measured_ms:,.1f} | {cells[0]} | {cells[1]} | {a} | {how} |")
    for k, v in err.items():
        if v:
            print(f"\n{k}: median |error| {np.median(v):.1f} %, max {max(v):.1f} % over {len(v)} points", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
