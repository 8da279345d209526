"""What a report says of a disaggregated run (replay --prefill-instances, docs/replay.md
"Prefill/decode disaggregation"): the hand-off's share of TTFT and TTFT's four parts, the hand-off's
size, time and overlap with the prefill, each side's GPU utilisation, and goodput under the SLO for
TTFT and TPOT separately (DistServe's goodput per phase)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import metrics

#: TTFT's parts in the results, in the order they happen.
TTFT_PARTS = ("ttft_queue_ns", "ttft_prefill_ns", "ttft_handoff_ns", "ttft_first_decode_ns")
_COLUMNS = (*TTFT_PARTS, "handoff_ns", "handoff_overlap_ns", "handoff_bytes", "prefill_instance")


def disagg_summary(run, slo=None) -> dict[str, Any] | None:
    """The disaggregated run's figures (None for a colocated run, or results without the columns)."""
    d = (run.meta.get("schedule") or {}).get("disagg")
    if not isinstance(d, dict) or not all(c in run.table.column_names for c in _COLUMNS):
        return None
    col = {c: np.asarray(run.table[c].to_numpy(zero_copy_only=False), np.float64) for c in _COLUMNS}
    ttft = np.asarray(run.table["ttft_ms"].to_numpy(zero_copy_only=False), np.float64) * 1e6
    total = float(np.nansum(ttft))
    handed = col["prefill_instance"] >= 0
    ho_ns = float(col["handoff_ns"][handed].sum())
    out: dict[str, Any] = {
        "prefill_instances": d.get("prefill_instances"), "decode_instances": d.get("decode_instances"),
        "transfer": (d.get("transfer") or {}).get("path"), "mode": (d.get("transfer") or {}).get("mode"),
        "handoff_share_of_ttft": float(col["ttft_handoff_ns"].sum()) / total if total > 0 else float("nan"),
        "ttft_parts_share": {p[5:-3]: float(col[p].sum()) / total if total > 0 else float("nan") for p in TTFT_PARTS},
        "handed_off_requests": int(handed.sum()),
        "mean_handoff_ms": ho_ns / handed.sum() / 1e6 if handed.any() else float("nan"),
        "mean_handoff_mib": float(col["handoff_bytes"][handed].mean()) / 2**20 if handed.any() else float("nan"),
        "handoff_overlap_share": float(col["handoff_overlap_ns"][handed].sum()) / ho_ns if ho_ns > 0 else float("nan"),
        "gpu_busy": d.get("gpu_busy"),
        "mean_tpot_ms_per_decode_instance": _per_instance_tpot(run.table),
    }
    if slo is not None:
        dur = run.duration_s
        ok = dur > 0
        out["goodput_ttft_only"] = (int(metrics.good_requests(run.table, ttft_ms=slo.ttft_ms).sum()) / dur
                                    if ok else float("nan"))
        out["goodput_tpot_only"] = (int(metrics.good_requests(run.table, tpot_ms=slo.tpot_ms).sum()) / dur
                                    if ok else float("nan"))
    return out


def _per_instance_tpot(table) -> dict[str, float] | None:
    """Mean TPOT of each decode instance's requests (those with more than one output token)."""
    if "decode_instance" not in table.column_names:
        return None
    inst = np.asarray(table["decode_instance"].to_numpy(zero_copy_only=False))
    tpot = np.asarray(table["tpot_ms"].to_numpy(zero_copy_only=False), np.float64)
    out = {}
    for j in np.unique(inst):
        t = tpot[(inst == j) & np.isfinite(tpot)]
        out[str(int(j))] = float(t.mean()) if len(t) else float("nan")
    return out


def _pct(x) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{100 * x:.0f}%"


def disagg_lines(report) -> list[str]:
    """One line per disaggregated run of the report, for the report's first lines."""
    lines = []
    for group in report.groups:
        for row in group.rows:
            s = disagg_summary(row.run, report.slo)
            if s is None:
                continue
            p = s["ttft_parts_share"]
            busy = s["gpu_busy"] or {}
            line = (f"{row.run.label}: {s['prefill_instances']} prefill + {s['decode_instances']} decode instances "
                    f"over {s['transfer']} ({s['mode']}): hand-off {_pct(s['handoff_share_of_ttft'])} of TTFT "
                    f"(queue {_pct(p['queue'])}, prefill {_pct(p['prefill'])}, hand-off {_pct(p['handoff'])}, "
                    f"first decode {_pct(p['first_decode'])}); ")
            if s["handed_off_requests"]:
                line += (f"a hand-off {s['mean_handoff_mib']:.1f} MiB in {s['mean_handoff_ms']:.3f} ms, "
                         f"{_pct(s['handoff_overlap_share'])} under the prefill; ")
            line += f"GPUs busy: prefill {_pct(busy.get('prefill'))}, decode {_pct(busy.get('decode'))}"
            tpot = s["mean_tpot_ms_per_decode_instance"] or {}
            if 1 < len(tpot) <= 8:
                line += "; mean TPOT per decode instance " + ", ".join(f"{v:.1f}" for v in tpot.values()) + " ms"
            if "goodput_ttft_only" in s:
                line += (f"; goodput {s['goodput_ttft_only']:.2f}/s meeting TTFT alone, "
                         f"{s['goodput_tpot_only']:.2f}/s meeting TPOT alone")
            lines.append(line)
    return lines
