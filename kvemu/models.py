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


def _gqa(name, layers, hidden, heads, kv_heads, head_dim, params, active=None):
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
        _gqa("mixtral-8x7b", 32, 4096, 32, 8, 128, 46_700_000_000, 12_900_000_000),
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
        ),
    )
}


def _estimate_params(cfg: dict, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int):
    """Weights of a Llama-style decoder from its config: embeddings, attention, (MoE) MLP."""
    vocab = int(cfg.get("vocab_size", 0))
    inter = int(cfg.get("intermediate_size", 4 * hidden))
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    experts = int(cfg.get("num_local_experts", cfg.get("n_routed_experts", 0)) or 0)
    per_tok = int(cfg.get("num_experts_per_tok", 0) or 0)
    mlp = 3 * hidden * inter
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    if experts and per_tok:
        total = embed + layers * (attn + experts * mlp)
        active = embed + layers * (attn + per_tok * mlp)
    else:
        total = active = embed + layers * (attn + mlp)
    return total, active


def model_from_config(path: str | Path) -> ModelGeometry:
    """Geometry from a HuggingFace ``config.json`` (Llama, Qwen, Mistral/Mixtral, DeepSeek MLA)."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read model config {p}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"model config {p} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"model config {p} is not a JSON object")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        if key not in cfg:
            raise ConfigError(f"model config {p} is missing '{key}'")
    try:
        layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
    except (TypeError, ValueError, ZeroDivisionError):
        raise ConfigError(f"model config {p} has non-integer geometry fields") from None
    if min(layers, hidden, heads, kv_heads, head_dim) <= 0:
        raise ConfigError(f"model config {p} has a zero or negative geometry field")
    name = str(cfg.get("_name_or_path") or cfg.get("model_type") or p.parent.name or "custom")
    total, active = _estimate_params(cfg, layers, hidden, heads, kv_heads, head_dim)
    if "kv_lora_rank" in cfg:  # multi-head latent attention
        rank, rope = int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim", 64))
        nope = int(cfg.get("qk_nope_head_dim", 128))
        return ModelGeometry(
            name=name, layers=layers, hidden_size=hidden, attention_heads=heads, kv_heads=0,
            head_dim=int(cfg.get("v_head_dim", 128)), kv_values_per_token_layer=rank + rope,
            qk_head_dim=nope + rope, v_head_dim=int(cfg.get("v_head_dim", 128)),
            params=total, active_params=active, source=str(p),
        )
    g = _gqa(name, layers, hidden, heads, kv_heads, head_dim, total, active)
    return ModelGeometry(**{**asdict(g), "source": str(p)})


def resolve_model(spec: str, kv_dtype: str = "bf16") -> ModelGeometry:
    """A preset name or a path to a HuggingFace config.json."""
    if spec in PRESETS:
        model = PRESETS[spec]
    elif spec.endswith(".json") or Path(spec).is_file():
        model = model_from_config(spec)
    else:
        raise ConfigError(f"unknown model '{spec}' (presets: {', '.join(PRESETS)}; or a config.json path)")
    return model.with_kv_dtype(kv_dtype)
