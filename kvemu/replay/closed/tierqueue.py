"""One tier shared by several closed-loop instances: the engine side's shared cache or pool
(shared_tier), and the queue their KV traffic waits in on an emulated tier (TierQueue)."""

from __future__ import annotations

import bisect
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
    blocks, evicted whole as the replay's arena evicts them (ChunkTierCache); each evicts by
    ``cfg.tier_eviction`` (a kvemu.policies name)."""
    def make():
        if cfg.tier_policy == "offload" and chunks is not None:
            return ChunkTierCache(chunks, chunk_blocks, cfg.tier_eviction)
        if cfg.tier_policy == "offload":
            return TierCache(cfg.tier_capacity_blocks, cfg.tier_eviction)
        if cfg.tier_policy == "resident":
            return BlockPool(cfg.tier_capacity_blocks)
        return None
    if sharing == "shared":
        one = make()
        return [one] * n
    return [make() for _ in range(n)]


class MediumLog(TierQueue):
    """The prefill side's traffic on the pool's medium in a disaggregated deployment (TierQueue's
    FIFO at step granularity), with the interval each step's bytes occupy the medium kept, so that
    the decode side, replayed after it, queues among them (BehindQueue). ``wait``: its instances'
    loads wait for the traffic queued before them (several prefill instances on one medium)."""

    def __init__(self, bandwidth_gbps: float, wait: bool):
        super().__init__(bandwidth_gbps)
        self.wait = wait
        self.busy: list = []          # disjoint [start, end) ns, in order

    def serve_bytes(self, start: int, nbytes: int, critical: bool) -> int:
        with self.lock:
            s = max(self.free_ns, float(start))
        wait = super().serve_bytes(start, nbytes, critical and self.wait)
        with self.lock:
            if self.busy and self.busy[-1][1] >= s:
                self.busy[-1] = (self.busy[-1][0], self.free_ns)
            elif self.free_ns > s:
                self.busy.append((s, self.free_ns))
        return wait


class BehindQueue(TierQueue):
    """The decode side's traffic on the pool's medium, after the prefill side's (``busy``, from
    MediumLog): the prefill side goes first (it does not depend on the decode side, which is replayed
    after it), and the decode side's traffic, FIFO among its instances, is served in the medium's
    idle time between the prefill side's intervals. A load or read waits for as long as its bytes
    are held up beyond their own bytes / bandwidth; stores do not wait, and take medium time."""

    def __init__(self, bandwidth_gbps: float, busy: list):
        super().__init__(bandwidth_gbps)
        self.busy = list(busy)
        self.ends = [e for _, e in self.busy]
        self.behind_ns = 0            # of the waits, the part spent behind the prefill side's traffic

    def serve_bytes(self, start: int, nbytes: int, critical: bool) -> int:
        dur = nbytes / self.gbps
        with self.lock:
            t = max(self.free_ns, float(start))
            t0, left = t, dur
            k = bisect.bisect_right(self.ends, t)
            while True:
                if k < len(self.busy) and self.busy[k][0] <= t:
                    t = self.busy[k][1]
                    k += 1
                    continue
                gap = self.busy[k][0] - t if k < len(self.busy) else float("inf")
                if gap >= left:
                    t += left
                    break
                left -= gap
                t = self.busy[k][1]
                k += 1
            wait = max(0.0, t - dur - start) if critical else 0.0
            self.free_ns = t
            self.bytes += nbytes
            self.waited_ns += int(round(wait))
            self.behind_ns += int(round(max(0.0, t - t0 - dur))) if critical else 0
        return int(round(wait))
