"""The HuggingFace hook: a recording DynamicCache under model.generate, on a small random Llama."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the HuggingFace hook needs torch (pip install torch, CPU build)")
pytest.importorskip("transformers", reason="the HuggingFace hook needs transformers (pip install 'kvemu[hf]')")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvemu.analysis import trace_summary  # noqa: E402
from kvemu.errors import TraceError  # noqa: E402
from kvemu.realrun.hf import HfRecorder, KvRecordingCache, geometry_from_config, record_generate  # noqa: E402
from kvemu.replay import replay  # noqa: E402
from kvemu.schema import PHASE_DECODE, check_entries, iter_entries, read_trace  # noqa: E402

TPB = 8


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()  # random weights, nothing downloaded


def greedy(n):
    return {"max_new_tokens": n, "do_sample": False, "pad_token_id": 0}


def test_cache_records_every_update_of_generate(model):
    ids = torch.randint(0, 100, (2, 13), generator=torch.Generator().manual_seed(1))
    cache = KvRecordingCache(config=model.config)
    model.generate(ids, attention_mask=torch.ones_like(ids), **{rec_kw(): cache}, **greedy(5))
    # (time, layer, write_first, write_tokens, read_first, read_tokens, batch): prefill, then 4 decodes
    got = [u[1:] for u in cache.updates]
    want = [(layer, 0, 13, 0, 13, 2) for layer in (0, 1)]
    want += [(layer, 13 + i, 1, 0, 14 + i, 2) for i in range(4) for layer in (0, 1)]
    assert got == want


def rec_kw():
    from kvemu.realrun.hf import _cache_kwarg

    return _cache_kwarg()


def test_generate_trace_validates_and_replays(model, tmp_path):
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 100, (17,), generator=g)
    prompts = [torch.cat([prefix, torch.randint(0, 100, (n,), generator=g)]) for n in (6, 9, 3)]
    out = tmp_path / "hf.parquet"
    meta = record_generate(model, prompts, out, tokens_per_block=TPB, **greedy(6))
    tr = read_trace(out)
    assert check_entries(tr) == meta["engine"]["entries"] == 3 * 6
    m = tr.header.meta["model"]
    assert (m["layers"], m["kv_heads"], m["head_dim"], m["source"]) == (2, 2, 16, "realrun:hf")
    assert m["params"] == sum(p.numel() for p in model.parameters())
    assert m["kv_dtype"] == "bf16" and tr.header.meta["capture"]["kv_cache_dtype"] == "float32"
    assert tr.input_tokens.tolist() == [23, 26, 20] and tr.output_tokens.tolist() == [6, 6, 6]
    assert tr.cached_tokens.tolist() == [0, 0, 0]  # HuggingFace computes every prompt
    assert np.all(tr.compute_ns > 0)
    e = next(iter_entries(tr.header))
    dec = e["phase"] == PHASE_DECODE
    assert np.array_equal(e["read_count"][dec], e["context_tokens"][dec] // TPB)
    assert np.array_equal(e["store_count"][dec], ((e["context_tokens"][dec] + 1) % TPB == 0).astype(int))
    s = trace_summary(tr)
    assert s["dedup_ratio"] > 1  # the common 17-token prefix: two full blocks in every table
    for backend in ("dram", "vemu:cxl-pool"):
        res = replay(out, backend, None, out=tmp_path / f"r-{backend.replace(':', '_')}.parquet")
        assert res["ops"]["read"]["accesses"] == s["kv_blocks_read"] * 2


def test_a_batch_is_one_request_per_row(model, tmp_path):
    rec = HfRecorder(model, tokens_per_block=TPB)
    ids = torch.randint(0, 100, (3, 10), generator=torch.Generator().manual_seed(3))
    rec.generate(ids, attention_mask=torch.ones_like(ids), **greedy(4))
    rec.write(tmp_path / "b.parquet")
    tr = read_trace(tmp_path / "b.parquet")
    assert tr.n_requests == 3 and len(tr.step) == 4 and check_entries(tr) == 12


def test_geometry_from_config_object(model):
    g = geometry_from_config(model.config, kv_dtype="fp16")
    assert (g.layers, g.hidden_size, g.attention_heads, g.kv_heads, g.head_dim) == (2, 64, 4, 2, 16)
    assert g.kv_bytes_per_token_layer == 2 * 2 * 16 * 2


def test_rewound_cache_is_refused(model):
    rec = HfRecorder(model, tokens_per_block=TPB)
    # two layers: a prefill of 5 tokens, then a write at 2 (what assisted generation's crop does)
    updates = [(0, 0, 0, 5, 0, 5, 1), (0, 1, 0, 5, 0, 5, 1), (0, 0, 2, 1, 0, 3, 1), (0, 1, 2, 1, 0, 3, 1)]
    with pytest.raises(TraceError, match="rewound"):
        rec._add(updates, [], np.zeros((1, 5), np.int64), 0.0)
