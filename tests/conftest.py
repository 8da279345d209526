"""Shared fixtures: small workloads built by hand and traces recorded from them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvemu.engine import EngineConfig, make_timing, record_trace
from kvemu.models import resolve_model
from kvemu.workloads import Workload

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def make_workload(arrival_ms, input_tokens, output_tokens, hashes=None, hash_block_tokens=64) -> Workload:
    """A workload from lists; ``hashes`` is a list of hash-id lists (None: no prefix info)."""
    n = len(arrival_ms)
    if hashes is None:
        offsets, ids, hb = np.zeros(n + 1, np.int64), np.zeros(0, np.int64), None
    else:
        counts = np.array([len(h) for h in hashes], np.int64)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        ids = np.array([x for h in hashes for x in h], np.int64)
        hb = hash_block_tokens
    return Workload(source="test", kind="test", checksum="sha256:0", arrival_ms=np.array(arrival_ms, np.float64),
                    input_tokens=np.array(input_tokens, np.int64), output_tokens=np.array(output_tokens, np.int64),
                    hash_block_tokens=hb, hash_offsets=offsets, hash_ids=ids, params={})


def record(workload, path, model="llama3-8b", **engine):
    geometry = resolve_model(model)
    # the factors the tests' own oracles use (one set for both phases, one GPU: no collectives)
    timing = make_timing("H100-SXM", geometry, mfu=0.5, mbu=0.7, overhead_us=300.0)
    cfg = EngineConfig(**engine)
    if cfg.hbm_kv_blocks is None:
        cfg = EngineConfig(**{**engine, "hbm_kv_blocks": 10_000})
    record_trace(workload, geometry, timing, cfg, path)
    return path


@pytest.fixture
def shared_prefix_workload():
    """Three requests: 0 and 2 share two 64-token hash blocks, 1 shares only the first."""
    return make_workload(
        arrival_ms=[0.0, 5.0, 2000.0],
        input_tokens=[200, 150, 160],
        output_tokens=[4, 3, 5],
        hashes=[[1, 2, 3, 4], [1, 7, 8], [1, 2, 9]],
    )


@pytest.fixture(scope="session")
def chat_trace(tmp_path_factory):
    """A small synthetic chat trace, recorded once per session."""
    from kvemu.record_options import RecordOptions
    from kvemu.recording import record

    path = tmp_path_factory.mktemp("traces") / "chat.parquet"
    record("synthetic:chat:sessions=3,turns=3", "llama3-8b", path,
           RecordOptions.from_flat(hbm_kv_gib=0.5, show_progress=False))
    return path
