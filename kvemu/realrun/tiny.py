"""A small decoder-only transformer in numpy that really runs prefill and decode on a paged KV
cache, and a recorder of the KV blocks its attention writes and reads (``kvemu record --run tiny``).

The model is Llama-shaped: RMSNorm, rotary embeddings, grouped-query attention, a SwiGLU MLP,
seeded random weights. The KV cache is a pool of blocks of ``tokens_per_block`` slots per layer;
each request has a block table. Full prompt blocks are named by chained hashes of their token ids
(as vLLM's prefix cache) and kept after their request finishes, so a later request with the same
prefix takes those blocks and computes only the rest. Only prompt blocks are cached for reuse.

Scheduling is simple continuous batching: each step decodes every running request and admits at
most one new request (its whole uncached prompt in one prefill), up to ``max_num_seqs``. A
request's prefix hit is looked up when it is admitted, so it finds the blocks of requests admitted
in earlier steps. Each step's compute time is measured with ``time.perf_counter_ns`` around the
numpy forward pass, pool writes and gathers included.

What the trace records (resident mapping, docs/sources.md): the pool stands for the tier, so
attention reads of context blocks are ``read`` operations, a block that becomes full is a
``store``, and prefix hits are cached (and tier-hit) tokens.
"""

from __future__ import annotations

import hashlib
import platform
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import ConfigError
from ..models import ModelGeometry
from ..output import check_destination
from ..schema import PHASE_DECODE, PHASE_PREFILL
from .tracebuild import LayerAccess, TraceBuilder, chained_block_hashes, entry_ops, table_blocks

SOURCE = "realrun:tiny"


@dataclass(frozen=True)
class TinyConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 256
    intermediate: int = 0  # 0: 2 x hidden
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    seed: int = 0
    dtype: str = "float64"

    def check(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"tiny model: {name} must be positive")
        if self.heads % self.kv_heads:
            raise ConfigError(f"tiny model: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"tiny model: head_dim ({self.head_dim}) must be even (rotary embeddings)")
        if self.intermediate < 0:
            raise ConfigError("tiny model: intermediate must be >= 0")
        if self.dtype not in ("float64", "float32"):
            raise ConfigError(f"tiny model: dtype must be float64 or float32, not {self.dtype!r}")

    @property
    def ffn(self) -> int:
        return self.intermediate or 2 * self.hidden


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
    """Causal grouped-query attention. q (n, heads, d) at positions q_pos; k, v (L, kv_heads, d)
    for key positions 0..L-1. Returns (n, heads * d)."""
    n, heads, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(n, kvh, heads // kvh, d).transpose(1, 2, 0, 3)  # (kv head, group, n, d)
    scores = qg @ k.transpose(1, 2, 0)[:, None] / np.sqrt(d)  # (kv head, group, n, L)
    masked = np.arange(k.shape[0])[None, :] > q_pos[:, None]
    scores = np.where(masked, -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    w = np.exp(scores)
    w /= w.sum(axis=-1, keepdims=True)
    return (w @ v.transpose(1, 0, 2)[:, None]).transpose(2, 0, 1, 3).reshape(n, heads * d)


class TinyModel:
    """Seeded weights and the forward pass; attention is given as a function so the same layers run
    against a paged cache or against the whole sequence recomputed."""

    def __init__(self, cfg: TinyConfig = TinyConfig()):
        cfg.check()
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed)
        dt = np.dtype(cfg.dtype)
        h, hd, L = cfg.hidden, cfg.head_dim, cfg.layers

        def mat(rows, cols):
            return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(dt)

        def norm():
            return (1.0 + 0.1 * rng.standard_normal(h)).astype(dt)

        self.embed = rng.standard_normal((cfg.vocab, h)).astype(dt)
        self.layers = [
            {
                "attn_norm": norm(),
                "wq": mat(h, cfg.heads * hd),
                "wk": mat(h, cfg.kv_heads * hd),
                "wv": mat(h, cfg.kv_heads * hd),
                "wo": mat(cfg.heads * hd, h),
                "mlp_norm": norm(),
                "w_gate": mat(h, cfg.ffn),
                "w_up": mat(h, cfg.ffn),
                "w_down": mat(cfg.ffn, h),
            }
            for _ in range(L)
        ]
        self.final_norm = norm()
        self.lm_head = mat(h, cfg.vocab)
        self.inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)

    @property
    def params(self) -> int:
        n = self.embed.size + self.final_norm.size + self.lm_head.size
        return int(n + sum(w.size for layer in self.layers for w in layer.values()))

    def geometry(self, kv_dtype: str = "bf16") -> ModelGeometry:
        c = self.cfg
        g = ModelGeometry(
            name=f"tiny-l{c.layers}-h{c.hidden}-q{c.heads}-kv{c.kv_heads}-d{c.head_dim}",
            layers=c.layers, hidden_size=c.hidden, attention_heads=c.heads, kv_heads=c.kv_heads,
            head_dim=c.head_dim, kv_values_per_token_layer=2 * c.kv_heads * c.head_dim,
            qk_head_dim=c.head_dim, v_head_dim=c.head_dim, params=self.params, active_params=self.params,
            source=SOURCE,
        )
        return g.with_kv_dtype(kv_dtype)

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Rotate-half rotary embedding of x (n, heads, d) at positions pos (n,)."""
        ang = pos[:, None].astype(np.float64) * self.inv_freq[None, :]
        cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1)[:, None, :].astype(x.dtype)
        sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1)[:, None, :].astype(x.dtype)
        half = x.shape[-1] // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    def forward(self, tokens: np.ndarray, positions: np.ndarray, attend, rows=None) -> np.ndarray:
        """Logits (n, vocab), or of the tokens at ``rows`` only. ``attend(layer, q, k, v)`` returns
        the attention output (n, heads*d) for the tokens' queries, given their new keys and values."""
        c = self.cfg
        x = self.embed[tokens]
        n = len(tokens)
        for li, w in enumerate(self.layers):
            hs = _rms_norm(x, w["attn_norm"], c.norm_eps)
            q = self._rope((hs @ w["wq"]).reshape(n, c.heads, c.head_dim), positions)
            k = self._rope((hs @ w["wk"]).reshape(n, c.kv_heads, c.head_dim), positions)
            v = (hs @ w["wv"]).reshape(n, c.kv_heads, c.head_dim)
            x = x + attend(li, q, k, v) @ w["wo"]
            hs = _rms_norm(x, w["mlp_norm"], c.norm_eps)
            x = x + (_silu(hs @ w["w_gate"]) * (hs @ w["w_up"])) @ w["w_down"]
        if rows is not None:
            x = x[rows]
        return _rms_norm(x, self.final_norm, c.norm_eps) @ self.lm_head

    def forward_full(self, tokens) -> np.ndarray:
        """Logits of every position, the whole sequence recomputed without any cache."""
        tokens = np.asarray(tokens, np.int64)
        pos = np.arange(len(tokens))
        return self.forward(tokens, pos, lambda li, q, k, v: _attention(q, k, v, pos))


# ------------------------------------------------------------------------------------ KV pool
class PagedKVPool:
    """Blocks of ``tokens_per_block`` K/V slots per layer, with a prefix cache of full blocks.

    A cached block whose requests all finished stays cached (evictable, least recently used first)
    until a new block is needed and no free block is left."""

    def __init__(self, cfg: TinyConfig, num_blocks: int, tokens_per_block: int):
        shape = (num_blocks, tokens_per_block, cfg.kv_heads, cfg.head_dim)
        self.k = [np.zeros(shape, cfg.dtype) for _ in range(cfg.layers)]
        self.v = [np.zeros(shape, cfg.dtype) for _ in range(cfg.layers)]
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.free = deque(range(num_blocks))
        self.refs = np.zeros(num_blocks, np.int64)
        self.cached: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0
        self.peak_used = 0

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes``."""
        hit = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def acquire(self, block: int) -> None:
        self.refs[block] += 1
        self.evictable.pop(block, None)

    def allocate(self) -> int:
        if self.free:
            b = self.free.popleft()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of.pop(b)]
            self.evictions += 1
        else:
            raise ConfigError(f"the tiny run's KV pool of {self.num_blocks} blocks is full with running requests; "
                              f"give it more blocks or run fewer requests at once")
        self.refs[b] = 1
        self.peak_used = max(self.peak_used, self.num_blocks - len(self.free))
        return b

    def register(self, block: int, h: bytes) -> None:
        """A block became full with prompt tokens: later requests with the same prefix may take it.
        When the same content is cached already (computed twice), the first copy stays the cached one."""
        if h not in self.cached:
            self.cached[h] = block
            self.hash_of[block] = h

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.evictable[block] = None
            else:
                self.free.append(block)


# --------------------------------------------------------------------------------------- run
@dataclass
class _Seq:
    rid: int
    prompt: np.ndarray
    output_tokens: int
    hashes: list[bytes]
    table: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the pool
    cached: int = 0
    generated: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)


@dataclass
class TinyRun:
    """What a tiny run produced: the trace builder, the raw per-layer access log, the outputs."""

    builder: TraceBuilder
    accesses: list[dict]  # one per (step, request, layer): writes and the physical blocks read (keep_accesses)
    tables: list[list[int]]  # each request's physical block table (pool block ids) at its end
    cached_tokens: list[int]
    generated: list[list[int]]
    logits: list[list[np.ndarray]]  # per request: the logits each step produced its next token from
    stats: dict


def run_tiny(model: TinyModel, prompts: list[np.ndarray], output_tokens: int | list[int], *,
             tokens_per_block: int = 16, arrival_ms: list[float] | None = None, max_num_seqs: int = 4,
             pool_blocks: int | None = None, keep_logits: bool = False, keep_accesses: bool = True) -> TinyRun:
    """Serve ``prompts`` with greedy decoding on a paged, prefix-sharing KV cache and record it.

    ``pool_blocks``: KV pool size (default: room for every request at once, so nothing is evicted).
    ``keep_logits``/``keep_accesses``: keep each step's logits / the raw per-layer access log."""
    tpb = tokens_per_block
    n = len(prompts)
    if n == 0:
        raise ConfigError("the tiny run needs at least one request")
    if tpb <= 0 or max_num_seqs <= 0:
        raise ConfigError("tokens_per_block and max_num_seqs must be positive")
    outs = [output_tokens] * n if isinstance(output_tokens, int) else list(output_tokens)
    arrivals = [0.0] * n if arrival_ms is None else [float(a) for a in arrival_ms]
    if len(outs) != n or len(arrivals) != n:
        raise ConfigError("one output length and one arrival time per prompt")
    if any(np.diff(arrivals) < 0):
        raise ConfigError("arrival times must be non-decreasing")
    vocab = model.cfg.vocab
    seqs = []
    for rid, (p, o) in enumerate(zip(prompts, outs)):
        p = np.asarray(p, np.int64)
        if len(p) == 0 or o <= 0:
            raise ConfigError(f"request {rid}: prompt and output lengths must be positive")
        if p.min() < 0 or p.max() >= vocab:
            raise ConfigError(f"request {rid}: token ids must be in [0, {vocab})")
        seqs.append(_Seq(rid, p, int(o), chained_block_hashes(p, tpb)))
    need = [table_blocks(len(s.prompt), s.output_tokens, tpb) for s in seqs]
    if pool_blocks is None:
        pool_blocks = sum(need)
    if pool_blocks < max(need):
        raise ConfigError(f"the KV pool ({pool_blocks} blocks) cannot hold request {int(np.argmax(need))} "
                          f"({max(need)} blocks)")
    pool = PagedKVPool(model.cfg, pool_blocks, tpb)
    model.forward_full(seqs[0].prompt[:tpb])  # warm up (first BLAS calls), so step 0 is timed like the rest
    L = model.cfg.layers
    builder = TraceBuilder(tpb)
    accesses: list[dict] = []
    waiting = deque(seqs)
    running: list[_Seq] = []
    now_ns = 0
    step = 0
    arrival_ns = [round(a * 1e6) for a in arrivals]

    while waiting or running:
        if not running and arrival_ns[waiting[0].rid] > now_ns:
            now_ns = arrival_ns[waiting[0].rid]
        batch: list[tuple[_Seq, int, int]] = [(s, s.computed, 1) for s in running]  # (seq, first pos, tokens)
        if waiting and len(running) < max_num_seqs and arrival_ns[waiting[0].rid] <= now_ns:
            s = waiting.popleft()
            limit = (len(s.prompt) - 1) // tpb  # compute at least one prompt token
            hit = pool.lookup(s.hashes[:limit])
            for b in hit:
                pool.acquire(b)
            s.table = list(hit)
            s.cached = s.computed = len(hit) * tpb
            # admission is first come, first served: requests reach the builder in arrival order
            builder.add_request(arrival_ms=arrivals[s.rid], input_tokens=len(s.prompt),
                                output_tokens=s.output_tokens, cached_tokens=s.cached, tier_hit_tokens=s.cached,
                                block_keys=s.hashes[: len(s.prompt) // tpb])
            batch.append((s, s.computed, len(s.prompt) - s.computed))
        for s, first, k in batch:  # room for the tokens this step writes
            while len(s.table) * tpb < first + k:
                s.table.append(pool.allocate())

        tokens = np.concatenate([_step_tokens(s, first, k) for s, first, k in batch])
        positions = np.concatenate([np.arange(first, first + k) for s, first, k in batch])
        seg = np.cumsum([0] + [k for _, _, k in batch])
        log: list[dict] = []

        def attend(li, q, k, v, batch=batch, seg=seg, log=log):
            out = np.empty((len(q), q.shape[1] * q.shape[2]), q.dtype)
            for i, (s, first, cnt) in enumerate(batch):
                lo, hi = seg[i], seg[i + 1]
                pos = np.arange(first, first + cnt)
                tbl = np.asarray(s.table)
                pool.k[li][tbl[pos // tpb], pos % tpb] = k[lo:hi]
                pool.v[li][tbl[pos // tpb], pos % tpb] = v[lo:hi]
                ctx = first + cnt
                read = tbl[: -(-ctx // tpb)]
                kk = pool.k[li][read].reshape(-1, *k.shape[1:])[:ctx]
                vv = pool.v[li][read].reshape(-1, *v.shape[1:])[:ctx]
                out[lo:hi] = _attention(q[lo:hi], kk, vv, pos)
                log.append({"layer": li, "request": s.rid, "write_first": first, "write_tokens": cnt,
                            "write_blocks": tuple(int(b) for b in np.unique(tbl[pos // tpb])),
                            "read_blocks": tuple(int(b) for b in read), "read_tokens": ctx})
            return out

        t0 = time.perf_counter_ns()
        logits = model.forward(tokens, positions, attend, rows=seg[1:] - 1)  # each request's last token
        compute_ns = time.perf_counter_ns() - t0
        builder.add_step(compute_ns)

        still = []
        for i, (s, first, cnt) in enumerate(batch):
            mine = [a for a in log if a["request"] == s.rid]
            if keep_accesses:
                accesses.extend({"step": step, **a} for a in mine)
            ops = entry_ops([_layer_access(a, s.table, tpb) for a in mine], L, tpb)
            builder.add_entry(step, s.rid, phase=PHASE_PREFILL if first < len(s.prompt) else PHASE_DECODE,
                              tokens=ops["tokens"], context_tokens=ops["context_tokens"], store=ops["store"],
                              read=ops["read"])
            s.computed = first + cnt
            n_full = min(s.computed, len(s.prompt)) // tpb
            for p in range(first // tpb, n_full):  # prompt blocks that became full: cacheable
                pool.register(s.table[p], s.hashes[p])
            last = logits[i]
            if keep_logits:
                s.logits.append(last.copy())
            s.generated.append(int(np.argmax(last)))
            if len(s.generated) == s.output_tokens:
                for b in s.table:
                    pool.release(b)
            else:
                still.append(s)
        running = still
        now_ns += compute_ns
        step += 1

    stats = {"pool_blocks": pool_blocks, "peak_pool_blocks": pool.peak_used, "evictions": pool.evictions}
    return TinyRun(builder, accesses, [s.table for s in seqs], [s.cached for s in seqs],
                   [s.generated for s in seqs], [s.logits for s in seqs], stats)


def _step_tokens(s: _Seq, first: int, k: int) -> np.ndarray:
    """The tokens fed in this step: the uncached prompt, or the last generated token."""
    if first < len(s.prompt):
        return s.prompt[first:first + k]
    return np.array([s.generated[-1]], np.int64)


def _layer_access(a: dict, table: list[int], tpb: int) -> LayerAccess:
    """The logged physical blocks as token positions of the request: attention must have gathered
    the first blocks of its table, in order."""
    read = list(a["read_blocks"])
    if read != table[: len(read)]:
        raise AssertionError(f"request {a['request']} layer {a['layer']} read blocks {read}, not a prefix of its "
                             f"table {table}")
    return LayerAccess(a["layer"], a["write_first"], a["write_tokens"], 0, a["read_tokens"])


# ---------------------------------------------------------------------------------- recording
def tiny_prompts(requests: int, prompt_tokens: int, shared_prefix_tokens: int, vocab: int,
                 seed: int = 0) -> list[np.ndarray]:
    """Seeded prompts: every request starts with the same ``shared_prefix_tokens`` tokens."""
    if requests <= 0 or prompt_tokens <= 0:
        raise ConfigError("--requests and --prompt-tokens must be positive")
    if not 0 <= shared_prefix_tokens <= prompt_tokens:
        raise ConfigError("--shared-prefix-tokens must be between 0 and --prompt-tokens")
    rng = np.random.default_rng(seed + 1)
    prefix = rng.integers(0, vocab, shared_prefix_tokens)
    return [np.concatenate([prefix, rng.integers(0, vocab, prompt_tokens - shared_prefix_tokens)])
            for _ in range(requests)]


def record_tiny(out, *, requests: int = 4, prompt_tokens: int = 64, output_tokens: int = 16,
                shared_prefix_tokens: int = 32, layers: int = 2, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, head_dim: int = 16, vocab: int = 256, tokens_per_block: int = 16,
                kv_dtype: str = "bf16", max_num_seqs: int = 4, arrival_interval_ms: float = 0.0,
                pool_blocks: int | None = None, seed: int = 0, force: bool = False) -> dict:
    """Run the numpy model on a seeded workload and write its real-run trace. Returns the metadata."""
    check_destination(out, force)
    if arrival_interval_ms < 0:
        raise ConfigError("arrival interval must be >= 0")
    if output_tokens <= 0:
        raise ConfigError("--output-tokens must be positive")
    cfg = TinyConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     vocab=vocab, seed=seed)
    model = TinyModel(cfg)
    geometry = model.geometry(kv_dtype)
    prompts = tiny_prompts(requests, prompt_tokens, shared_prefix_tokens, vocab, seed)
    arrivals = [i * arrival_interval_ms for i in range(requests)]
    wall0 = time.perf_counter()
    run = run_tiny(model, prompts, output_tokens, tokens_per_block=tokens_per_block, arrival_ms=arrivals,
                   max_num_seqs=max_num_seqs, pool_blocks=pool_blocks, keep_accesses=False)
    wall_s = time.perf_counter() - wall0
    params = {"requests": requests, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
              "shared_prefix_tokens": shared_prefix_tokens, "arrival_interval_ms": arrival_interval_ms,
              "seed": seed}
    digest = hashlib.sha256(b"".join(np.asarray(p, "<i8").tobytes() for p in prompts)).hexdigest()
    workload = {
        "source": SOURCE + ":" + ",".join(f"{k}={v}" for k, v in params.items()),
        "kind": SOURCE,
        "checksum": f"sha256:{digest}",
        "hash_block_tokens": tokens_per_block,
        "params": params,
    }
    engine = {
        "tier_policy": "resident",
        "max_num_seqs": max_num_seqs,
        "max_prefills_per_step": 1,
        "prefix_cache": "full prompt blocks, chained sha256 of token ids, LRU eviction",
        **run.stats,
    }
    return run.builder.write(out, model=geometry, workload=workload, engine=engine,
                             capture=capture_facts(model, wall_s), force=force)


def capture_facts(model: TinyModel, wall_s: float) -> dict:
    return {
        "source": SOURCE,
        "model_config": asdict(model.cfg),
        "kv_pool_dtype": model.cfg.dtype,
        "compute_ns": "measured: time.perf_counter_ns around each step's numpy forward pass (pool writes and "
                      "gathers included) on this host's CPU",
        "ops": {
            "read": "attention reads of full context blocks written before the step (the pool is the tier)",
            "store": "a block that becomes full during the step",
            "load": "none: the KV never leaves the pool",
        },
        "host": {"machine": platform.machine(), "python": platform.python_version(), "numpy": np.__version__},
        "wall_s": round(wall_s, 3),
    }
