"""config.json → parameter counts and KV geometry, for every preset family (issue 13, part 5).

The configs below repeat the fields of the models' published HuggingFace ``config.json`` files
(only the fields the count reads, plus ``model_type``). The oracles are the totals the model cards
publish; each test's comment works the count out by hand from the same fields, so a wrong shape
in ``count_params`` shows up as a miss against both.
"""
import json

import pytest

from kvemu.errors import ConfigError
from kvemu.models import PRESETS, count_params, resolve_model

KIB = 1024
B = 1e9

LLAMA3_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "tie_word_embeddings": False, "attention_bias": False}
LLAMA3_70B = {**LLAMA3_8B, "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
              "intermediate_size": 28672}
LLAMA31_405B = {**LLAMA3_8B, "num_hidden_layers": 126, "hidden_size": 16384, "num_attention_heads": 128,
                "intermediate_size": 53248}
QWEN2_72B = {"model_type": "qwen2", "num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 29568, "vocab_size": 152064, "tie_word_embeddings": False}
QWEN25_05B = {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
              "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
MIXTRAL_8X7B = {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8,
                "num_experts_per_tok": 2, "tie_word_embeddings": False}
QWEN2_57B_A14B = {"model_type": "qwen2_moe", "num_hidden_layers": 28, "hidden_size": 3584,
                  "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                  "moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480, "num_experts": 64,
                  "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
                  "tie_word_embeddings": False}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "vocab_size": 151936, "tie_word_embeddings": False, "attention_bias": False}
QWEN3_235B_A22B = {**QWEN3_30B_A3B, "num_hidden_layers": 94, "hidden_size": 4096, "num_attention_heads": 64,
                   "intermediate_size": 12288, "moe_intermediate_size": 1536}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
               "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
               "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280, "topk_method": "noaux_tc",
               "num_nextn_predict_layers": 1, "tie_word_embeddings": False}
DEEPSEEK_V2 = {"model_type": "deepseek_v2", "num_hidden_layers": 60, "hidden_size": 5120, "num_attention_heads": 128,
               "num_key_value_heads": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
               "n_routed_experts": 160, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
               "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 102400,
               "topk_method": "group_limited_greedy", "tie_word_embeddings": False}
DEEPSEEK_V2_LITE = {**DEEPSEEK_V2, "num_hidden_layers": 27, "hidden_size": 2048, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                    "n_routed_experts": 64, "q_lora_rank": None, "topk_method": "greedy"}


def write(tmp_path, cfg, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return str(p)


def within(got, want, rel=0.01):
    return abs(got - want) <= rel * want


# (config, published total, published active or None, KV bytes per token in bf16)
# Hand counts, per layer unless said: attention q+o = 2 x hidden x heads x head_dim, k+v = 2 x hidden x
# kv_heads x head_dim; gated MLP 3 x hidden x intermediate; 2 norms of hidden; plus embeddings
# vocab x hidden (x 2 untied) and a final norm.
CASES = {
    # 32 x (41,943,040 attn + 176,160,768 MLP + 8,192) + 2 x 525,336,576 + 4,096 = 8,030,261,248
    "Llama-3-8B": (LLAMA3_8B, 8.03 * B, None, 128 * KIB),
    # 80 x (150,994,944 + 704,643,072 + 16,384) + 2 x 1,050,673,152 + 8,192 = 70,553,706,496
    "Llama-3-70B": (LLAMA3_70B, 70.6 * B, None, 320 * KIB),
    # 126 x (570,425,344 + 2,617,245,696 + 32,768) + 2 x 2,101,346,304 + 16,384 = 405,853,388,800
    "Llama-3.1-405B": (LLAMA31_405B, 405.9 * B, None, 504 * KIB),
    # Qwen2 has q/k/v biases (10,240): 80 x (151,005,184 + 726,663,168 + 16,384) + 2 x 1,245,708,288
    # + 8,192 = 72,706,203,648 (the Qwen2-72B and Qwen2.5-72B cards: 72.7 B)
    "Qwen2-72B": (QWEN2_72B, 72.7 * B, None, 320 * KIB),
    # tied embeddings: 24 x (1,836,160 + 13,074,432 + 1,792) + 136,134,656 + 896 = 494,032,768 (card: 0.49 B)
    "Qwen2.5-0.5B": (QWEN25_05B, 0.494 * B, None, 2 * 24 * 2 * 64 * 2),
    # 32 x (41,943,040 + 8 x 176,160,768 + router 32,768 + 8,192) + 2 x 131,072,000 + 4,096 = 46,702,792,704;
    # active: 2 of 8 experts, 32 x 394,305,536 + 262,148,096 = 12,879,925,248
    "Mixtral-8x7B": (MIXTRAL_8X7B, 46.7 * B, 12.9 * B, 128 * KIB),
    # 28 x (29,364,736 attn+bias + 64 x 27,525,120 experts + shared 220,200,960 + its gate 3,584 + router
    # 229,376 + 7,168) + 2 x 544,538,624 = 57,408,658,944; active: 8 experts, 14,249,270,784 ("A14B")
    "Qwen2-57B-A14B": (QWEN2_57B_A14B, 57.4 * B, 14 * B, 2 * 28 * 4 * 128 * 2),
    # q/k norms 256: 48 x (18,874,624 + 128 x 4,718,592 + 262,144 + 4,096) + 2 x 311,164,928 + 2,048
    # = 30,532,122,624; active 48 x 56,889,600 + 622,331,904 = 3,353,032,704 (card: 30.5 B, 3.3 B)
    "Qwen3-30B-A3B": (QWEN3_30B_A3B, 30.5 * B, 3.3 * B, 2 * 48 * 4 * 128 * 2),
    # 94 x (71,303,424 + 128 x 18,874,368 + 524,288 + 8,192) + 2 x 622,329,856 + 4,096 = 235,093,634,560;
    # active 94 x 222,830,848 + 1,244,663,808 = 22,190,763,520 (card: 235 B, 22 B)
    "Qwen3-235B-A22B": (QWEN3_235B_A22B, 235 * B, 22 * B, 2 * 94 * 4 * 128 * 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_counts_and_kv_match_the_published_figures(tmp_path, name):
    cfg, total, active, kv_per_token = CASES[name]
    m = resolve_model(write(tmp_path, cfg))
    assert within(m.params, total), (m.params, total)
    if active is None:
        assert m.active_params == m.params
    else:
        # activated counts are published to two digits (3.3 B for 3.35 B): 2 %
        assert within(m.active_params, active, 0.02), (m.active_params, active)
    assert m.kv_bytes_per_token == kv_per_token


def test_deepseek_v3_from_its_config_json(tmp_path):
    # The issue: experts sized from intermediate_size (18,432) and dense layers and MLA left out gave
    # 6,204 B. By hand, per layer: MLA 7168x1536 + 1536 + 1536x128x192 + 7168x576 + 512 + 512x128x256
    # + 128x128x7168 = 187,107,328; expert 3x7168x2048 = 44,040,192; router 256x7168 + 256 bias.
    # 3 dense layers x (187,107,328 + 3x7168x18432 + 14,336) = 1,750,450,176
    # 58 MoE layers x (187,107,328 + 257 x 44,040,192 + 1,835,264 + 14,336) = 667,422,603,776
    # + 2 x 129280x7168 + 7,168 = 671,026,419,200 (the MTP layer, 14 B more in the checkpoint, excluded)
    m = resolve_model(write(tmp_path, DEEPSEEK_V3))
    assert m.params == 671_026_419_200
    assert within(m.params, 671 * B)
    # active: 58 x (187,107,328 + 9 x 44,040,192 + 1,835,264 + 14,336) + dense + embeddings
    # = 37,552,297,472. DeepSeek's "37 B activated" leaves the input embedding table (a lookup, 0.93 B)
    # out: 36.63 B, which the published figure's precision (37 B: 36.5-37.5) covers.
    assert m.active_params == 37_552_297_472
    c = count_params(DEEPSEEK_V3)
    assert (c.dense_layers, c.moe_layers, c.attention) == (3, 58, "mla")
    assert 36.5 * B <= m.active_params - c.embedding < 37.5 * B
    # KV: kv_lora_rank + qk_rope_head_dim = 576 values per layer (REFERENCE.md: 1,152 B per layer in bf16),
    # attention FLOPs over 192-dim queries and 128-dim values; as the preset has it
    preset = PRESETS["deepseek-v3"]
    for field in ("layers", "kv_values_per_token_layer", "qk_head_dim", "v_head_dim", "attention_heads", "kv_heads"):
        assert getattr(m, field) == getattr(preset, field), field
    assert m.kv_bytes_per_token_layer == 1152
    assert within(m.params, preset.params) and within(m.active_params, preset.active_params, 0.02)


def test_deepseek_v2_and_v2_lite(tmp_path):
    # V2: 1 dense layer (149,227,520 MLA + 188,743,680 + 10,240) + 59 MoE layers x (149,227,520
    # + 162 x 23,592,960 + router 819,200 + 10,240) + 2 x 524,288,000 + 5,120 = 235,741,434,880 (236 B);
    # active without the input embedding 20,851,512,320 (paper: 21 B activated)
    v2 = resolve_model(write(tmp_path, DEEPSEEK_V2))
    assert v2.params == 235_741_434_880 and within(v2.params, 236 * B)
    assert 20.5 * B <= v2.active_params - count_params(DEEPSEEK_V2).embedding < 21.5 * B
    # V2-Lite: q_lora_rank null, so one q projection 2048 x 16 x 192: 15,706,484,224 (card: 15.7 B)
    lite = resolve_model(write(tmp_path, DEEPSEEK_V2_LITE, "lite.json"))
    assert lite.params == 15_706_484_224 and within(lite.params, 15.7 * B)
    assert lite.kv_values_per_token_layer == 576 and lite.qk_head_dim == 192


@pytest.mark.parametrize("preset,cfg", [("llama3-8b", LLAMA3_8B), ("llama3-70b", LLAMA3_70B),
                                        ("llama3.1-405b", LLAMA31_405B), ("qwen2.5-72b", QWEN2_72B),
                                        ("mixtral-8x7b", MIXTRAL_8X7B)])
def test_config_json_agrees_with_the_preset(tmp_path, preset, cfg):
    m, p = resolve_model(write(tmp_path, cfg)), PRESETS[preset]
    assert within(m.params, p.params) and within(m.active_params, p.active_params)
    assert (m.layers, m.kv_values_per_token_layer, m.kv_bytes_per_token) == (
        p.layers, p.kv_values_per_token_layer, p.kv_bytes_per_token)


def test_moe_layer_selection_and_shared_experts():
    # 4 layers, hidden 8, vocab 10, 2 heads of 4 (1 KV head), intermediate 16, experts of 4, 3 experts
    # top 1, one shared expert of 6. decoder_sparse_step 2 makes layers 1 and 3 MoE; mlp_only_layers
    # [3] turns 3 back into dense: layers 0, 2, 3 dense, 1 MoE.
    cfg = {"model_type": "qwen2_moe", "num_hidden_layers": 4, "hidden_size": 8, "num_attention_heads": 2,
           "num_key_value_heads": 1, "intermediate_size": 16, "moe_intermediate_size": 4, "num_experts": 3,
           "num_experts_per_tok": 1, "shared_expert_intermediate_size": 6, "decoder_sparse_step": 2,
           "mlp_only_layers": [3], "vocab_size": 10, "tie_word_embeddings": True}
    attn = 2 * 8 * 8 + 2 * 8 * 4 + (8 + 2 * 4)  # q+o, k+v, q/k/v biases = 208
    dense = attn + 3 * 8 * 16 + 16  # 592
    shared = 3 * 8 * 6 + 8  # 152 with its gate
    moe_total = attn + 16 + 3 * 8 + 3 * (3 * 8 * 4) + shared  # 688
    moe_active = attn + 16 + 3 * 8 + 1 * (3 * 8 * 4) + shared  # 496
    c = count_params(cfg)
    assert (c.dense_layers, c.moe_layers) == (3, 1)
    assert c.total == 3 * dense + moe_total + 10 * 8 + 8
    assert c.active == 3 * dense + moe_active + 10 * 8 + 8
    # DeepSeek's rule: dense below first_k_dense_replace, then every moe_layer_freq-th
    ds = {**DEEPSEEK_V2_LITE, "num_hidden_layers": 7, "first_k_dense_replace": 2, "moe_layer_freq": 2}
    assert (count_params(ds).dense_layers, count_params(ds).moe_layers) == (4, 3)  # MoE: 2, 4, 6


def test_multimodal_text_config(tmp_path):
    m = resolve_model(write(tmp_path, {"model_type": "llava", "text_config": LLAMA3_8B}))
    assert m.params == 8_030_261_248 and m.kv_bytes_per_token == 128 * KIB


@pytest.mark.parametrize("patch,match", [
    ({"num_experts_per_tok": None}, "8 experts but num_experts_per_tok None"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok 9 \(1 to 8\)"),
    ({"intermediate_size": -1}, "non-integer or negative 'intermediate_size'"),
    ({"vocab_size": 3.5}, "non-integer or negative 'vocab_size'"),
    ({"hidden_size": "4096"}, "non-integer or negative 'hidden_size'"),
    ({"num_hidden_layers": 0}, "zero geometry field"),
])
def test_bad_fields_are_refused(tmp_path, patch, match):
    with pytest.raises(ConfigError, match=match):
        resolve_model(write(tmp_path, {**MIXTRAL_8X7B, **patch}))


def test_not_utf8_is_refused(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        resolve_model(str(p))
