"""HuggingFace ``transformers`` hook: a ``DynamicCache`` that records what ``model.generate`` writes
to and reads from the KV cache, turned into a v1 trace (library only; needs ``kvemu[hf]`` and torch).

    from kvemu.realrun.hf import HfRecorder
    rec = HfRecorder(model, tokens_per_block=16)
    rec.generate(input_ids, max_new_tokens=32)      # as many calls as requests (or batches of them)
    rec.write("hf.parquet")

:class:`KvRecordingCache` overrides ``Cache.update(key_states, value_states, layer_idx, ...)``, the
one call through which every attention layer appends its new keys and values and gets back the
keys and values it attends over. Each call is logged as (time, layer, write offset = the layer's
length before the call, tokens written, tokens returned for reading, batch size). Calls are grouped
into steps by the layer index wrapping around; :class:`HfRecorder` also times each forward pass of
the model with hooks, which is the step's ``compute_ns``. Each row of a batch becomes a request.

Mapping (resident, as the numpy run): a DynamicCache keeps every token's KV where it was written
and attention reads all of it each step, so full context blocks read are ``read`` operations and
blocks that become full are ``store`` operations. HuggingFace has no prefix cache: every request
computes its whole prompt (cached tokens 0), but full prompt blocks get ids from chained hashes of
their token ids, so prompts with a common prefix show it as dedup (what a prefix cache could save).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time

try:
    import torch
    from transformers import DynamicCache
except ImportError as e:  # an optional extra: say what to install
    raise ImportError(
        "kvemu.realrun.hf needs torch and transformers: pip install 'kvemu[hf]' (and torch itself, e.g. the CPU "
        f"build: pip install torch) ({e})"
    ) from e

import numpy as np

from ..errors import ConfigError, TraceError
from ..models import KV_DTYPE_BYTES, ModelGeometry, model_from_config
from ..output import check_destination
from ..schema import PHASE_DECODE, PHASE_PREFILL
from .tracebuild import LayerAccess, TraceBuilder, chained_block_hashes, entry_ops

SOURCE = "realrun:hf"
_TORCH_KV_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class KvRecordingCache(DynamicCache):
    """A DynamicCache that logs every ``update()``: ``updates`` holds tuples
    (perf_counter_ns, layer, write_first, write_tokens, read_first, read_tokens, batch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates: list[tuple[int, int, int, int, int, int, int]] = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        before = self.get_seq_length(layer_idx)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        n = int(key_states.shape[-2])
        read = int(keys.shape[-2])
        # A sliding-window layer returns only the last `read` positions.
        self.updates.append((time.perf_counter_ns(), int(layer_idx), before, n, before + n - read, read,
                             int(key_states.shape[0])))
        return keys, values


def geometry_from_config(config, *, params: int | None = None, kv_dtype: str = "bf16") -> ModelGeometry:
    """Model geometry from a transformers config object, by the rules of ``models.model_from_config``."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    d = text.to_dict()
    # model_from_config reads a config.json: hand it this config as one, so the rules live in one place
    fd, path = tempfile.mkstemp(suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(d, f, default=str)
        g = model_from_config(path)
    finally:
        os.unlink(path)
    fields = {k: getattr(g, k) for k in ModelGeometry.__dataclass_fields__}
    fields["source"] = SOURCE
    if params is not None:
        moe = d.get("num_local_experts") or d.get("n_routed_experts")
        fields["params"] = params
        fields["active_params"] = min(fields["active_params"], params) if moe else params
    return ModelGeometry(**fields).with_kv_dtype(kv_dtype)


def _cache_kwarg() -> str:
    """generate() takes the cache as `cache` in newer transformers, `past_key_values` before."""
    try:
        from transformers.generation.utils import ALL_CACHE_NAMES
    except ImportError:
        return "past_key_values"
    return "cache" if "cache" in ALL_CACHE_NAMES else "past_key_values"


class HfRecorder:
    """Runs ``model.generate`` with a recording cache and collects the calls into one trace."""

    def __init__(self, model, *, tokens_per_block: int = 16, kv_dtype: str | None = None):
        if tokens_per_block <= 0:
            raise ConfigError("tokens_per_block must be positive")
        self.model = model
        self.tokens_per_block = tokens_per_block
        torch_dtype = next(model.parameters()).dtype
        if kv_dtype is None:
            kv_dtype = _TORCH_KV_DTYPES.get(torch_dtype, "bf16")
        if kv_dtype not in KV_DTYPE_BYTES:
            raise ConfigError(f"unknown KV dtype '{kv_dtype}' (known: {', '.join(KV_DTYPE_BYTES)})")
        self.kv_dtype = kv_dtype
        self.torch_dtype = str(torch_dtype).removeprefix("torch.")
        self.geometry = geometry_from_config(model.config, params=sum(p.numel() for p in model.parameters()),
                                             kv_dtype=kv_dtype)
        self.builder = TraceBuilder(tokens_per_block)
        self._t0: int | None = None
        self._calls: list[dict] = []
        self._digest = hashlib.sha256()

    def generate(self, input_ids, *, arrival_ms: float | None = None, **generate_kwargs):
        """``model.generate(input_ids, **generate_kwargs)`` with a recording cache; each row of
        ``input_ids`` is a request arriving at ``arrival_ms`` (default: when this call started,
        from the first call). Returns what generate returned."""
        now = time.perf_counter_ns()
        if self._t0 is None:
            self._t0 = now
        arrival = (now - self._t0) / 1e6 if arrival_ms is None else float(arrival_ms)
        cache = KvRecordingCache(config=self.model.config)
        forwards: list[tuple[int, int]] = []
        sync = torch.cuda.synchronize if input_ids.device.type == "cuda" else (lambda: None)

        def before(module, args):
            sync()
            forwards.append((time.perf_counter_ns(), -1))

        def after(module, args, output):
            sync()
            forwards[-1] = (forwards[-1][0], time.perf_counter_ns())

        h1 = self.model.register_forward_pre_hook(before)
        h2 = self.model.register_forward_hook(after)
        try:
            out = self.model.generate(input_ids, **{_cache_kwarg(): cache}, **generate_kwargs)
        finally:
            h1.remove()
            h2.remove()
        self._add(cache.updates, forwards, input_ids.detach().cpu().numpy(), arrival)
        self._calls.append({k: v for k, v in generate_kwargs.items() if isinstance(v, (int, float, bool, str))})
        return out

    def _add(self, updates, forwards, ids: np.ndarray, arrival_ms: float) -> None:
        b = self.builder
        L = self.geometry.layers
        tpb = self.tokens_per_block
        steps = _group_steps(updates)
        if not steps:
            raise TraceError("generate() made no KV cache update: nothing to record (use_cache off?)")
        batch = {u[6] for s in steps for u in s}
        if len(batch) != 1 or batch != {len(ids)}:
            raise TraceError(f"batch size changed during generate ({sorted(batch)}, {len(ids)} prompts): beam search "
                             f"and similar cache reordering cannot be recorded")
        timed = [f for f in forwards if f[1] >= 0]
        if len(timed) == len(steps):
            compute = [t1 - t0 for t0, t1 in timed]
        else:  # generate called the model some other way: time from the first to the last update
            compute = [s[-1][0] - s[0][0] for s in steps]
        ops = [entry_ops([LayerAccess(u[1], u[2], u[3], u[4], u[5]) for u in s], L, tpb) for s in steps]
        for prev, cur in zip(ops, ops[1:]):
            if cur["context_tokens"] != prev["context_tokens"] + prev["tokens"]:
                raise TraceError(f"the cache was rewound or cropped (write at {cur['context_tokens']} after "
                                 f"{prev['context_tokens'] + prev['tokens']} tokens): assisted generation and "
                                 f"similar cannot be recorded")
        cached = ops[0]["context_tokens"]
        inp = cached + ops[0]["tokens"]
        total = ops[-1]["context_tokens"] + ops[-1]["tokens"]
        self._digest.update(np.ascontiguousarray(ids, "<i8").tobytes())
        rids = []
        for row in ids:
            keys = chained_block_hashes(row[:inp], tpb) if len(row) >= inp else []
            rids.append(b.add_request(arrival_ms=arrival_ms, input_tokens=inp, output_tokens=total - inp + 1,
                                      cached_tokens=cached, tier_hit_tokens=cached, block_keys=keys))
        for i, (o, ns) in enumerate(zip(ops, compute)):
            step = b.add_step(ns)
            for rid in rids:
                b.add_entry(step, rid, phase=PHASE_PREFILL if i == 0 else PHASE_DECODE, tokens=o["tokens"],
                            context_tokens=o["context_tokens"], store=o["store"], read=o["read"])

    def write(self, out, *, force: bool = False) -> dict:
        """Write the trace of every generate call so far; returns its metadata."""
        import transformers

        params = {"generate_calls": self._calls}
        workload = {"source": f"{SOURCE}:generate", "kind": SOURCE, "checksum": f"sha256:{self._digest.hexdigest()}",
                    "hash_block_tokens": self.tokens_per_block, "params": params}
        engine = {"tier_policy": "resident", "cache": "transformers DynamicCache (KvRecordingCache)",
                  "transformers": transformers.__version__, "torch": torch.__version__,
                  "device": str(next(self.model.parameters()).device)}
        capture = {
            "source": SOURCE,
            "kv_cache_dtype": self.torch_dtype,
            "compute_ns": "measured: time.perf_counter_ns around each model forward (forward hooks; CUDA "
                          "synchronised); when generate bypasses the hooks, from a step's first to its last "
                          "cache update",
            "ops": {
                "read": "full context blocks written before the step, read by attention (all of the cache)",
                "store": "a block that becomes full during the step",
                "load": "none: a DynamicCache never moves KV",
            },
            "prefix_cache": "none: every prompt is computed in full; shared prompt blocks share ids (dedup)",
        }
        return self.builder.write(out, model=self.geometry, workload=workload, engine=engine, capture=capture,
                                  force=force)


def _group_steps(updates) -> list[list[tuple]]:
    """Updates split into forward passes: a pass ends when the layer index wraps around."""
    steps, cur, last = [], [], None
    for u in updates:
        if last is not None and u[1] <= last:
            steps.append(cur)
            cur = []
        cur.append(u)
        last = u[1]
    if cur:
        steps.append(cur)
    return steps


def record_generate(model, prompts, out, *, tokens_per_block: int = 16, kv_dtype: str | None = None,
                    force: bool = False, **generate_kwargs) -> dict:
    """One generate call per prompt (a 1-D token id sequence or tensor); writes the trace."""
    check_destination(out, force)
    rec = HfRecorder(model, tokens_per_block=tokens_per_block, kv_dtype=kv_dtype)
    device = next(model.parameters()).device
    for p in prompts:
        ids = torch.as_tensor(p, dtype=torch.long, device=device).reshape(1, -1)
        rec.generate(ids, attention_mask=torch.ones_like(ids), **generate_kwargs)
    return rec.write(out, force=force)
