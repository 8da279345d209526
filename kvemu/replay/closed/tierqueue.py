"""One tier shared by several closed-loop instances: the engine side's shared cache or pool
(shared_tier), and the queue their KV traffic waits in on an emulated tier (TierQueue)."""

from __future__ import annotations

import threading

from ...engine.pool import BlockPool, ChunkTierCache, TierCache
from ...engine.scheduler import EngineConfig
from ...schema import OPS


class TierQueue:
    """One emulated tier shared by several instances, as a FIFO queue at step granularity: a step's
    KV bytes (all layers) occupy the tier for bytes / bandwidth from when it is free; a step that
    loads or reads waits until the traffic queued before it has passed. The C model already charges
    each step its own medium time, so the queue adds only the wait for earlier traffic. Steps are
    served in timeline order (the router's lockstep)."""

    def __init__(self, bandwidth_gbps: float):
        self.gbps = float(bandwidth_gbps)
        self.free_ns = 0.0
        self.lock = threading.Lock()
        self.bytes = 0
        self.waited_ns = 0

    def serve(self, start: int, e: dict, block_bytes_all_layers: int) -> int:
        blocks = {op: int(e[f"{op}_count"].sum()) for op in OPS}
        nbytes = sum(blocks.values()) * block_bytes_all_layers
        return self.serve_bytes(start, nbytes, blocks["load"] + blocks["read"] > 0)

    def serve_bytes(self, start: int, nbytes: int, critical: bool) -> int:
        """``nbytes`` put on the tier at ``start``; returns how long the traffic waits (``critical``:
        a load or read, which waits for what was queued before it; stores do not wait)."""
        with self.lock:
            wait = max(0.0, self.free_ns - start) if critical else 0.0
            self.free_ns = max(self.free_ns, float(start)) + nbytes / self.gbps
            self.bytes += nbytes
            self.waited_ns += int(round(wait))
        return int(round(wait))


def shared_tier(cfg: EngineConfig, sharing: str, n: int, chunks: int | None = None, chunk_blocks: int = 1) -> list:
    """The engine-side tier of each of n instances: one shared TierCache (offload) or block pool
    (resident) for a shared tier, one each when replicated; None each when the policy has no tier.
    ``chunks`` (``--tier-capacity``, offload): the tier holds that many chunks of ``chunk_blocks``
    blocks, evicted whole and LRU as the replay's arena evicts them (ChunkTierCache)."""
    def make():
        if cfg.tier_policy == "offload" and chunks is not None:
            return ChunkTierCache(chunks, chunk_blocks)
        if cfg.tier_policy == "offload":
            return TierCache(cfg.tier_capacity_blocks)
        if cfg.tier_policy == "resident":
            return BlockPool(cfg.tier_capacity_blocks)
        return None
    if sharing == "shared":
        one = make()
        return [one] * n
    return [make() for _ in range(n)]
