"""The trace format's bounds: the limits and the known values of what a trace (and the options that
make one) may say (docs/trace-format.md, "Validation").

Next to the ground: it imports nothing of kvemu but the way kvemu/units.py writes a number and the
registry of eviction policies (kvemu.policies: the names engine.tier_eviction takes), so
that the engine, the options, the analysis and kvemu/validation.py all take each bound from here,
and validation sits below what it validates.
"""

from __future__ import annotations

import math

from .errors import ConfigError
from .policies import get_policy, policy_names
from .units import exact

# ------------------------------------------------------------------------------ timeline and ids
#: The latest moment any recorded timeline may reach (last arrival plus every step's compute):
#: 2^60 ns, 36.5 years. kvemu's clocks are int64 nanoseconds (overflow at 2^63, 292 years); the
#: factor of 8 left over is room for the tier's time a replay adds to the recorded compute.
MAX_TIMELINE_NS = 1 << 60

#: The largest ``blocks.id_space`` a trace may declare at all (read_trace bounds it further by the
#: block tables): ids are int64 and stay exact in float64.
MAX_ID_SPACE = 1 << 53

# ------------------------------------------------------------------------------ engine
#: The engine's use of the tier: none (HBM prefix cache only), offload or resident (record's
#: --tier-policy, engine.tier_policy).
TIER_POLICIES = ("none", "offload", "resident")
#: What a bounded tier evicts unless told (record's and replay's --tier-eviction, engine.tier_eviction;
#: a kvemu.policies name): least recently used, as the engine's tier and the replay's arena always did.
DEFAULT_TIER_EVICTION = "lru"

#: The largest transfer chunk, in blocks: record's --chunk-tokens and replay's (or the trace's)
#: chunk size are bounded by this one figure (a chunk's block offsets are 16-bit in the replay).
MAX_CHUNK_BLOCKS = 65536

#: The largest ``max_num_seqs`` and ``max_batched_tokens`` (record's --max-num-seqs and
#: --max-batched-tokens, and a trace's engine.max_num_seqs / engine.max_num_batched_tokens /
#: engine.transfer_chunk_tokens, kvemu/validation.py): a step's request and token counts are int32
#: in the trace's columns.
MAX_NUM_SEQS = 2**31 - 1
MAX_BATCHED_TOKENS = 2**31 - 1

#: Transfer layouts: one layer of a chunk per transfer, or a chunk's blocks of every layer in one
#: (record's and replay's --kv-layout, engine.kv_layout).
LAYOUTS = ("per-layer", "cross-layer")

# ------------------------------------------------------------------------------ model and GPU
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
WEIGHT_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}

#: Compute dtypes a preset has a peak for.
COMPUTE_DTYPES = ("bf16", "fp16", "fp8")

#: The range of each factor make_timing takes: below 0.001 a step would take longer than a day, a
#: mistyped factor, not a GPU.
FACTOR_BOUNDS = {"mfu": (1e-3, 1.0), "mbu": (1e-3, 1.0), "overhead_us": (0.0, 1e6)}

#: Most GPUs ``analyze breakeven --gpus`` takes (a mistyped count, not a deployment, beyond it),
#: and most GPUs of any count a trace names.
MAX_BREAKEVEN_GPUS = 1 << 20

#: How streamed weights compose with compute: each layer loads, then computes, or the next layer's
#: weights are prefetched while one computes (record's --weight-stream, weights.stream).
STREAMS = ("serial", "overlap")

# ------------------------------------------------------------------------------ workload
#: Time scales are below this (a factor that stretches a second into 30 years); a smaller one whose
#: arrivals still leave the nanosecond clock is refused with the span it reaches (recording.arrival_scale).
MAX_TIME_SCALE = 1e9


def eviction_name_problem(eviction) -> str | None:
    """What is wrong with ``eviction`` as the name of the policy a tier evicts by (the rest of a
    sentence naming it), or None: an online kvemu.policies name (one a running cache can follow)."""
    online = policy_names(online=True)
    if isinstance(eviction, str) and eviction in online:
        return None
    known = f"known: {', '.join(online)}"
    try:
        get_policy(eviction)
    except ConfigError:
        return f"names no eviction policy, got {eviction!r} ({known})"
    return f"{eviction} needs every future access, which a running tier does not have ({known})"


def tier_eviction_problem(eviction, tier_policy: str, bounded: bool, *, policy_field: str = "{engine.tier_policy}",
                          capacity_field: str = "{engine.tier_capacity_gib}") -> str | None:
    """What is wrong with ``eviction`` as the eviction policy of the engine's tier under
    ``tier_policy``, bounded or not (the rest of a sentence naming the field; ``policy_field`` and
    ``capacity_field`` name the fields that set the tier policy and its capacity), or None: an online
    kvemu.policies name; other than LRU only for a bounded offload tier (an unbounded tier evicts
    nothing, and the resident pool is LRU over reference-counted blocks). The one rule of record's
    ``engine.tier_eviction``, EngineConfig.tier_eviction, the trace's metadata and replay's
    ``tier.eviction``."""
    why = eviction_name_problem(eviction)
    if why or eviction == DEFAULT_TIER_EVICTION:
        return why
    if tier_policy != "offload":
        why = "the resident pool evicts LRU" if tier_policy == "resident" else "there is no tier"
        return f"{eviction} needs {policy_field} offload ({why}; got {tier_policy})"
    if not bounded:
        return f"{eviction} has no effect without {capacity_field} (an unbounded tier evicts nothing)"
    return None


def time_scale_problem(time_scale) -> str | None:
    """What is wrong with a ``time_scale`` (the rest of a sentence naming it), or None."""
    if not (isinstance(time_scale, (int, float)) and 0 < time_scale < MAX_TIME_SCALE and math.isfinite(time_scale)):
        # the bound itself is refused too: said so, or "below 1e+09, got 1e+09" reads as a contradiction
        at = f" ({MAX_TIME_SCALE:g} itself is too large)" if time_scale == MAX_TIME_SCALE else ""
        return f"must be a positive number below {MAX_TIME_SCALE:g}, got {exact(time_scale)}{at}"
    return None
