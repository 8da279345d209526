"""Model geometry: how many KV bytes a token costs, and how much compute a token needs.

KV bytes per token and layer = values per token per layer x dtype bytes, where values are
2 x KV heads x head_dim for multi-head / grouped-query attention, and kv_lora_rank +
qk_rope_head_dim for DeepSeek's multi-head latent attention (MLA).

Preset figures come from the models' published ``config.json`` files and model cards; they are
checked against ``shared/REFERENCE.md`` in the tests.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import ConfigError
from .inputs import loads_bounded

KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
WEIGHT_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}


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

    @property
    def kv_dtype_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.kv_dtype]

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return self.kv_values_per_token_layer * self.kv_dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_layer * self.layers

    def block_bytes_per_layer(self, tokens_per_block: int) -> int:
        return tokens_per_block * self.kv_bytes_per_token_layer

    def with_kv_dtype(self, kv_dtype: str) -> "ModelGeometry":
        if kv_dtype not in KV_DTYPE_BYTES:
            raise ConfigError(
                f"unknown KV dtype '{kv_dtype}' (known: {', '.join(KV_DTYPE_BYTES)})"
            )
        return ModelGeometry(**{**asdict(self), "kv_dtype": kv_dtype})

    def to_dict(self, tokens_per_block: int) -> dict:
        d = asdict(self)
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
        ),
    )
}


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
        top_k = f("num_experts_per_tok")
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
                      experts=experts if moe_layers else 0, experts_per_token=top_k if moe_layers else 0)


def _text_config(cfg: dict) -> dict:
    """The language model's part of a multimodal config (``text_config``), else the config itself."""
    inner = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(inner, dict):
        return {**inner, "model_type": inner.get("model_type") or cfg.get("model_type")}
    return cfg


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
        )
    g = _gqa(name, layers, hidden, heads, kv_heads, head_dim, counts.total, counts.active,
             (counts.moe_layers, counts.experts, counts.experts_per_token))
    return ModelGeometry(**{**asdict(g), "source": str(p)})


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
