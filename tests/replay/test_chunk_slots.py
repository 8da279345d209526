"""The blocks a closed loop's tier may hold by chunk (chunk_keys, expanded a batch of requests at a
time) and their arena slots (instance_views, computed in place), against brute force over each
request's table."""

import numpy as np
import pytest

from kvemu.engine.blocks import BlockTables
from kvemu.engine.scheduler import EngineConfig
from kvemu.replay.closed import inputs as closed_inputs
from kvemu.replay.closed.inputs import EngineInputs, chunk_keys
from kvemu.replay.instances import instance_views

TPB = 16


def _inputs(seed: int, policy: str) -> EngineInputs:
    rng = np.random.default_rng(seed)
    n, shared = 40, 30
    tables, nxt = [], shared
    for _ in range(n):
        k = int(rng.integers(0, 12))
        prefix = list(range(int(rng.integers(0, 4)), shared))[: int(rng.integers(0, 6))]  # shared prefix ids
        own = list(range(nxt, nxt + k))
        nxt += k
        tables.append(prefix + own)
    offsets = np.cumsum([0] + [len(t) for t in tables]).astype(np.int64)
    ids = np.array([i for t in tables for i in t], np.int64)
    lens = np.diff(offsets)
    inp = (lens * TPB - rng.integers(0, 2 * TPB, n)).clip(0)  # the last block or two not full
    bt = BlockTables(TPB, offsets, ids, inp // TPB, shared, nxt)
    return EngineInputs(bt, np.zeros(n, np.int64), inp, np.ones(n, np.int64), None,
                        EngineConfig(tokens_per_block=TPB, tier_policy=policy))


def _brute(inp: EngineInputs, cb: int, requests):
    t = inp.tables
    present = np.zeros(t.id_space, bool)
    key_of, off_of = np.zeros(t.id_space, np.int64), np.zeros(t.id_space, np.int64)
    for r in range(len(t.offsets) - 1):
        table = t.ids[t.offsets[r] : t.offsets[r + 1]].tolist()
        keep = min(int(inp.input_tokens[r]) // TPB, len(table)) if inp.cfg.tier_policy == "offload" else len(table)
        if requests is not None and not requests[r]:
            keep = 0
        for p in range(keep):
            present[table[p]] = True
            key_of[table[p]] = table[p - p % cb]   # the last request to store a block names its chunk
            off_of[table[p]] = p % cb
    return key_of, off_of, present


@pytest.mark.parametrize("policy", ["offload", "resident"])
@pytest.mark.parametrize("cb", [1, 3])
@pytest.mark.parametrize("batch", [1, 7, 1 << 17])
def test_chunk_keys_any_batch(monkeypatch, policy, cb, batch):
    monkeypatch.setattr(closed_inputs, "CHUNK_KEYS_BATCH", batch)
    inp = _inputs(cb + batch, policy)
    requests = np.arange(len(inp.input_tokens)) % 3 != 1
    for sel in (None, requests):
        key_of, off_of, present = chunk_keys(inp, cb, sel)
        bk, bo, bp = _brute(inp, cb, sel)
        assert (present == bp).all()
        if cb == 1:
            assert key_of is None and off_of is None
        else:
            assert (key_of[bp] == bk[bp]).all() and (off_of[bp] == bo[bp]).all()


def test_chunk_slots_against_brute_force():
    inp = _inputs(5, "offload")
    cb = 4
    key_of, off_of, present = chunk_keys(inp, cb)
    for n, sharing in ((1, "shared"), (2, "replicated"), (2, "shared")):
        touched = np.stack([present & (np.arange(len(present)) % (i + 2) != 0) for i in range(n)])
        views = instance_views(touched, n, sharing, True, key_of, off_of, cb)
        rows = [touched.any(axis=0)] * n if sharing == "shared" or n == 1 else list(touched)
        for v, row in zip(views, rows):
            keys = sorted({int(key_of[i]) for i in np.flatnonzero(row)})   # touched chunks in key order
            want = np.zeros(len(row), np.int64)
            for i in np.flatnonzero(row):
                want[i] = keys.index(int(key_of[i])) * cb + int(off_of[i])
            assert v["slot_of"].dtype == np.uint32
            assert (v["slot_of"] == want).all()
            assert v["n_slots"] == max(len(keys), 1) * cb
