"""The guard that defines "good enough" for the GPU compute model (issue 41; docs/engine.md,
"Validation against published measurements"): the tier verdicts of the demo's workload and of the
shipped traces are the same under every shipped compute model. A step time is a denominator here;
a new fitted term is added only where it changes one of these verdicts.

The verdicts, in virtual time (``analyze capacity --stack``'s model: kvemu.capacity.StackAnalysis,
each request's prefill priced by the compute model, the levels' loads at their published profiles):

* which tier wins: the tiers (or recompute in HBM alone) with the lowest median TTFT when they hold
  everything, and the demo's question, whether the CXL pool beats the best storage tier, each
  comparison by the report's rule (kvemu.report.verdict: two figures closer than SAME_WITHIN of
  the larger are the same);
* the stack a planner would pick: the demo's stacks (DRAM, a CXL pool swept, NVMe) ranked by
  modelled $ per million output tokens, and the demo's rule for where the pool stops paying
  (kvemu.demo ``pool_stops``: the smallest pool beyond which every larger one is the same on median
  TTFT within the report's SAME_WITHIN and takes no more prompt tokens off NVMe).

The shipped compute models: the roofline at each engine era's factors, and aiconfigurator where its
extra is installed (skipped otherwise). A trace is re-priced by replacing its compute blob.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvemu.capacity import StackAnalysis, parse_stack
from kvemu.engine.compute import compute_blob, roofline_params
from kvemu.engine.timing import ENGINE_ERAS, ROOFLINE_P
from kvemu.prices import load_prices
from kvemu.report.verdict import SAME_WITHIN
from kvemu.schema import read_trace

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "traces").glob("*.parquet"))
TIERS = ("local-dram", "cxl-pool", "rdma-storage", "nvme")
POOLS = ("0", "1GiB", "4GiB", "16GiB")  # the demo's sweep (kvemu.demo.POOL_SIZES), fewer points
HAVE_AIC = importlib.util.find_spec("aiconfigurator_core") is not None


def blob_of(model: str, meta: dict) -> dict:
    """The compute blob of ``model`` for a trace whose metadata is ``meta``."""
    if model.startswith("roofline-"):
        return {"model": "roofline", "version": 1,
                "params": {**ENGINE_ERAS[model.removeprefix("roofline-")], "roofline_p": ROOFLINE_P}}
    return {"model": "aiconfigurator", "version": 1,
            "params": {"backend": None, "database": None, "roofline": roofline_params(compute_blob(meta))}}


MODELS = [f"roofline-{era}" for era in ENGINE_ERAS] + [
    pytest.param("aiconfigurator", marks=pytest.mark.skipif(not HAVE_AIC, reason="the [aic] extra is absent"))]


def verdicts(trace, model: str | dict) -> dict:
    """The verdicts of ``trace`` re-priced by ``model`` (a shipped model's name, or a compute blob)."""
    meta = trace.header.meta  # re-priced in place, restored after
    saved = meta.get("compute")
    meta["compute"] = blob_of(model, meta) if isinstance(model, str) else model
    try:
        an = StackAnalysis(trace)
        fits = max(an.unique, 1) * an.block_bytes
        p50 = {"recompute": an.evaluate([], "lru")["ttft_ms"]["p50"]}
        for t in TIERS:
            p50[t] = an.evaluate(parse_stack(f"{t}={fits}"), "lru")["ttft_ms"]["p50"]
        prices = load_prices(None)
        stacks = []
        for pool in POOLS:
            text = "local-dram=1GiB," + (f"cxl-pool={pool}," if pool != "0" else "") + "nvme=16GiB"
            p = an.evaluate(parse_stack(text), "lru", prices=prices)
            nvme = next(lv for lv in p["levels"] if lv["name"] == "nvme")
            stacks.append((pool, p["ttft_ms"]["p50"], nvme["hit_share"], p["cost"]["usd_per_million_output_tokens"]))
    finally:
        if saved is None:
            meta.pop("compute")
        else:
            meta["compute"] = saved
    pools = stacks[1:]
    stops = next((r[0] for i, r in enumerate(pools[:-1])
                  if all(abs(o[1] - r[1]) <= SAME_WITHIN * r[1] and o[2] <= r[2] + 1e-9 for o in pools[i + 1:])), None)
    best = min(p50.values())
    storage = min(p50["rdma-storage"], p50["nvme"])
    return {"winners": sorted(k for k, v in p50.items() if v - best <= SAME_WITHIN * v),
            "pool_vs_storage": ("same" if abs(p50["cxl-pool"] - storage) <= SAME_WITHIN * max(p50["cxl-pool"], storage)
                                else "pool" if p50["cxl-pool"] < storage else "storage"),
            "cheapest_stack": min(stacks, key=lambda r: r[3])[0],
            "pool_stops": stops}


def record_demo(folder: Path, model: str):
    """The demo's workload as the demo records it (kvemu.demo: its model, HBM and offload policy),
    its steps scheduled and priced by compute model ``model``."""
    from kvemu.demo import HBM_KV_GIB, MODEL, WORKLOAD
    from kvemu.record_options import EngineOptions, GpuOptions, RecordOptions, RecordOutputOptions
    from kvemu.recording import record

    gpu = (GpuOptions(engine_era=model.removeprefix("roofline-")) if model.startswith("roofline-")
           else GpuOptions(compute=model))
    out = folder / f"demo-{model}.parquet"
    record(WORKLOAD, MODEL, out, RecordOptions(engine=EngineOptions(tier_policy="offload", hbm_kv_gib=HBM_KV_GIB),
                                               gpu=gpu, output=RecordOutputOptions(show_progress=False)))
    return read_trace(out)


_SEEN: dict = {}


@pytest.fixture(scope="module")
def verdicts_of(tmp_path_factory):
    """Each model's verdicts (computed once): the demo recorded under it (the model schedules the
    steps, as ``kvemu demo`` would), the shipped traces re-priced by it (recorded at era 2024)."""
    folder = tmp_path_factory.mktemp("guard")

    def get(model: str) -> dict:
        if model not in _SEEN:
            _SEEN[model] = {"demo": verdicts(record_demo(folder, model), model),
                            **{p.name: verdicts(read_trace(p), model) for p in SHIPPED}}
        return _SEEN[model]

    return get


DEFAULT = "roofline-2025"


@pytest.mark.parametrize("model", [m for m in MODELS if m != DEFAULT])
def test_tier_verdicts_are_the_same_under_every_shipped_compute_model(model, verdicts_of):
    assert SHIPPED, "the shipped traces (traces/*.parquet) are part of the guard"
    assert verdicts_of(model) == verdicts_of(DEFAULT)


def test_the_guard_can_fail(verdicts_of):
    """The verdicts move when the compute model is far off (prefill on a GPU 100 times slower: every
    tier ties beside it and the pool stops paying at a smaller size), so the guard above compares
    something the compute model decides."""
    trace = read_trace(SHIPPED[0])
    era = ENGINE_ERAS["2025"]
    slow = {"model": "roofline", "version": 1,
            "params": {**era, "roofline_p": ROOFLINE_P, "mfu": era["mfu"] / 100, "mbu": era["mbu"] / 100}}
    assert verdicts(trace, slow) != verdicts_of(DEFAULT)[SHIPPED[0].name]
