import json

import pytest

from kvemu.errors import ConfigError
from kvemu.models import PRESETS, resolve_model

KIB, MIB = 1024, 1024 * 1024


@pytest.mark.parametrize("name,per_token,block16", [
    ("llama3-8b", 128 * KIB, 2 * MIB),
    ("llama3-70b", 320 * KIB, 5 * MIB),
    ("llama3.1-405b", 504 * KIB, 7.875 * MIB),
    ("qwen2.5-72b", 320 * KIB, 5 * MIB),
    ("mixtral-8x7b", 128 * KIB, 2 * MIB),
])
def test_kv_bytes_match_reference(name, per_token, block16):
    m = PRESETS[name]
    assert m.kv_bytes_per_token == per_token
    assert m.block_bytes_per_layer(16) * m.layers == block16


def test_deepseek_mla_caches_576_values_per_layer():
    m = PRESETS["deepseek-v3"]
    assert m.kv_values_per_token_layer == 576
    assert m.kv_bytes_per_token_layer == 1152
    assert abs(m.block_bytes_per_layer(16) * m.layers / MIB - 1.07) < 0.01


def test_fp8_halves_kv():
    assert resolve_model("llama3-70b", "fp8").kv_bytes_per_token == 160 * KIB


def test_config_json(tmp_path):
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "vocab_size": 128256}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = resolve_model(str(p))
    assert m.kv_bytes_per_token == 128 * KIB
    assert 7.5e9 < m.params < 8.5e9  # Llama-3-8B has 8.03B parameters


def test_config_json_mla(tmp_path):
    cfg = {"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert resolve_model(str(p)).kv_values_per_token_layer == 576


def test_config_json_missing_field(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"hidden_size": 4096, "num_attention_heads": 32}))
    with pytest.raises(ConfigError, match="missing 'num_hidden_layers'"):
        resolve_model(str(p))


def test_unknown_model_lists_presets():
    with pytest.raises(ConfigError, match="llama3-70b"):
        resolve_model("gpt-9")
