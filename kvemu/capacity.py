"""KV cache hierarchies for analysis: a stack of levels below HBM, each with a capacity and a policy,
and what each level serves of a trace's prompts, the modelled TTFT, and the cost (docs/analysis.md,
"A stack of levels").

Placement rules (kvemu.stackrules, the names ``replay --tiers`` takes too): ``write-back``
(default), ``write-through``, ``write-through-selective`` and ``inclusive``, with ``promote`` and
``selective_hits``. A prompt block is served by HBM when the trace's own HBM prefix cache held it
(``cached_tokens`` less ``tier_hit_tokens``); prefix caching: a token counts as served only when
its block and every earlier block of its prompt were served by some level (or HBM); the first block
no level holds, and every block after it, is recomputed.

- ``inclusive``: every level sees the whole prompt-block reference stream
  (analysis.input_block_stream), HBM-served blocks included; each level is a cache of its own
  capacity and policy on that stream, starting empty (the fast paths below), and a block is served
  by the first level, top down, that holds it.
- the other rules: the levels are one stack, run request by request in arrival order as the
  replay's stack (replay.stack.TierStack) runs them: a request's blocks past its HBM hit are looked
  up top down until the first block no level holds (at most all but its last token); each block
  found is served by the first level holding it (a use of it there; promoted or copied down as the
  rule says); the blocks it computes are written as the rule says (:class:`_StackRun`: one Python
  call per block, the slow path; whole blocks, as a replay with one block per chunk).

Policies are kvemu.policies' by name: LRU hits come from the exact stack distances (every capacity
at once); FIFO, optimal (Belady's MIN) and S3-FIFO are simulated per capacity in C
(cbackends/policies.c); a policy without a fast path runs its Python object over the stream
(policies.simulate_hits: one Python call per reference, the slow path).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .analysis import _pool_block_bytes, compute_from_meta, input_block_stream, prefill_ns, prefix_load_bytes
from .backends import policy_hits, stack_distances
from .errors import ConfigError
from .inputs import read_toml
from .policies import get_policy, make_policy, policy_names, simulate_hits
from .prices import DEFAULT_AMORTISE_YEARS, Held, priced_duration_s, run_cost
from .profiles import resolve_profile
from .stackrules import (DEFAULT_PLACEMENT, DEFAULT_SELECTIVE_HITS, check_placement, check_selective_hits,
                         check_warmup, first_counted)
from .units import parse_size

#: Every known policy (kvemu.policies' registry): the analysis runs them all.
POLICIES = policy_names()


@dataclass(frozen=True)
class Level:
    """One level below HBM: ``profile`` (a kvemu.profiles.Profile) gives its latency and bandwidth
    and, by its name, the medium it is priced as; ``policy`` None takes the run's policy."""

    name: str
    profile: object
    capacity_bytes: int
    policy: str | None = None

    def describe(self, policy: str) -> dict:
        return {"name": self.name, "profile": self.profile.name, "capacity_bytes": self.capacity_bytes,
                "policy": self.policy or policy, "bandwidth_gbps": self.profile.bandwidth_gbps,
                "latency_ns": self.profile.latency_ns}


def _check_policy(p: str, where: str) -> str:
    get_policy(p, where)
    return p


def parse_policies(text: str) -> tuple[str, ...]:
    out = tuple(p.strip() for p in str(text).split(",") if p.strip())
    if not out:
        raise ConfigError(f"--policies names no policy (known: {', '.join(POLICIES)})")
    for p in out:
        _check_policy(p, "--policies")
    if len(set(out)) != len(out):
        raise ConfigError("--policies names a policy twice")
    return out


def _level(name, profile_ref, size, policy, where) -> Level:
    if not isinstance(name, str) or not name.strip() or any(c in name for c in "=:,"):
        raise ConfigError(f"{where}: a level needs a name (no '=', ':' or ',' in it), got {name!r}")
    cap = parse_size(str(size), f"{where}: level {name} capacity")
    if policy is not None:
        _check_policy(policy, f"{where}: level {name}")
    return Level(name=name, profile=resolve_profile(profile_ref), capacity_bytes=cap, policy=policy)


def parse_stack(text: str) -> list[Level]:
    """``NAME=SIZE[:POLICY],...`` (NAME a built-in tier profile, top level first) or a TOML file of
    ``[[tier]]`` tables (name, profile, capacity, policy). ConfigError, one line, otherwise."""
    text = str(text).strip()
    if text.endswith(".toml"):
        p = Path(text)
        _, data = read_toml(p, "--stack file")
        tiers = data.get("tier")
        if not isinstance(tiers, list) or not tiers or set(data) - {"tier"}:
            raise ConfigError(f"--stack file {p}: expected [[tier]] tables only (name, profile, capacity, policy)")
        levels = []
        for i, t in enumerate(tiers):
            where = f"--stack file {p}, tier {i + 1}"
            if not isinstance(t, dict) or set(t) - {"name", "profile", "capacity", "policy"} or "capacity" not in t:
                raise ConfigError(f"{where}: keys are name, profile, capacity (needed) and policy")
            name = t.get("name", t.get("profile"))
            levels.append(_level(name, t.get("profile", name), t["capacity"], t.get("policy"), where))
    else:
        levels = []
        for part in text.split(","):
            name, eq, rest = part.strip().partition("=")
            if not eq:
                raise ConfigError(f"--stack: '{part.strip()}' is not NAME=SIZE[:POLICY] (e.g. local-dram=1TiB:lru)")
            size, _, policy = rest.partition(":")
            levels.append(_level(name.strip(), name.strip(), size.strip(), policy.strip() or None, "--stack"))
    names = [lv.name for lv in levels]
    if len(set(names)) != len(names):
        raise ConfigError("--stack names a level twice")
    if not levels:
        raise ConfigError("--stack has no level")
    return levels


def parse_sweep(text: str, levels: list[Level]) -> tuple[str, list[int]]:
    """``LEVEL=SIZE,SIZE,...``: the level to vary (one of the stack's) and its capacities."""
    name, eq, sizes = str(text).partition("=")
    name = name.strip()
    if not eq or not sizes.strip():
        raise ConfigError("--sweep is LEVEL=SIZE,SIZE,... (e.g. cxl-pool=0,1TiB,4TiB,16TiB)")
    if name not in [lv.name for lv in levels]:
        raise ConfigError(f"--sweep level '{name}' is not in the stack (levels: {', '.join(lv.name for lv in levels)})")
    caps = [parse_size(s.strip(), f"--sweep {name} size") for s in sizes.split(",")]
    if len(caps) > 1000:
        raise ConfigError("--sweep takes at most 1000 sizes")
    return name, caps


class StackAnalysis:
    """One trace's prompt-block stream, with what every (policy, capacity) of a level hits, computed
    once and reused across levels, policies and sweep points."""

    def __init__(self, trace, warmup: float = 0.0):
        check_warmup(warmup)
        self.trace = trace
        h = trace.header
        self.tpb = h.tokens_per_block

        self.block_bytes = _pool_block_bytes(trace)  # a table block: every layer's, or the growing KV groups
        self.ids, self.req = input_block_stream(trace)
        self.id_space = int(h.meta["blocks"]["id_space"])
        n_full = trace.input_tokens // self.tpb
        self.seg_begin = np.cumsum(n_full) - n_full
        self.pos = np.arange(len(self.ids)) - self.seg_begin[self.req]
        hbm_tokens = trace.cached_tokens.astype(np.int64) - trace.tier_hit_tokens.astype(np.int64)
        self.hbm = self.pos < (hbm_tokens // self.tpb)[self.req]
        # LRU stack distances (every LRU capacity at once); a first reference's is UINT64_MAX
        self._dist = stack_distances(self.ids, self.id_space)
        self.unique = int(np.count_nonzero(self._dist == np.iinfo(np.uint64).max))
        self.first_counted = first_counted(warmup, trace.n_requests)
        self.warmup = float(warmup)
        self._hits: dict = {}
        self._prefill_memo: dict = {}

    def grid(self, points: int) -> list[int]:
        """``points`` log-spaced capacities in blocks, from 1 to the unique blocks (as capacity_curve's)."""
        return np.unique(np.geomspace(1, max(self.unique, 1), points).astype(np.int64)).tolist()

    def prefill_ns(self, new, cached) -> np.ndarray:
        """analysis.prefill_ns, each (new, cached) pair computed once per analysis."""
        if not hasattr(self, "_timing"):  # the trace's compute model, as record priced its steps
            self._timing = compute_from_meta(self.trace.header.meta)
        key = np.asarray(new, np.int64) << 32 | np.asarray(cached, np.int64)
        uniq, inv = np.unique(key, return_inverse=True)
        memo = self._prefill_memo
        todo = [k for k in uniq.tolist() if k not in memo]
        if todo:
            t = np.asarray(todo, np.int64)
            memo.update(zip(todo, prefill_ns(self._timing, t >> 32, t & 0xFFFFFFFF).tolist()))
        return np.array([memo[k] for k in uniq.tolist()], np.float64)[inv.reshape(-1)]

    def level_hits(self, policy: str, capacity_blocks: int) -> np.ndarray:
        """Whether each reference hits in a ``policy`` cache of ``capacity_blocks`` on the whole stream."""
        key = (policy, int(capacity_blocks))
        if key not in self._hits:
            fast = get_policy(policy).fast_path
            if fast == "stack-distance":
                hit = self._dist < np.uint64(capacity_blocks)  # first references: UINT64_MAX, never below
            elif capacity_blocks >= self.unique:  # everything fits: every policy misses first references only
                hit = self._dist < np.uint64(self.unique)
            elif capacity_blocks <= 0:
                hit = np.zeros(len(self.ids), bool)
            elif fast is not None:
                hit = policy_hits(self.ids, self.id_space, int(capacity_blocks), fast)
            else:
                hit = simulate_hits(policy, self.ids, int(capacity_blocks))
            self._hits[key] = hit
        return self._hits[key]

    def evaluate(self, levels: list[Level], policy: str, *, prices=None, amortise_years=None,
                 placement: str = DEFAULT_PLACEMENT, promote: bool = False,
                 selective_hits: int = DEFAULT_SELECTIVE_HITS, per_request: bool = False) -> dict:
        """Per level: the share of prompt tokens it serves, its block hit ratio; the modelled TTFT
        (``ttft_ms``: queued at the trace's offered load, :func:`queued_ttft`; ``ttft_unloaded_ms``:
        each request's prefill and loads alone), GPU time (the levels' loads stall their steps) and,
        with ``prices``, the cost; under ``placement`` (a
        kvemu.stackrules rule) with ``promote`` and ``selective_hits``. ``per_request``: also
        ``per_request_ms``, each counted request's ``ttft``, ``tpot`` (nan: one output token) and
        ``arrival`` (numpy arrays, ms; what ``ttft_ms`` and ``tpot_ms`` summarise)."""
        check_placement(placement, "--placement")
        selective_hits = check_selective_hits(selective_hits, "--selective-hits")
        tr, tpb = self.trace, self.tpb
        n_req = tr.n_requests
        inp = tr.input_tokens.astype(np.int64)
        if placement == "inclusive":  # promotion adds nothing: every level gets every block
            tokens, block_hit_ratio, misses = self._inclusive(levels, policy)
        else:
            tokens, block_hit_ratio, misses = self._stacked(levels, policy, placement, promote, selective_hits)
        hbm_t = np.minimum(tokens[-1], inp - 1)
        # at least one prompt token is computed: the lowest levels give up what exceeds input - 1
        room = inp - 1 - hbm_t
        lvl_t = []
        for k in range(len(levels)):
            t = np.minimum(tokens[k], room)
            room = room - t
            lvl_t.append(t)
        cached = hbm_t + sum(lvl_t) if levels else hbm_t
        unloaded_ns, compute_ns = self._ttft(levels, hbm_t, lvl_t, cached)
        counted = np.arange(n_req) >= self.first_counted
        total_in = int(inp[counted].sum())
        share = lambda t: float(t[counted].sum() / total_in) if total_in else 0.0  # noqa: E731
        busy_s = ttft_ns = None
        if compute_ns is not None:
            stall_ns = unloaded_ns - compute_ns  # the levels' loads, inside the prefill step (in-step)
            busy_s = self._busy_s(compute_ns) + float(stall_ns.sum()) / 1e9
            ttft_ns = self.queued_ttft_ns(unloaded_ns, busy_s)
        t_c = ttft_ns[counted] / 1e6 if ttft_ns is not None else None
        u_c = unloaded_ns[counted] / 1e6 if unloaded_ns is not None else None
        point = {
            "policy": policy, "placement": placement, "promote": bool(promote), "selective_hits": selective_hits,
            "levels": [lv.describe(policy) | {"hit_share": share(lvl_t[k]), "block_hit_ratio": block_hit_ratio[k],
                                              "served_tokens": int(lvl_t[k][counted].sum())}
                       for k, lv in enumerate(levels)],
            "hbm_share": share(hbm_t),
            "recompute_share": 1.0 - share(cached),
            "ttft_ms": _stats(t_c),
            "ttft_unloaded_ms": _stats(u_c),
        }
        if compute_ns is not None:
            point["queue_wait_ms"] = _stats((ttft_ns - unloaded_ns)[counted] / 1e6)
            point["load_stall_s"] = float(stall_ns.sum()) / 1e9
            point["queue_model"] = QUEUE_MODEL
            point["checked_against_replay"] = QUEUE_CHECK
            out_tokens = int(tr.output_tokens.sum())
            gpus = int(tr.header.meta["gpu"].get("gpus", 1))
            point["gpu_busy_s"] = busy_s
            point["tpot_ms"] = self._tpot(busy_s, counted)
            point["tpot_step_ms"] = self._tpot_step(busy_s)
            point["throughput_output_tokens_per_s"] = out_tokens / busy_s if busy_s > 0 else None
            held_s = self.priced_duration_s(ttft_ns, busy_s)
            point["priced_duration_s"] = held_s
            if per_request:
                point["per_request_ms"] = {"ttft": t_c, "tpot": self._tpot_each_ns(busy_s)[counted] / 1e6,
                                           "arrival": np.asarray(tr.arrival_ms, np.float64)[counted]}
            if prices is not None:
                point["cost"] = run_cost(
                    prices, gpu=tr.header.meta["gpu"].get("name"), gpus=gpus, instances=1, duration_s=held_s,
                    output_tokens=out_tokens, requests=n_req,
                    amortise_years=DEFAULT_AMORTISE_YEARS if amortise_years is None else amortise_years,
                    capacities=self.held(levels, policy, misses))
        return point

    def completion_ns(self, ttft_ns, busy_s: float) -> np.ndarray:
        """Each request's modelled completion (ns, on the trace's arrival clock): its arrival, its
        queued TTFT (``ttft_ns``, :meth:`queued_ttft_ns`) and its modelled decode, its output tokens
        after the first at its modelled TPOT (the recorded TPOT scaled by ``busy_s`` over the
        recorded busy time, as ``tpot_ms``; none for a request that decoded no token when recorded)."""
        arr = np.round(np.asarray(self.trace.arrival_ms, np.float64) * 1e6)
        rec = float(np.asarray(self.trace.compute_ns, np.float64).sum())
        scale = busy_s * 1e9 / rec if rec > 0 else 1.0
        return modelled_completion_ns(arr, ttft_ns, self.recorded_tpot_ns() * scale, self.trace.output_tokens)

    def priced_duration_s(self, ttft_ns, busy_s: float) -> float:
        """The duration the point is priced over (s): prices.priced_duration_s, the rule a replay's
        cost takes too, over the trace's arrivals and the modelled completions
        (:meth:`completion_ns`), never below the modelled GPU busy time ``busy_s``."""
        arr = np.round(np.asarray(self.trace.arrival_ms, np.float64) * 1e6)
        return priced_duration_s(arr, self.completion_ns(ttft_ns, busy_s), busy_s)

    def recorded_ttft_ns(self) -> np.ndarray:
        """Each request's TTFT on the trace's recorded engine timeline (ns): the end of its last
        prefill step less its arrival, the engine's batching and queueing at the recorded cached
        tokens; -1 for a request no prefill step of the trace carries."""
        if not hasattr(self, "_recorded_ttft"):
            self._recorded_ttft, self._recorded_tpot = recorded_timeline(self.trace)
        return self._recorded_ttft

    def recorded_tpot_ns(self) -> np.ndarray:
        """Each request's TPOT on the trace's recorded engine timeline (ns): from the end of its first
        token's step to the end of its last step, over its output tokens after the first; nan for a
        request of one output token (or none recorded)."""
        self.recorded_ttft_ns()
        return self._recorded_tpot

    def recorded_service_ns(self) -> np.ndarray:
        """Each request's prefill alone at its recorded cached tokens (ns): its service when recorded."""
        if not hasattr(self, "_recorded_service"):
            tr = self.trace
            inp = tr.input_tokens.astype(np.int64)
            c = tr.cached_tokens.astype(np.int64)
            self._recorded_service = self.prefill_ns(inp - c, c)
        return self._recorded_service

    def queued_ttft_ns(self, service_ns, busy_s: float | None = None) -> np.ndarray:
        """Each request's TTFT with queueing at the trace's offered load (ns), :func:`queued_ttft`
        over the trace's arrivals, its recorded engine timeline and ``service_ns`` (each request's
        prefill and in-step loads alone, the unloaded TTFT); the engine's other waits stretched by
        ``busy_s`` (the modelled GPU busy time) over the recorded busy time (None: as recorded)."""
        arr = np.round(np.asarray(self.trace.arrival_ms, np.float64) * 1e6)
        rec = float(np.asarray(self.trace.compute_ns, np.float64).sum()) / 1e9
        scale = busy_s / rec if busy_s is not None and rec > 0 else 1.0
        return queued_ttft(arr, service_ns, self.recorded_ttft_ns(), self.recorded_service_ns(), scale)

    def _inclusive(self, levels, policy):
        """``inclusive`` without promotion: per level, whether each reference of the whole stream hits
        in a cache of the level's capacity and policy (the fast paths); per request the tokens each
        level (and HBM, key -1) serves within the prefix; each level's block hit ratio over the
        counted references; the blocks written into each level (the references it missed)."""
        tpb, n_req = self.tpb, self.trace.n_requests
        n_lv = len(levels)
        reach, req, seg = self._reachable()
        served = np.full(len(req), n_lv, np.int8 if n_lv < 127 else np.int16)  # n_lv: no level holds it
        block_hit_ratio = []
        misses = [0] * n_lv
        for k in range(n_lv - 1, -1, -1):  # bottom up, so the top level that holds a block wins
            lv = levels[k]
            hit, n_hit, ratio = self._level_hits_reach(lv.policy or policy, lv.capacity_bytes // self.block_bytes)
            served[hit] = k
            misses[k] = int(len(self.ids) - n_hit) if lv.capacity_bytes >= self.block_bytes else 0
            block_hit_ratio.insert(0, ratio)
        served[self.hbm[reach]] = -1
        nbad = np.cumsum(served == n_lv, dtype=np.int32)
        before = np.where(seg > 0, nbad[np.maximum(seg - 1, 0)], 0)
        prefix = nbad == before[req]
        # one count of (request, serving level) over the prefix: column 0 HBM (-1), k + 1 level k
        key = req[prefix].astype(np.int64) * (n_lv + 2) + (served[prefix].astype(np.int64) + 1)
        counts = np.bincount(key, minlength=n_req * (n_lv + 2)).reshape(n_req, n_lv + 2)
        tokens = {k: counts[:, k + 1].astype(np.int64) * tpb for k in range(-1, n_lv)}
        return tokens, block_hit_ratio, misses

    def _reachable(self):
        """The references that some cache may serve within its request's prefix: those before the
        request's first reference to a block never referenced before that HBM does not serve (no
        cache holds a block it has never seen, so the prefix ends there whatever the levels);
        their indices into the stream, their requests, and each request's first among them."""
        if not hasattr(self, "_reach"):
            first = (self._dist == np.iinfo(np.uint64).max) & ~self.hbm
            n_first = np.cumsum(first, dtype=np.int64)
            before = np.where(self.seg_begin > 0, n_first[np.maximum(self.seg_begin - 1, 0)], 0)
            reach = np.flatnonzero((n_first - first) == before[self.req])  # no first reference before it
            req = self.req[reach]
            n = np.bincount(req, minlength=self.trace.n_requests)
            self._reach = (reach, req, np.cumsum(n) - n)
        return self._reach

    def _level_hits_reach(self, policy: str, capacity_blocks: int):
        """:meth:`level_hits` on the reachable references, the hits on the whole stream, and the
        block hit ratio over the counted references (the stream's tail: it is in request order)."""
        key = (policy, int(capacity_blocks))
        memo = self.__dict__.setdefault("_reach_hits", {})
        if key not in memo:
            hit = self.level_hits(policy, capacity_blocks)
            n_req = self.trace.n_requests
            s0 = int(self.seg_begin[self.first_counted]) if self.first_counted < n_req else len(self.ids)
            ratio = np.count_nonzero(hit[s0:]) / (hit.size - s0) if hit.size > s0 else 0.0
            memo[key] = (hit[self._reachable()[0]], int(np.count_nonzero(hit)), ratio)
        return memo[key]

    def _stacked(self, levels, policy, placement, promote, selective_hits):
        """The other rules: the stack run request by request
        (:class:`_StackRun`). Returns what :meth:`_inclusive` does; a level's block hit ratio is
        the blocks it served over the counted blocks looked up below HBM."""
        tpb, tr = self.tpb, self.trace
        n_req = tr.n_requests
        caps = [lv.capacity_bytes // self.block_bytes for lv in levels]
        pols = [lv.policy or policy for lv in levels]
        for lv, p in zip(levels, pols):
            if not get_policy(p).online:
                raise ConfigError(f"level {lv.name}: policy {p} needs every future access; it runs under "
                                  f"--placement inclusive only (the levels as independent caches of the stream)")
        run = _StackRun(caps, pols, placement, promote, selective_hits)
        inp = tr.input_tokens.astype(np.int64)
        n_full = inp // tpb
        limit = np.minimum((inp - 1) // tpb, n_full)
        hbm_blocks = np.minimum(np.bincount(self.req[self.hbm], minlength=n_req), limit)
        served = np.zeros((len(levels), n_req), np.int64)
        looked = 0
        ids = self.ids.tolist()
        begin = self.seg_begin.tolist()
        for r in range(n_req):
            b0 = begin[r]
            h, lim, nf = int(hbm_blocks[r]), int(limit[r]), int(n_full[r])
            got = run.request(ids[b0 + h:b0 + lim], ids[b0 + lim:b0 + nf] if nf > lim else [])
            served[:, r] = got
            if r >= self.first_counted:
                looked += lim - h
        tokens = {-1: hbm_blocks.astype(np.int64) * tpb}
        counted = np.arange(n_req) >= self.first_counted
        ratio = []
        for k in range(len(levels)):
            tokens[k] = served[k] * tpb
            ratio.append(float(served[k][counted].sum() / looked) if looked else 0.0)
        return tokens, ratio, run.written

    def held(self, levels: list[Level], policy: str, misses: list[int]) -> list:
        """The levels as the cost prices them (prices.Held): each level's capacity as given, and the
        bytes written into it (all layers): under ``inclusive`` every reference it misses stores its
        block (with ``optimal``, which may leave a missed block out, an upper bound); under the other
        rules the blocks the stack run wrote into it."""
        return [Held(lv.name, lv.profile.name, lv.capacity_bytes, "the level's capacity",
                     misses[k] * self.block_bytes) for k, lv in enumerate(levels)]

    def _ttft(self, levels, hbm_t, lvl_t, cached):
        """Modelled TTFT of each request (ns): its prefill alone (the trace's GPU model, no batching,
        no queueing) with ``cached`` tokens not computed, plus each level's tokens loaded at its
        profile's bandwidth after its latency. None without a GPU model (a real run's trace)."""
        if "gpu" not in self.trace.header.meta:
            return None, None
        inp = self.trace.input_tokens.astype(np.int64)
        compute = self.prefill_ns(inp - cached, cached)
        # KV bytes per cached token: the model's KV groups at each request's cached length (a windowed
        # layer loads its window once, however long the prefix), spread over the levels' tokens
        model = self._timing.model
        kv = (model.kv_bytes_per_token if model.uniform else
              prefix_load_bytes(model, cached) / np.maximum(np.asarray(cached, np.float64), 1.0))
        t = compute.copy()
        for lv, tok in zip(levels, lvl_t):
            t += np.where(tok > 0, lv.profile.latency_ns + tok * kv / lv.profile.bandwidth_gbps, 0.0)
        return t, compute

    def _tpot(self, busy_s: float, counted) -> dict | None:
        """Modelled TPOT (ms) of each counted request that decoded: its TPOT on the recorded engine
        timeline (:meth:`recorded_tpot_ns`, the batch it decoded in at the trace's offered load),
        scaled by the stack's modelled GPU busy time (stalls included) over the recorded busy time
        (the prefill and loads the stack saves or adds spread over every step)."""
        rec = float(np.asarray(self.trace.compute_ns, np.float64).sum())
        t = self._tpot_each_ns(busy_s)[counted]
        t = t[np.isfinite(t)]
        if rec <= 0 or not len(t):
            return None
        return _stats(t / 1e6)

    def _tpot_each_ns(self, busy_s: float) -> np.ndarray:
        """Each request's modelled TPOT (ns; :meth:`_tpot`'s rule): its recorded TPOT scaled by
        ``busy_s`` over the recorded busy time (as recorded when that is 0)."""
        rec = float(np.asarray(self.trace.compute_ns, np.float64).sum())
        return self.recorded_tpot_ns() * (busy_s * 1e9 / rec if rec > 0 else 1.0)

    def _tpot_step(self, busy_s: float) -> dict | None:
        """Modelled step time (ms; the figure ``tpot_ms`` was before queueing was modelled): a
        decoding request emits one token per step, so a token takes one
        step's time; the step times are the trace's recorded ones, each scaled by the stack's modelled
        GPU busy time over the recorded busy time (the prefill the stack saves or adds spread over
        every step). p50/p99 over the steps that decoded (every step of a trace, as recorded)."""
        st = np.asarray(self.trace.compute_ns, np.float64)
        rec = float(st.sum())
        if not len(st) or rec <= 0:
            return None
        t = st * (busy_s * 1e9 / rec) / 1e6
        return {"mean": float(t.mean()), "p50": float(np.percentile(t, 50)), "p90": float(np.percentile(t, 90)),
                "p99": float(np.percentile(t, 99))}

    def _busy_s(self, compute_ns) -> float:
        """Modelled GPU busy time without the levels' loads (:meth:`evaluate` adds them: a load inside
        the prefill step stalls the step): the trace's recorded step time, each request's prefill
        changed from what it computed when recorded (its recorded cached tokens) to what it computes
        with the stack."""
        tr = self.trace
        rec = float(self.recorded_service_ns().sum())
        return max(0.0, (float(tr.compute_ns.sum()) - rec + float(compute_ns.sum())) / 1e9)


def recorded_timeline(trace) -> tuple[np.ndarray, np.ndarray]:
    """Each request's TTFT and TPOT on a trace's recorded engine timeline (ns, float): TTFT the end
    of its last prefill step less its arrival (-1 for a request no prefill step carries); TPOT from
    that step's end to the end of its last step over its output tokens after the first (nan for one
    output token or none recorded). The engine's batching and queueing at the recorded cached tokens."""
    from .schema import iter_entries

    last = np.full(trace.n_requests, -1, np.int64)
    final = np.full(trace.n_requests, -1, np.int64)
    for e in iter_entries(trace, columns=("step", "request_id", "phase")):
        pf = e["phase"] == 0
        rid, step = e["request_id"].astype(np.int64), e["step"].astype(np.int64)
        np.maximum.at(last, rid[pf], step[pf])
        np.maximum.at(final, rid, step)
    end = np.asarray(trace.start_ns, np.int64) + np.asarray(trace.compute_ns, np.int64)
    arr = np.round(np.asarray(trace.arrival_ms, np.float64) * 1e6)
    ttft = np.where(last >= 0, end[np.maximum(last, 0)] - arr, -1.0).astype(np.float64)
    out = trace.output_tokens.astype(np.int64)
    decoded = (last >= 0) & (out > 1)
    tpot = np.where(decoded, (end[np.maximum(final, 0)] - end[np.maximum(last, 0)]) / np.maximum(out - 1, 1), np.nan)
    return ttft, tpot


def curve_queued_ttft(trace, curve: dict, compute_ns, load_bytes, load_gbps: float,
                      prefill_memo: dict | None = None) -> list[dict]:
    """The one-level capacity curve's TTFT with queueing (:func:`queued_ttft`, as the stack form's):
    per capacity of ``curve``, each request's service its prefill (``compute_ns``, analysis.
    capacity_ttft_parts) plus its cached prefix loaded at ``load_gbps``; the GPU busy time the
    recorded one with those services in place of the recorded prefills (loads stall their step).
    Rows of mean, p50 and p99 (ms), and the busy time (s). ``prefill_memo``: the pairs' prefill
    times capacity_ttft_parts gave for the same trace (analysis.prefill_key), reused for the
    recorded pairs (most of them are the grid's)."""
    from .analysis import compute_from_meta, prefill_key, prefill_ns

    inp = trace.input_tokens.astype(np.int64)
    c = trace.cached_tokens.astype(np.int64)
    keys, inv = np.unique(prefill_key(inp - c, c), return_inverse=True)
    memo = prefill_memo if prefill_memo is not None else {}
    todo = [k for k in keys.tolist() if k not in memo]
    if todo:
        t = np.asarray(todo, np.int64)
        memo.update(zip(todo, prefill_ns(compute_from_meta(trace.header.meta), t >> 32, t & 0xFFFFFFFF).tolist()))
    rec_service = np.array([memo[k] for k in keys.tolist()], np.float64)[inv.reshape(-1)]
    rec_ttft, _ = recorded_timeline(trace)
    rec_busy = float(np.asarray(trace.compute_ns, np.float64).sum())
    arr = np.round(np.asarray(trace.arrival_ms, np.float64) * 1e6)
    rows = []
    for comp, b in zip(compute_ns, load_bytes):
        service = np.asarray(comp, np.float64) + np.asarray(b, np.float64) / load_gbps
        busy = max(0.0, rec_busy - float(rec_service.sum()) + float(service.sum()))
        t = queued_ttft(arr, service, rec_ttft, rec_service, busy / rec_busy if rec_busy > 0 else 1.0) / 1e6
        rows.append({"mean_ms": float(t.mean()), "p50_ms": float(np.percentile(t, 50)),
                     "p99_ms": float(np.percentile(t, 99)), "gpu_busy_s": busy / 1e9})
    return rows


def modelled_completion_ns(arrival_ns, ttft_ns, tpot_ns, output_tokens) -> np.ndarray:
    """Each request's modelled completion (ns): arrival + TTFT (queued, :func:`queued_ttft`) + its
    output tokens after the first x its TPOT (nan: it decoded none, so nothing added). Decoding is
    not queued behind the prefill server here: its batching is in the TPOT (the recorded one, scaled)."""
    tpot = np.nan_to_num(np.asarray(tpot_ns, np.float64), nan=0.0)
    after_first = np.maximum(np.asarray(output_tokens, np.int64) - 1, 0)
    return np.asarray(arrival_ns, np.float64) + np.asarray(ttft_ns, np.float64) + tpot * after_first


def _stats(t) -> dict | None:
    """mean, p50, p90 and p99 of ``t`` (ms), None for None."""
    if t is None or not len(t):
        return None
    return {"mean": float(np.mean(t)), "p50": float(np.percentile(t, 50)), "p90": float(np.percentile(t, 90)),
            "p99": float(np.percentile(t, 99))}


def fifo_waits(arrival_ns, service_ns) -> np.ndarray:
    """Waiting time of each job in a first-come-first-served single-server queue (ns), jobs in
    arrival order: Lindley's recursion W[0] = 0, W[n+1] = max(0, W[n] + S[n] - (A[n+1] - A[n]))
    (D. V. Lindley, "The theory of queues with a single server", Proc. Cambridge Phil. Soc. 48, 1952),
    in closed form W[n] = X[n] - min(X[0..n]) with X[n] = sum over k < n of S[k] - (A[k+1] - A[k])."""
    a = np.asarray(arrival_ns, np.float64)
    s = np.asarray(service_ns, np.float64)
    if not len(a):
        return np.zeros(0)
    x = np.concatenate([[0.0], np.cumsum(s[:-1] - np.diff(a))])
    return x - np.minimum.accumulate(x)


def queued_ttft(arrival_ns, service_ns, recorded_ttft_ns=None, recorded_service_ns=None,
                step_scale: float = 1.0) -> np.ndarray:
    """TTFT with queueing (ns) of requests arriving at ``arrival_ns`` (ascending) whose prefill and
    in-step loads alone take ``service_ns``: the GPU as one first-come-first-served server of prefill
    work (:func:`fifo_waits`), TTFT = wait + service.

    With the trace's recorded engine timeline (``recorded_ttft_ns``, the TTFT each request had when
    recorded, the engine's continuous batching, chunking, decode steps and admission limits in it, and
    ``recorded_service_ns``, its prefill alone then), the engine's figure is kept and only the change
    is modelled: TTFT = (recorded - (recorded wait + recorded service)) x ``step_scale`` + wait +
    service, never below ``service_ns`` (a request with no recorded figure, -1, takes the plain
    queue's). The first term is what the FIFO queue does not explain (admission behind KV memory
    or the sequence limit, chunks sharing steps with decodes): engine steps, stretched by
    ``step_scale`` (the modelled GPU busy time over the recorded one)."""
    s = np.asarray(service_ns, np.float64)
    q = fifo_waits(arrival_ns, s) + s
    if recorded_ttft_ns is None:
        return q
    rec = np.asarray(recorded_ttft_ns, np.float64)
    rs = np.asarray(recorded_service_ns, np.float64)
    rest = rec - (fifo_waits(arrival_ns, rs) + rs)  # the engine's waits the FIFO queue does not explain
    shifted = rest * step_scale + q
    return np.where(rec >= 0, np.maximum(shifted, s), q)


#: How the analysis's TTFT queues (the point's ``queue_model``; docs/analysis.md, "Queueing").
QUEUE_MODEL = ("the trace's recorded engine timeline (continuous batching at its offered load) plus the change in "
               "a first-come-first-served queue of each request's prefill and in-step loads (Lindley's recursion "
               "over the trace's arrivals); loads stall their step and count as GPU time")

#: How far the queued figures were from closed-loop replays (`replay --tiers`, vemu: levels in virtual
#: time, --layers 2) on the configurations they were checked on (docs/analysis.md, "Queueing": the table),
#: analysis over replay - 1, worst over the traces checked.
QUEUE_CHECK = {
    "checked_on": ("replay --tiers (vemu: levels, virtual time, --layers 2, write-back, lru) on traces/"
                   "chat-llama3-8b-offload and docqa-qwen2.5-72b-offload (DRAM 1 GiB / pool 0 or 4 GiB / NVMe "
                   "16 GiB), traces/mooncake-first500-llama3-70b-offload (DRAM 64 GiB / pool 0 or 256 GiB / NVMe "
                   "4 TiB) and the full Mooncake conversation trace (llama3-70b, time scale 5; DRAM 256 GiB / pool "
                   "0 or 1 TiB / NVMe 4 TiB), 2026-12-07"),
    # the largest |analysis / replay - 1| over those configurations (gpu_hours: the busy time's against the
    # replay's timeline, the range, signed)
    "ttft_p50": 0.11, "ttft_p90": 0.28, "ttft_p99": 0.35, "tpot_p50": 0.18, "gpu_hours": [-0.14, 0.09],
    # on the full Mooncake trace, what 1 TiB of pool took off the p50 TTFT (ms): analysis, replay
    "pool_gain_p50_ms": {"analysis": 283.2, "replay": 479.6},
    "text": ("TTFT p50 within 11 %, p90 within 28 %, p99 within 35 % of replay --tiers in virtual time, the "
             "analysis lower (the worst: docqa's tail, where admission behind KV memory dominates; one request of "
             "chat's 96 at p99; 4-16 % on Mooncake), TPOT p50 within 18 %, GPU busy time -14 % to +9 % of the "
             "replay's whole timeline (the cost is priced over the span both hold, prices.priced_duration_s); "
             "on the full Mooncake trace 1 TiB of pool takes 283 ms off the p50 TTFT here and 480 ms in the "
             "replay; 8 configurations of 4 traces (docs/analysis.md, \"Queueing\")"),
}


class _StackRun:
    """The levels of a stack as one cache hierarchy, run a request at a time (the analysis's form of
    the replay's TierStack with one instance and one block per chunk; kvemu.stackrules names the
    rules). A level of capacity 0 is left out (the stack is the others: under write-back what the
    level above it evicts goes to the one below it). ``written[k]``: the blocks written into level
    k (stores, demotions, copies)."""

    def __init__(self, caps, policies, placement, promote, selective_hits):
        self.at = [k for k, c in enumerate(caps) if c > 0]  # the levels present, top first
        self.levels = [make_policy(policies[k], caps[k]) for k in self.at]
        self.n = len(self.levels)
        self.placement, self.promote, self.selective_hits = placement, bool(promote), int(selective_hits)
        self.hits: dict = {}
        self._written = [0] * self.n
        self.n_given = len(caps)

    @property
    def written(self) -> list:
        out = [0] * self.n_given
        for i, k in enumerate(self.at):
            out[k] = self._written[i]
        return out

    def _holder(self, b):
        for k, lv in enumerate(self.levels):
            if b in lv.held:
                return k
        return None

    def _put(self, k: int, b) -> None:
        lv = self.levels[k]
        if b in lv.held:
            lv.on_write(b)
            return
        self._written[k] += 1
        gone = lv.on_insert(b)
        if self.placement == "write-back" and k + 1 < self.n:
            for x in gone:
                self._put(k + 1, x)

    def _use_or_put(self, k: int, b) -> None:
        """``inclusive``: a reference to level k: a use where it holds the block, else a store."""
        if b in self.levels[k].held:
            self.levels[k].on_hit(b)
        else:
            self._put(k, b)

    def request(self, lookup: list, tail: list) -> list:
        """One request: ``lookup`` its blocks past its HBM hit that it may find in the stack (all
        but its last token's), ``tail`` its full blocks after them (computed, never looked up).
        Returns the blocks each level (as given, capacity 0 included) served."""
        served = [0] * self.n
        if not self.n:
            return [0] * self.n_given
        t = 0
        while t < len(lookup) and self._holder(lookup[t]) is not None:
            t += 1
        inclusive = self.placement == "inclusive"
        for b in lookup[:t]:
            k = self._holder(b)
            if k is None:  # evicted by an earlier block's copies: loaded from the top as a miss
                served[0] += 1
                continue
            self.levels[k].on_hit(b)
            served[k] += 1
            self.hits[b] = self.hits.get(b, 0) + 1
            if inclusive:
                for j in range(self.n):
                    if j != k:
                        self._use_or_put(j, b)
                continue
            if self.promote and k > 0:
                self._put(0, b)
            if self.placement == "write-through-selective" and self.hits[b] >= self.selective_hits:
                for j in range(1, self.n):
                    if b not in self.levels[j].held:
                        self._put(j, b)
        through = range(self.n) if self.placement in ("write-through", "inclusive") else (0,)
        for b in lookup[t:] + tail:
            for k in through:
                if inclusive:
                    self._use_or_put(k, b)
                else:
                    self._put(k, b)
        out = [0] * self.n_given
        for i, k in enumerate(self.at):
            out[k] = served[i]
        return out


def default_level(load_gbps: float, capacity_bytes: int) -> Level:
    """The one level of ``analyze capacity`` without --stack: host DRAM (local-dram, priced as DRAM)
    loading at ``load_gbps``."""
    return Level(name="tier", profile=replace(resolve_profile("local-dram"), bandwidth_gbps=float(load_gbps),
                                              latency_ns=0.0), capacity_bytes=int(capacity_bytes))


def measurement_rule(warmup: float, first_counted: int, n_requests: int) -> str:
    return (f"every level starts empty; the requests' prompt blocks reach the stack in arrival order; "
            f"requests 0..{first_counted - 1} (--warmup {warmup:g}) warm the levels and are not counted, "
            f"{n_requests - first_counted} counted" if first_counted else
            f"every level starts empty; the requests' prompt blocks reach the stack in arrival order; all "
            f"{n_requests} requests are counted (cold start; --warmup F leaves the first F of them out)")
