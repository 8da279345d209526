"""The engine's batched paths against what they replace, worked out independently: the block pool's
reference counts in C (backends.BlockRefs) against a dict and an ordered dict run in the test; the
log's decode spans against a schedule worked out by hand; ``decode_steps_ns`` against ``step_ns``
one step at a time; and the scheduler's decode runs (DecodeRun) against the same scheduler
planning every step on its own."""

from collections import OrderedDict

import numpy as np
import pytest

from kvemu.backends import BlockRefs
from kvemu.engine import EngineConfig, make_timing
from kvemu.engine.blocks import build_block_tables
from kvemu.engine.scheduler import (DecodeRun, EngineLog, RunOutcome, StepOutcome, StepPlan, engine_steps,
                                    in_step_order)
from kvemu.models import resolve_model


class _RefPool:
    """What the pool's counts mean, as a dict of counts and an ordered dict of the unused blocks."""

    def __init__(self):
        self.ref, self.lru = {}, OrderedDict()

    def prefix_hit(self, ids):
        n = idle = 0
        for b in ids:
            if b not in self.ref:
                break
            idle += self.ref[b] == 0
            n += 1
        return n, idle

    def pin(self, ids):
        for b in ids:
            if self.ref[b] == 0:
                del self.lru[b]
            self.ref[b] += 1

    def register(self, ids):
        for b in ids:
            if self.ref.get(b) == 0:
                del self.lru[b]
            self.ref[b] = self.ref.get(b, 0) + 1

    def unregister(self, ids):
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                del self.ref[b]

    def release(self, ids):
        for b in reversed(ids):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.lru[b] = None

    def evict(self, n):
        k = 0
        while k < n and self.lru:
            b, _ = self.lru.popitem(last=False)
            del self.ref[b]
            k += 1
        return k


def test_block_refs_count_and_evict_as_a_dict_and_an_ordered_dict_do():
    rng = np.random.default_rng(7)
    c, ref = BlockRefs(), _RefPool()
    held: list = []  # (ids registered by a "request", still running)
    for _ in range(3000):
        op = rng.integers(0, 5)
        ids = [int(x) for x in rng.choice(5000, size=int(rng.integers(1, 40)), replace=False) * 7919]
        if op == 0:
            assert c.prefix_hit(np.array(ids, np.int64)) == ref.prefix_hit(ids)
        elif op == 1:
            c.register(ids), ref.register(ids)
            held.append(ids)
        elif op == 2 and held:
            ids = held.pop(int(rng.integers(0, len(held))))
            c.release(ids), ref.release(ids)
        elif op == 3 and held:
            n, _ = ref.prefix_hit(held[-1])
            c.pin(held[-1][:n]), ref.pin(held[-1][:n])
            held.append(held[-1][:n])
        elif op == 4:
            k = int(rng.integers(0, 30))
            assert c.evict(k) == ref.evict(k)
        assert c.registered() == len(ref.ref) and c.idle() == len(ref.lru)
    assert c.counts() == ref.ref
    assert c.evict(10**9) == ref.evict(10**9) and c.counts() == ref.ref
    c.register([5, 6]), ref.register([5, 6])
    c.unregister([5]), ref.unregister([5])
    assert c.counts() == ref.ref == {**ref.ref, 6: 1} and c.users(5) == -1 and c.users(6) == 1
    with pytest.raises(KeyError):
        c.pin([123456789])


def _tables(inp, out, tpb=16):
    n = len(inp)
    return build_block_tables(np.asarray(inp), np.asarray(out), np.zeros(n + 1, np.int64), np.zeros(0, np.int64),
                              None, tpb)


def _drive(gen):
    """Runs the scheduler, each step ending when its compute does, a DecodeRun's steps one after
    the other up to its deadline. Returns (plans seen, the steps' (start, end))."""
    seen, times = [], []
    try:
        plan = next(gen)
        while True:
            seen.append(type(plan))
            if type(plan) is DecodeRun:
                end = plan.start_ns + np.cumsum(plan.compute_ns)
                start = end - plan.compute_ns
                m = len(start) if plan.deadline_ns is None else int(np.count_nonzero(start < plan.deadline_ns))
                times += list(zip(start[:m].tolist(), end[:m].tolist()))
                plan = gen.send(RunOutcome(m, int(end[m - 1])))
            else:
                times.append((plan.start_ns, plan.start_ns + plan.compute_ns))
                plan = gen.send(StepOutcome(plan.start_ns + plan.compute_ns))
    except StopIteration as stop:
        return seen, times, stop.value


def test_decode_spans_log_the_rows_worked_out_by_hand():
    """A (16 tokens in, 4 out) arrives at 0, B (16 in, 3 out) 1 ns later, a budget of 17 tokens a
    step: step 0 prefills A; step 1 decodes A (context 16) and prefills B; step 2 decodes both (A
    17, B 16); step 3 decodes both (A 18, B 17) and both finish. The rows are handed over after
    step 2 and at the end: a span cut between the two takes."""
    cfg = EngineConfig(tokens_per_block=16, max_num_batched_tokens=17, max_num_seqs=4)
    timing = make_timing("H100-SXM", resolve_model("llama3-8b"))
    log = EngineLog(2)
    gen = engine_steps(_tables([16, 16], [4, 3]), np.array([0, 1]), np.array([16, 16]), np.array([4, 3]),
                       timing, cfg, log)
    plan = next(gen)
    for _ in range(2):
        plan = gen.send(StepOutcome(plan.start_ns + plan.compute_ns))
    assert isinstance(plan, StepPlan) and log.rows() == 5  # steps 0 to 2 planned
    first = in_step_order(log.take_entries())
    try:
        gen.send(StepOutcome(plan.start_ns + plan.compute_ns))
    except StopIteration as stop:
        assert stop.value["entries"] == 7 and stop.value["steps"] == 4
    second = in_step_order(log.take_entries())
    rows = [tuple(int(e[k][i]) for k in ("step", "request_id", "phase", "tokens", "context_tokens"))
            for e in (first, second) for i in range(len(e["step"]))]
    assert rows == [(0, 0, 0, 16, 0), (1, 0, 1, 1, 16), (1, 1, 0, 16, 0), (2, 0, 1, 1, 17), (2, 1, 1, 1, 16),
                    (3, 0, 1, 1, 18), (3, 1, 1, 1, 17)]
    assert log.rows() == log.taken == 7


@pytest.mark.parametrize("model, gpus", [("llama3-8b", 1), ("llama3-70b", 4), ("deepseek-v3", 8), ("mixtral-8x7b", 2)])
def test_decode_steps_ns_is_step_ns_step_by_step(model, gpus):
    timing = make_timing("H100-SXM", resolve_model(model), gpus)
    rng = np.random.default_rng(3)
    for n in (1, 5, 64, 256):
        attended = np.sort(rng.integers(n, n * 300_000, 100))
        got = timing.decode_steps_ns(n, attended)
        want = [timing.step_ns(n, float(a), a, n, a) for a in attended.tolist()]
        assert got.tolist() == want


def test_decode_runs_schedule_as_the_steps_one_by_one():
    """40 requests arriving over time, some sharing prefixes, HBM for a few at once: planned with
    decode runs the schedule (every row, every step's start and end, what each request found
    cached) is the one planned a step at a time, and most of its steps came in runs."""
    rng = np.random.default_rng(11)
    n = 40
    inp = rng.integers(20, 400, n)
    out = rng.integers(1, 120, n)
    arrival = np.sort(rng.integers(0, 10_000_000_000, n))
    timing = make_timing("H100-SXM", resolve_model("llama3-8b"))
    results = []
    for runs in (False, True):
        cfg = EngineConfig(tokens_per_block=16, max_num_batched_tokens=256, max_num_seqs=8, hbm_kv_blocks=200)
        log = EngineLog(n)
        seen, times, stats = _drive(engine_steps(_tables(inp, out), arrival, inp, out, timing, cfg, log,
                                                 decode_runs=runs))
        results.append((seen, times, stats, in_step_order(log.take_entries()), log.cached.copy()))
    (seen0, t0, s0, e0, c0), (seen1, t1, s1, e1, c1) = results
    assert DecodeRun not in seen0 and seen1.count(DecodeRun) > 10
    assert len(seen1) < len(t1) / 2  # most steps came in runs
    assert t1 == t0 and s1 == s0 and c1.tolist() == c0.tolist()
    assert set(e1) == set(e0) and all(e1[k].tolist() == e0[k].tolist() for k in e0)
