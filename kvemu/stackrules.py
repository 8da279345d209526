"""The rules a stack of KV levels below HBM runs by, named once for the capacity analysis
(``analyze capacity --stack``, kvemu.capacity) and the closed-loop replay (``replay --tiers``,
kvemu.replay.stack): where a block is written (the placement rule), whether a hit from below is
copied up, and which requests warm the levels without being counted (docs/analysis.md, "Placement
rules"; docs/replay.md, "A stack of tiers").

Placement rules (top level = the first level below HBM, as SGLang HiCache's L2 host memory; the
levels below it = HiCache's L3 / Dynamo KVBM's G3 and below):

- ``write-back``: a computed block is written into the top level only; a block the top level evicts
  is written into the level below (demoted), and so on down; what the bottom level evicts is gone.
  SGLang HiCache ``--hicache-write-policy write_back`` ("written back to the next level only when it
  is evicted from the upper level": docs/advanced_features/hicache_design.md, "Data Write-back",
  sgl-project/sglang at 2232873a, 2025); Dynamo KVBM's offload of evicted blocks G1 -> G2 -> G3.
- ``write-through``: a computed block is written into every level at once; a block served from a
  level is not written anywhere again. HiCache ``write_through`` ("immediately writes data to all
  tiers", the same page; in python/sglang/srt/mem_cache/hiradix_cache.py a node is backed up to host
  once its hit count reaches ``write_through_threshold``, 1 under write_through, and only when it
  is not backed up yet: a block loaded from host was backed up already and is not written again).
- ``write-through-selective``: a computed block is written into the top level; it is copied into
  every level below once it has been served ``selective_hits`` times (default 1). HiCache
  ``write_through_selective`` (hit-count tracking, "backs up only hot data": the same page and
  hiradix_cache.py's ``write_through_threshold`` above 1) and Dynamo KVBM's G2 -> G3
  ``presence_lfu`` offload filter (a block goes to disk only once its LFU count reaches
  ``min_lfu_count``, 8 by default: kvbm-config 1.4.0, src/offload.rs).
- ``inclusive``: every referenced block, computed or served from any level, is written into every
  level (each level a cache of its own capacity on the whole reference stream). No engine we know
  runs this; it is the analysis's rule before these names existed (there called write-through) and
  bounds what a level can hold.

``promote`` (off by default): a block served from a level below the top is also copied into the top
level (HiCache prefetches an L3 hit into L2 host memory before loading it: the same page, "Prefetch
from L3"; write-back then demotes what that evicts). It applies under every rule.

Warm-up: ``--warmup F`` (0 <= F < 1) on both commands: requests ``0 .. floor(F x N) - 1`` of the N
requests, in arrival order, run first and warm the levels; only the others are counted
(:func:`first_counted`).
"""

from __future__ import annotations

import math

from .errors import ConfigError
from .units import check_number

#: Every placement rule, in listing order.
PLACEMENTS = ("write-back", "write-through", "write-through-selective", "inclusive")
#: What both ``analyze capacity --stack`` and ``replay --tiers`` run without ``placement``.
DEFAULT_PLACEMENT = "write-back"
#: The rule the analysis's one level without --stack runs (its capacity curve: every reference).
ONE_LEVEL_PLACEMENT = "inclusive"
#: Placement rules that read ``selective_hits``.
SELECTIVE = ("write-through-selective",)
DEFAULT_SELECTIVE_HITS = 1

PLACEMENT_DOCS = {
    "write-back": "a computed block into the top level; what a level evicts into the level below "
                  "(SGLang HiCache write_back; Dynamo KVBM's offload on eviction)",
    "write-through": "a computed block into every level; a served block is not written again "
                     "(SGLang HiCache write_through)",
    "write-through-selective": "a computed block into the top level; into the levels below once served "
                               "selective_hits times (HiCache write_through_selective; KVBM's presence_lfu "
                               "G2->G3 filter)",
    "inclusive": "every referenced block, computed or served, into every level (an upper bound, no engine's rule)",
}


def check_placement(name, where: str = "placement") -> str:
    """``name`` if it is a placement rule; ConfigError (one line, naming ``where``) otherwise."""
    if name not in PLACEMENTS:
        raise ConfigError(f"{where}: unknown placement {name!r} (known: {', '.join(PLACEMENTS)})")
    return name


def check_selective_hits(value, where: str = "selective_hits") -> int:
    """``value`` as the selective rule's hit count: a whole number (an int, a whole float, or the
    text of an int) from 1 to 2^20; ConfigError (one line, naming ``where``) otherwise."""
    hits = None
    if isinstance(value, int) and not isinstance(value, bool):
        hits = value
    elif isinstance(value, float) and value == value and abs(value) < 2**53 and value.is_integer():
        hits = int(value)
    elif isinstance(value, str):
        try:
            hits = int(value.strip())
        except ValueError:
            hits = None
    if hits is None or not 1 <= hits <= 1 << 20:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ConfigError(f"{where}: selective_hits is a whole number from 1 to {1 << 20}, got {shown}")
    return hits


def check_warmup(warmup, where: str = "--warmup") -> float:
    """The warm-up share: a number, 0 <= F < 1; ConfigError otherwise."""
    check_number(warmup, where, 0.0, 1.0)
    if not warmup < 1.0:
        raise ConfigError(f"{where} must be below 1 (some requests must be counted)")
    return float(warmup)


def first_counted(warmup: float, n_requests: int) -> int:
    """The first counted request (its index in arrival order) under ``--warmup`` ``warmup``: the
    ``floor(warmup x n_requests)`` before it warm the levels and are not counted."""
    return int(math.floor(float(warmup) * int(n_requests)))


__all__ = ["DEFAULT_PLACEMENT", "DEFAULT_SELECTIVE_HITS", "ONE_LEVEL_PLACEMENT", "PLACEMENTS", "PLACEMENT_DOCS",
           "SELECTIVE", "check_placement", "check_selective_hits", "check_warmup", "first_counted"]
