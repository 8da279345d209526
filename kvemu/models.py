"""Model geometry: how many KV bytes a token costs, and how much compute a token needs.

KV bytes per token and layer = values per token per layer x dtype bytes, where values are
2 x KV heads x head_dim for multi-head / grouped-query attention, and kv_lora_rank +
qk_rope_head_dim for DeepSeek's multi-head latent attention (MLA).

Attention families that do not cache every token in every layer (sliding windows, chunked local
attention, linear attention's recurrent state, DeepSeek-V3.2's indexer keys) are described by
per-layer-group KV geometry (:class:`KVGroup`); :func:`ModelGeometry.kv_bytes` gives a request's KV
bytes at context length L over every group. A model without groups is full attention in every layer.

Preset figures come from the models' published ``config.json`` files and model cards; they are
checked against ``shared/REFERENCE.md`` in the tests, and cited in docs/engine.md ("Attention
families").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path

from .bounds import KV_DTYPE_BYTES
from .errors import ConfigError
from .inputs import loads_bounded



#: KV-group kinds: ``full`` caches every token (GQA or MLA), ``sliding`` the last ``window`` tokens,
#: ``chunked`` the tokens of the current ``window``-token chunk (Llama 4), ``linear`` no tokens but a
#: fixed recurrent state per request (Gated DeltaNet), ``indexer`` DeepSeek-V3.2's per-token indexer
#: keys, a second cache in the same layers as the MLA latent (as vLLM keeps it: a cache group of its own).
KV_GROUP_KINDS = ("full", "sliding", "chunked", "linear", "indexer")
#: Version of the ``kv_groups`` object traces record in their model metadata.
KV_GROUPS_VERSION = 1


@dataclass(frozen=True)
class KVGroup:
    """KV geometry of a group of layers that cache alike.

    ``bytes_per_token_layer``: bytes one cached token costs in one layer of the group;
    ``values_per_token_layer`` the values behind it when they follow the KV dtype (0: the bytes are
    fixed, as the FP8 indexer keys are); ``window``: tokens a ``sliding`` layer keeps, or the chunk of
    a ``chunked`` layer; ``state_bytes_per_layer``: a fixed per-request state (``linear``)."""

    kind: str
    layers: int
    bytes_per_token_layer: int = 0
    values_per_token_layer: int = 0
    window: int = 0
    state_bytes_per_layer: int = 0

    @property
    def grows(self) -> bool:
        """Whether the group's KV grows with the context without bound (full attention, indexer)."""
        return self.kind in ("full", "indexer")

    def tokens_held(self, context: int) -> int:
        """Tokens whose KV a layer of the group holds at context length ``context``: all of them
        (full, indexer), the last ``window`` (sliding), those of the last token's chunk (chunked:
        ``L - window * floor((L - 1) / window)``), none (linear)."""
        L = int(context)
        if L <= 0 or self.kind == "linear":
            return 0
        if self.kind == "sliding":
            return min(L, self.window)
        if self.kind == "chunked":
            return L - self.window * ((L - 1) // self.window)
        return L

    def pairs_upto(self, n: int) -> float:
        """Attention (query, key) pairs of a layer of the group over tokens 1..n, each attending to
        the tokens it holds, itself included (sum of tokens_held(j) for j = 1..n); 0 for layers
        that do not attend over tokens (linear, indexer)."""
        if n <= 0 or self.kind in ("linear", "indexer"):
            return 0.0
        W = self.window
        if self.kind == "sliding" and n > W:
            return W * (W + 1) / 2 + (n - W) * W
        if self.kind == "chunked":
            q, r = divmod(n, W)
            return q * W * (W + 1) / 2 + r * (r + 1) / 2
        return n * (n + 1) / 2

    def bytes_at(self, context: int) -> int:
        """KV bytes of one request in this group's layers at context length ``context``."""
        state = self.state_bytes_per_layer if context > 0 else 0
        return self.layers * (self.bytes_per_token_layer * self.tokens_held(context) + state)

    def max_blocks(self, tokens_per_block: int) -> int | None:
        """Most blocks of ``tokens_per_block`` tokens one request holds in a layer of the group (None:
        unbounded). A window of W tokens ending anywhere spans ``ceil((W - 1) / B) + 1`` blocks; a
        chunk starts on a multiple of W, so it spans ``ceil(W / B)`` blocks when B divides W."""
        B = tokens_per_block
        if self.kind == "sliding":
            return -(-(self.window - 1) // B) + 1
        if self.kind == "chunked":
            return self.window // B if self.window % B == 0 else -(-(self.window - 1) // B) + 1
        if self.kind == "linear":
            return 0
        return None

    def block_bytes(self, tokens_per_block: int) -> int:
        """Bytes of one block over the group's layers."""
        return tokens_per_block * self.bytes_per_token_layer * self.layers

    def with_dtype_bytes(self, dtype_bytes: int) -> "KVGroup":
        if not self.values_per_token_layer:
            return self
        return replace(self, bytes_per_token_layer=self.values_per_token_layer * dtype_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


def check_kv_groups(groups, layers: int, where: str = "model") -> tuple[KVGroup, ...]:
    """KV groups from a list of dicts (a trace's ``kv_groups.groups``) or KVGroups, checked: known
    kinds, non-negative integers, windows where a kind needs one, and layers of the attention groups
    (all but ``indexer``) adding up to ``layers``. ConfigError otherwise."""
    if not isinstance(groups, (list, tuple)) or not groups:
        raise ConfigError(f"{where}: kv_groups must be a non-empty list")
    out = []
    for g in groups:
        if isinstance(g, KVGroup):
            g = g.to_dict()
        if not isinstance(g, dict) or set(g) - set(KVGroup.__dataclass_fields__):
            raise ConfigError(f"{where}: a KV group must be an object with "
                              f"{', '.join(KVGroup.__dataclass_fields__)}")
        kind = g.get("kind")
        if kind not in KV_GROUP_KINDS:
            raise ConfigError(f"{where}: unknown KV group kind {kind!r} (known: {', '.join(KV_GROUP_KINDS)})")
        nums = {k: g.get(k, 0) for k in KVGroup.__dataclass_fields__ if k != "kind"}
        for k, v in nums.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{where}: KV group field '{k}' must be a non-negative integer, got {v!r}")
        if nums["layers"] == 0:
            raise ConfigError(f"{where}: a KV group has no layers")
        if kind in ("sliding", "chunked") and nums["window"] <= 0:
            raise ConfigError(f"{where}: a {kind} KV group needs a positive window")
        if kind != "linear" and nums["bytes_per_token_layer"] <= 0:
            raise ConfigError(f"{where}: a {kind} KV group needs positive bytes_per_token_layer")
        out.append(KVGroup(kind=kind, **nums))
    attn = sum(g.layers for g in out if g.kind != "indexer")
    if attn != layers:
        raise ConfigError(f"{where}: KV groups cover {attn} layers, the model has {layers}")
    return tuple(out)


@dataclass(frozen=True)
class ModelGeometry:
    name: str
    layers: int
    hidden_size: int
    attention_heads: int  # query heads
    kv_heads: int  # 0 for MLA (the latent is shared by all heads)
    head_dim: int
    kv_values_per_token_layer: int  # values cached per token per layer (K and V together)
    qk_head_dim: int  # per query head, for attention FLOPs
    v_head_dim: int
    params: int  # total parameters (weights to keep in memory)
    active_params: int  # parameters used per token (differs for mixture-of-experts)
    kv_dtype: str = "bf16"
    source: str = "preset"
    # mixture of experts (0 for dense models): layers with routed experts, experts per such layer, and
    # experts each token is routed to (expert parallelism's all-to-all, kvemu.engine.timing)
    moe_layers: int = 0
    experts: int = 0
    experts_per_token: int = 0
    # per-layer-group KV geometry, for the KV dtype "bf16"; () is full attention in every layer with
    # kv_values_per_token_layer (then kv_groups gives that one group)
    groups: tuple[KVGroup, ...] = field(default=())
    # weights of the attention blocks over all layers (projections and their norms): what data-parallel
    # attention holds whole on every rank (engine.timing); 0: not recorded (attention_weight_params)
    attention_params: int = 0

    @property
    def attention_weight_params(self) -> int | None:
        """Weights of the attention blocks over all layers: the recorded ``attention_params``, else for
        grouped-query attention the q, k, v and o projections of every layer (``2 x hidden x (heads +
        kv_heads) x head_dim``, without biases or norms); None for MLA without the recorded figure (its
        low-rank projections are not in the geometry)."""
        if self.attention_params:
            return self.attention_params
        if self.kv_heads == 0:
            return None
        return 2 * self.hidden_size * (self.attention_heads + self.kv_heads) * self.head_dim * self.layers

    @property
    def mla_layers(self) -> int:
        """Layers of multi-head latent attention (every layer of an MLA model, none of a GQA one)."""
        return self.layers if self.kv_heads == 0 else 0

    @cached_property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The model's KV groups at its KV dtype (one full-attention group without declared ones)."""
        if not self.groups:
            return (KVGroup("full", self.layers, self.kv_bytes_per_token_layer, self.kv_values_per_token_layer),)
        return tuple(g.with_dtype_bytes(self.kv_dtype_bytes) for g in self.groups)

    @property
    def uniform(self) -> bool:
        """Full attention in every layer, every token cached alike (the model before KV groups)."""
        g = self.kv_groups
        return len(g) == 1 and g[0].kind == "full"

    def kv_bytes(self, context: int) -> int:
        """KV bytes one request holds at context length ``context``, over every KV group."""
        return sum(g.bytes_at(context) for g in self.kv_groups)

    def kv_bytes_per_token_at(self, context: int) -> float:
        """Mean KV bytes per token at context length ``context`` (``kv_bytes(L) / L``)."""
        return self.kv_bytes(context) / context if context > 0 else 0.0

    def step_equivalents(self, context: int, tokens: int) -> tuple[float, float]:
        """What ``tokens`` new tokens after ``context`` cached ones cost the GPU time model, in the
        units it takes for full attention in every layer (engine.timing.GpuTiming.step_ns):
        attention pairs per layer averaged over all layers (a window caps a sliding layer's; linear
        layers have none) and KV tokens touched weighted by bytes (kv_bytes(context + tokens) /
        kv_bytes_per_token). For a uniform model, ``(tokens * (context + (tokens + 1) / 2),
        context + tokens)``."""
        end = context + tokens
        if self.uniform:
            return tokens * (context + (tokens + 1) / 2), float(end)
        pairs = sum(g.layers * (g.pairs_upto(end) - g.pairs_upto(context)) for g in self.kv_groups)
        per_token = self.kv_bytes_per_token
        return pairs / self.layers, (self.kv_bytes(end) / per_token if per_token else 0.0)

    def decode_equivalents(self):
        """``step_equivalents(context, 1)`` as a function of the context alone, with the groups'
        figures bound once (the scheduler calls it for every decode of every step); None for a
        uniform model."""
        if self.uniform:
            return None
        groups = self.kv_groups
        per_token, layers = self.kv_bytes_per_token, self.layers
        state = sum(g.state_bytes_per_layer * g.layers for g in groups)
        full_pairs = sum(g.layers for g in groups if g.kind == "full")
        full_bytes = sum(g.layers * g.bytes_per_token_layer for g in groups if g.grows)
        windows = [(g.kind == "chunked", g.window, g.layers, g.layers * g.bytes_per_token_layer)
                   for g in groups if g.kind in ("sliding", "chunked")]

        def decode(context: int) -> tuple[float, float]:
            L = context + 1
            pairs, nbytes = full_pairs * L, full_bytes * L + state
            for chunked, W, n, b in windows:
                held = L - W * ((L - 1) // W) if chunked else (L if L < W else W)
                pairs += n * held
                nbytes += b * held
            return pairs / layers, (nbytes / per_token if per_token else 0.0)

        return decode

    @property
    def kv_dtype_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.kv_dtype]

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return self.kv_values_per_token_layer * self.kv_dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of a token while it is inside every window: per-token bytes summed over every
        group's layers (linear layers cache no tokens). For full attention in every layer, layers x
        kv_bytes_per_token_layer; at long contexts a windowed model costs less (kv_bytes)."""
        if not self.groups:
            return self.kv_bytes_per_token_layer * self.layers
        return sum(g.bytes_per_token_layer * g.layers for g in self.kv_groups)

    def block_bytes_per_layer(self, tokens_per_block: int) -> int:
        return tokens_per_block * self.kv_bytes_per_token_layer

    def with_kv_dtype(self, kv_dtype: str) -> "ModelGeometry":
        if kv_dtype not in KV_DTYPE_BYTES:
            raise ConfigError(
                f"unknown KV dtype '{kv_dtype}' (known: {', '.join(KV_DTYPE_BYTES)})"
            )
        return replace(self, kv_dtype=kv_dtype)

    def to_dict(self, tokens_per_block: int) -> dict:
        d = asdict(self)
        del d["groups"]
        if not self.attention_params:
            del d["attention_params"]  # not recorded: traces keep the fields they had
        if not self.uniform:
            d["kv_groups"] = {"version": KV_GROUPS_VERSION, "groups": [g.to_dict() for g in self.kv_groups]}
        d.update(
            kv_dtype_bytes=self.kv_dtype_bytes,
            kv_bytes_per_token_layer=self.kv_bytes_per_token_layer,
            kv_bytes_per_token=self.kv_bytes_per_token,
            tokens_per_block=tokens_per_block,
            block_bytes_per_layer=self.block_bytes_per_layer(tokens_per_block),
        )
        return d


def _gqa(name, layers, hidden, heads, kv_heads, head_dim, params, active=None, moe=(0, 0, 0)):
    return ModelGeometry(
        name=name,
        layers=layers,
        hidden_size=hidden,
        attention_heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        kv_values_per_token_layer=2 * kv_heads * head_dim,
        qk_head_dim=head_dim,
        v_head_dim=head_dim,
        params=params,
        active_params=active or params,
        moe_layers=moe[0],
        experts=moe[1],
        experts_per_token=moe[2],
    )


# Parameter counts: model cards (Llama 3 / 3.1: 8.03B, 70.6B, 405.9B; Qwen2.5-72B: 72.7B;
# Mixtral-8x7B: 46.7B total, 12.9B active; DeepSeek-V3: 671B total, 37B active).
PRESETS: dict[str, ModelGeometry] = {
    m.name: m
    for m in (
        _gqa("llama3-8b", 32, 4096, 32, 8, 128, 8_030_000_000),
        _gqa("llama3-70b", 80, 8192, 64, 8, 128, 70_550_000_000),
        _gqa("llama3.1-405b", 126, 16384, 128, 8, 128, 405_850_000_000),
        _gqa("qwen2.5-72b", 80, 8192, 64, 8, 128, 72_710_000_000),
        # MoE: every layer, 8 experts, top-2 (config.json num_local_experts, num_experts_per_tok)
        _gqa("mixtral-8x7b", 32, 4096, 32, 8, 128, 46_700_000_000, 12_900_000_000, moe=(32, 8, 2)),
        # MLA: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 cached values per token per layer;
        # queries use qk_nope 128 + rope 64 = 192 dims per head, values 128.
        ModelGeometry(
            name="deepseek-v3",
            layers=61,
            hidden_size=7168,
            attention_heads=128,
            kv_heads=0,
            head_dim=128,
            kv_values_per_token_layer=576,
            qk_head_dim=192,
            v_head_dim=128,
            params=671_000_000_000,
            active_params=37_000_000_000,
            # first_k_dense_replace 3 of 61 layers dense; n_routed_experts 256, num_experts_per_tok 8
            moe_layers=58,
            experts=256,
            experts_per_token=8,
            # per layer (count_params' MLA shapes, config.json: q_lora_rank 1536, kv_lora_rank 512):
            # q_a 7168 x 1536 + norm 1536 + q_b 1536 x 128 x 192 + kv_a 7168 x 576 + norm 512
            # + kv_b 512 x 128 x 256 + o 128 x 128 x 7168 = 187,107,328; x 61 layers
            attention_params=61 * 187_107_328,
        ),
    )
}


def _grouped(base: ModelGeometry, *groups: KVGroup) -> ModelGeometry:
    return replace(base, groups=check_kv_groups(groups, base.layers, base.name))


def _attn(kind: str, layers: int, values: int, window: int = 0) -> KVGroup:
    """An attention group of ``layers`` layers caching ``values`` values per token and layer (bf16 bytes)."""
    return KVGroup(kind, layers, 2 * values, values, window)


def gated_deltanet_state_bytes(v_heads: int, k_head_dim: int, v_head_dim: int, k_heads: int, conv_kernel: int,
                               state_dtype_bytes: int = 2, conv_dtype_bytes: int = 2) -> int:
    """Per-request state of one Gated DeltaNet layer (Qwen3-Next): the recurrent state, one
    ``k_head_dim x v_head_dim`` matrix per value head, and the short convolution's last
    ``conv_kernel - 1`` inputs over the q, k and v channels (``2 k_heads k_head_dim + v_heads
    v_head_dim``), as vLLM's and transformers' caches hold them."""
    recurrent = v_heads * k_head_dim * v_head_dim
    conv = (conv_kernel - 1) * (2 * k_heads * k_head_dim + v_heads * v_head_dim)
    return recurrent * state_dtype_bytes + conv * conv_dtype_bytes


def indexer_bytes_per_token(index_head_dim: int, quant_block: int = 128) -> int:
    """DeepSeek-V3.2's lightning-indexer key per token and layer: ``index_head_dim`` FP8 values and
    one FP32 scale per ``quant_block`` of them (DeepSeek's inference code and vLLM cache them so)."""
    return index_head_dim + 4 * -(-index_head_dim // quant_block)


# Attention families with KV groups. Every figure from the published config.json and model card
# (docs/engine.md, "Attention families", lists the sources).
_DSV3 = PRESETS["deepseek-v3"]
for _m in (
    # gpt-oss-120b: 36 layers, layer_types alternating sliding_attention (window 128) / full_attention;
    # 64 query heads, 8 KV heads of 64 dims; 128 experts, top-4; 116.83 B total, 5.13 B active
    _grouped(_gqa("gpt-oss-120b", 36, 2880, 64, 8, 64, 116_830_000_000, 5_130_000_000, moe=(36, 128, 4)),
             _attn("sliding", 18, 2 * 8 * 64, 128), _attn("full", 18, 2 * 8 * 64)),
    # Gemma 3 27B: 62 layers, sliding_window_pattern 6 (5 local : 1 global), window 1024; 32 query
    # heads, 16 KV heads of 128 dims; 27 B parameters
    _grouped(_gqa("gemma-3-27b", 62, 5376, 32, 16, 128, 27_000_000_000),
             _attn("sliding", 52, 2 * 16 * 128, 1024), _attn("full", 10, 2 * 16 * 128)),
    # Qwen3-Next-80B-A3B: 48 layers, full_attention_interval 4 (3 Gated DeltaNet : 1 gated attention);
    # attention 16 query heads, 2 KV heads of 256 dims; DeltaNet 16 key heads and 32 value heads of
    # 128 dims, conv kernel 4, state in bf16; 512 experts, top-10; 80 B total, 3 B active
    _grouped(_gqa("qwen3-next-80b-a3b", 48, 2048, 16, 2, 256, 80_000_000_000, 3_000_000_000, moe=(48, 512, 10)),
             KVGroup("linear", 36, state_bytes_per_layer=gated_deltanet_state_bytes(32, 128, 128, 16, 4)),
             _attn("full", 12, 2 * 2 * 256)),
    # Llama 4 Scout (17B-16E): 48 layers, attention_chunk_size 8192 on the RoPE layers, every 4th
    # layer (no_rope_layers 0) global; 40 query heads, 8 KV heads of 128 dims; 16 experts, top-1;
    # 109 B total, 17 B active
    _grouped(_gqa("llama-4-scout", 48, 5120, 40, 8, 128, 109_000_000_000, 17_000_000_000, moe=(48, 16, 1)),
             _attn("chunked", 36, 2 * 8 * 128, 8192), _attn("full", 12, 2 * 8 * 128)),
    # DeepSeek-V3.2: DeepSeek-V3's MLA (576 values per token and layer) plus the sparse-attention
    # indexer's keys in every layer (index_head_dim 128, FP8 with its scale: 132 bytes)
    _grouped(replace(_DSV3, name="deepseek-v3.2"), _attn("full", 61, 576),
             KVGroup("indexer", 61, indexer_bytes_per_token(128))),
):
    PRESETS[_m.name] = _m
del _m


# ------------------------------------------------------------------------------- config.json
#: model_type values whose attention has q/k/v biases but no o_proj bias and no ``attention_bias``
#: field (transformers' Qwen2 and Qwen2-MoE hard-code them).
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
#: model_type values with a per-head RMSNorm on queries and keys (Qwen3's q_norm / k_norm).
_QK_NORM_TYPES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ParamCount:
    """Weights of a decoder from its config.json, and the share one token uses."""

    total: int
    active: int  # embeddings, attention and norms of every layer, the routed top-k and shared experts
    embedding: int  # the input embedding table (lm_head not included)
    dense_layers: int
    moe_layers: int
    attention: str  # "mla" or "gqa"
    experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0
    attention_params: int = 0  # the attention blocks' weights over all layers (projections, q/k and MLA norms)


def _field(cfg: dict, key: str, default=None, p="config"):
    """A non-negative integer field of a config.json; ``default`` when absent or null."""
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 0:
        raise ConfigError(f"model config {p} has a non-integer or negative '{key}': {v!r}")
    return int(v)


def count_params(cfg: dict, p="config") -> ParamCount:
    """Parameter counts of a HuggingFace decoder config (Llama, Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE,
    DeepSeek-V2/V3), by the shapes transformers builds for it:

    * embeddings: ``vocab_size x hidden_size``, plus an untied lm_head of the same size
      (``tie_word_embeddings``, false when absent as in these families' configs);
    * attention, GQA: q and o ``hidden x heads x head_dim``, k and v ``hidden x kv_heads x head_dim``,
      biases where the family has them (Qwen2: q/k/v; ``attention_bias``: q/k/v/o), Qwen3's q/k norms;
    * attention, MLA (``kv_lora_rank``): q_a ``hidden x q_lora_rank`` + its norm + q_b ``q_lora_rank x
      heads x (qk_nope + qk_rope)`` (or one q ``hidden x heads x (qk_nope + qk_rope)`` when
      ``q_lora_rank`` is null), kv_a ``hidden x (kv_lora_rank + qk_rope)`` + its norm, kv_b
      ``kv_lora_rank x heads x (qk_nope + v_head_dim)``, o ``heads x v_head_dim x hidden``;
    * MLP: gated, ``3 x hidden x intermediate_size``; in MoE layers each expert ``3 x hidden x
      moe_intermediate_size`` (Mixtral: ``intermediate_size``), a router ``experts x hidden``,
      DeepSeek's ``n_shared_experts`` experts of the same size, Qwen2-MoE's one shared expert of
      ``shared_expert_intermediate_size`` and its ``hidden x 1`` gate;
    * MoE layers: all (Mixtral), from ``first_k_dense_replace`` on every ``moe_layer_freq``-th
      (DeepSeek), every ``decoder_sparse_step``-th not in ``mlp_only_layers`` (Qwen MoE); the others
      are dense with ``intermediate_size``;
    * two RMSNorms per layer and a final one. DeepSeek-V3's multi-token-prediction layer
      (``num_nextn_predict_layers``) is left out, as its published 671 B total leaves it out.
    """
    f = lambda key, default=None: _field(cfg, key, default, p)  # noqa: E731
    mtype = str(cfg.get("model_type") or "")
    layers, hidden, heads = f("num_hidden_layers"), f("hidden_size"), f("num_attention_heads")
    kv_heads = f("num_key_value_heads") or heads
    head_dim = f("head_dim") or hidden // heads
    vocab = f("vocab_size", 0)
    inter = f("intermediate_size", 4 * hidden)
    norms = 2 * hidden

    if cfg.get("kv_lora_rank") is not None:  # multi-head latent attention
        rank, rope, nope = f("kv_lora_rank"), f("qk_rope_head_dim", 64), f("qk_nope_head_dim", 128)
        v_dim, q_rank = f("v_head_dim", 128), f("q_lora_rank")
        q = (hidden * q_rank + q_rank + q_rank * heads * (nope + rope)) if q_rank else hidden * heads * (nope + rope)
        attn = q + hidden * (rank + rope) + rank + rank * heads * (nope + v_dim) + heads * v_dim * hidden
        kind = "mla"
    else:
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
        attn = 2 * hidden * q_dim + 2 * hidden * kv_dim
        if mtype in _QKV_BIAS_TYPES:
            attn += q_dim + 2 * kv_dim
        elif cfg.get("attention_bias"):
            attn += q_dim + 2 * kv_dim + hidden
        if mtype in _QK_NORM_TYPES:
            attn += 2 * head_dim
        kind = "gqa"

    experts = f("n_routed_experts") or f("num_local_experts") or f("num_experts") or 0
    dense_mlp = 3 * hidden * inter
    if experts:
        top_k = f("num_experts_per_tok") or f("experts_per_token")  # gpt-oss's config has both names
        if not top_k or top_k > experts:
            raise ConfigError(f"model config {p} has {experts} experts but num_experts_per_tok "
                              f"{cfg.get('num_experts_per_tok')!r} (1 to {experts})")
        expert = 3 * hidden * (f("moe_intermediate_size") or inter)
        router = experts * hidden + (experts if cfg.get("topk_method") == "noaux_tc" else 0)
        shared = f("n_shared_experts", 0) * expert
        if f("shared_expert_intermediate_size"):
            shared += 3 * hidden * f("shared_expert_intermediate_size") + hidden  # + its sigmoid gate
        first_dense, freq = f("first_k_dense_replace", 0), f("moe_layer_freq", 1) or 1
        step = f("decoder_sparse_step", 1) or 1
        only_mlp = cfg.get("mlp_only_layers") or []
        if not isinstance(only_mlp, list):
            raise ConfigError(f"model config {p} has a non-list 'mlp_only_layers'")
        moe_layers = sum(1 for i in range(layers) if i >= first_dense and i % freq == 0 and (i + 1) % step == 0
                         and i not in only_mlp)
        moe_total = attn + norms + router + experts * expert + shared
        moe_active = attn + norms + router + top_k * expert + shared
    else:
        moe_layers = moe_total = moe_active = top_k = 0
    dense_layers = layers - moe_layers
    embedding = vocab * hidden
    outside = embedding + (0 if cfg.get("tie_word_embeddings") else embedding) + hidden  # + final norm
    dense = dense_layers * (attn + norms + dense_mlp)
    return ParamCount(total=outside + dense + moe_layers * moe_total, active=outside + dense + moe_layers * moe_active,
                      embedding=embedding, dense_layers=dense_layers, moe_layers=moe_layers, attention=kind,
                      experts=experts if moe_layers else 0, experts_per_token=top_k if moe_layers else 0,
                      attention_params=attn * layers)


def _text_config(cfg: dict) -> dict:
    """The language model's part of a multimodal config (``text_config``), else the config itself."""
    inner = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(inner, dict):
        return {**inner, "model_type": inner.get("model_type") or cfg.get("model_type")}
    return cfg


#: config.json ``layer_types`` values and the KV-group kind of each.
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
                "linear_attention": "linear"}
#: model_type values whose ``sliding_window`` applies to every layer when no pattern is given.
_ALL_SLIDING_TYPES = ("mistral", "mixtral")
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp32": 4, "fp16": 2, "bf16": 2}


def _layer_kinds(cfg: dict, layers: int, p) -> list[str] | None:
    """Each layer's KV-group kind from a config.json, or None when every layer is full attention:
    ``layer_types`` when given (transformers' field: Gemma 3, gpt-oss, Qwen3-Next / Qwen3.5); else
    Gemma 3's ``sliding_window_pattern`` (layer i global when (i + 1) % pattern == 0), Gemma 2's
    alternation (even layers sliding), Llama 4's ``attention_chunk_size`` on the layers
    ``no_rope_layers`` marks 1 (default: every 4th layer global), Qwen3-Next's
    ``full_attention_interval``, Mistral's ``sliding_window`` on every layer."""
    mtype = str(cfg.get("model_type") or "")
    lt = cfg.get("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or len(lt) != layers or any(t not in _LAYER_TYPES for t in lt):
            raise ConfigError(f"model config {p} has 'layer_types' that is not a list of {layers} of "
                              f"{', '.join(_LAYER_TYPES)}")
        kinds = [_LAYER_TYPES[t] for t in lt]
    elif cfg.get("attention_chunk_size") and mtype.startswith("llama4"):
        nope = cfg.get("no_rope_layers")
        if isinstance(nope, list) and len(nope) == layers:
            kinds = ["chunked" if v else "full" for v in nope]
        else:
            every = _field(cfg, "no_rope_layer_interval", 4, p) or 4
            kinds = ["full" if (i + 1) % every == 0 else "chunked" for i in range(layers)]
    elif cfg.get("full_attention_interval") and any(k.startswith("linear_") for k in cfg):
        every = _field(cfg, "full_attention_interval", 4, p)
        kinds = ["full" if (i + 1) % every == 0 else "linear" for i in range(layers)]
    elif cfg.get("sliding_window") and cfg.get("use_sliding_window") is not False:
        if mtype.startswith("gemma3") or cfg.get("sliding_window_pattern"):
            every = _field(cfg, "sliding_window_pattern", 6, p) or 6
            kinds = ["full" if (i + 1) % every == 0 else "sliding" for i in range(layers)]
        elif mtype.startswith("gemma2"):
            kinds = ["sliding" if i % 2 == 0 else "full" for i in range(layers)]
        elif mtype in _ALL_SLIDING_TYPES:
            kinds = ["sliding"] * layers
        else:
            return None
    else:
        return None
    return None if all(k == "full" for k in kinds) else kinds


def _config_groups(cfg: dict, layers: int, values: int, p) -> tuple[KVGroup, ...]:
    """The KV groups of a config.json (() for full attention everywhere, without an indexer)."""
    f = lambda key, default=None: _field(cfg, key, default, p)  # noqa: E731
    kinds = _layer_kinds(cfg, layers, p)
    indexer = cfg.get("index_head_dim") is not None and cfg.get("kv_lora_rank") is not None
    if kinds is None and not indexer:
        return ()
    kinds = kinds or ["full"] * layers
    groups = []
    for kind in ("linear", "sliding", "chunked", "full"):
        n = kinds.count(kind)
        if not n:
            continue
        if kind == "linear":
            try:
                k_heads, v_heads = f("linear_num_key_heads"), f("linear_num_value_heads")
                k_dim, v_dim = f("linear_key_head_dim"), f("linear_value_head_dim")
                conv = f("linear_conv_kernel_dim", 4)
                state = gated_deltanet_state_bytes(v_heads, k_dim, v_dim, k_heads, conv,
                                                   _DTYPE_BYTES.get(str(cfg.get("mamba_ssm_dtype")), 2))
            except TypeError:
                raise ConfigError(f"model config {p} has linear-attention layers but not every "
                                  f"linear_num_key_heads / linear_num_value_heads / linear_key_head_dim / "
                                  f"linear_value_head_dim") from None
            groups.append(KVGroup("linear", n, state_bytes_per_layer=state))
        else:
            window = 0
            if kind != "full":
                window = f("attention_chunk_size" if kind == "chunked" else "sliding_window") or 0
                if not window:
                    raise ConfigError(f"model config {p} has {kind} layers but no "
                                      f"{'attention_chunk_size' if kind == 'chunked' else 'sliding_window'}")
            groups.append(_attn(kind, n, values, window))
    if indexer:
        groups.append(KVGroup("indexer", layers, indexer_bytes_per_token(f("index_head_dim"))))
    return check_kv_groups(groups, layers, str(p))


def model_from_config(path: str | Path) -> ModelGeometry:
    """Geometry from a HuggingFace ``config.json`` (Llama, Mistral, Qwen2/3, Mixtral, Qwen MoE,
    DeepSeek-V2/V3 with MLA): KV values per token and layer, and the parameter counts of
    :func:`count_params`."""
    p = Path(path)
    try:
        cfg = loads_bounded(json.loads, p.read_text(), f"model config {p}", ConfigError)
    except OSError as e:
        raise ConfigError(f"cannot read model config {p}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f": {e.msg} at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else " (not UTF-8)"
        raise ConfigError(f"model config {p} is not valid JSON{where}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"model config {p} is not a JSON object")
    cfg = _text_config(cfg)
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        if key not in cfg:
            raise ConfigError(f"model config {p} is missing '{key}'")
    f = lambda key, default=None: _field(cfg, key, default, p)  # noqa: E731
    layers, hidden, heads = f("num_hidden_layers"), f("hidden_size"), f("num_attention_heads")
    if not layers or not hidden or not heads:
        raise ConfigError(f"model config {p} has a zero geometry field")
    kv_heads = f("num_key_value_heads") or heads
    head_dim = f("head_dim") or hidden // heads
    if not head_dim:
        raise ConfigError(f"model config {p} has a zero geometry field")
    name = str(cfg.get("_name_or_path") or cfg.get("model_type") or p.parent.name or "custom")
    counts = count_params(cfg, p)
    if counts.attention == "mla":
        rank, rope, nope = f("kv_lora_rank"), f("qk_rope_head_dim", 64), f("qk_nope_head_dim", 128)
        v_dim = f("v_head_dim", 128)
        if not rank + rope:
            raise ConfigError(f"model config {p} has a zero geometry field")
        return ModelGeometry(
            name=name, layers=layers, hidden_size=hidden, attention_heads=heads, kv_heads=0,
            head_dim=v_dim, kv_values_per_token_layer=rank + rope,
            qk_head_dim=nope + rope, v_head_dim=v_dim,
            params=counts.total, active_params=counts.active, source=str(p),
            moe_layers=counts.moe_layers, experts=counts.experts, experts_per_token=counts.experts_per_token,
            groups=_config_groups(cfg, layers, rank + rope, p), attention_params=counts.attention_params,
        )
    g = _gqa(name, layers, hidden, heads, kv_heads, head_dim, counts.total, counts.active,
             (counts.moe_layers, counts.experts, counts.experts_per_token))
    return replace(g, source=str(p), groups=_config_groups(cfg, layers, 2 * kv_heads * head_dim, p),
                   attention_params=counts.attention_params)


def geometry_from_meta(model: dict) -> ModelGeometry:
    """A trace's model geometry (its ``model`` metadata) as a ModelGeometry: the fields it records and,
    where it records them, its KV groups (``kv_groups``, version 1); older traces are full attention
    in every layer."""
    fields = ModelGeometry.__dataclass_fields__
    g = ModelGeometry(**{k: v for k, v in model.items() if k in fields and k != "groups"})
    kvg = model.get("kv_groups")
    if kvg is None:
        return g
    if not isinstance(kvg, dict) or kvg.get("version") != KV_GROUPS_VERSION:
        got = kvg.get("version") if isinstance(kvg, dict) else kvg
        raise ConfigError(f"model metadata has kv_groups of an unknown version {got!r} "
                          f"(this kvemu reads {KV_GROUPS_VERSION})")
    return replace(g, groups=check_kv_groups(kvg.get("groups"), g.layers, "trace model"))


def model_file(spec: str) -> str | None:
    """The config.json file ``spec`` names (what :func:`resolve_model` reads), or None for a preset
    or a name that is neither (so that no output replaces the config it was made from)."""
    if spec in PRESETS:
        return None
    return spec if spec.endswith(".json") or Path(spec).is_file() else None


def resolve_model(spec: str, kv_dtype: str = "bf16") -> ModelGeometry:
    """A preset name or a path to a HuggingFace config.json."""
    if spec in PRESETS:
        model = PRESETS[spec]
    elif model_file(spec):
        model = model_from_config(spec)
    else:
        raise ConfigError(f"unknown model '{spec}' (presets: {', '.join(PRESETS)}; or a config.json path)")
    return model.with_kv_dtype(kv_dtype)
