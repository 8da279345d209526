"""Closed-loop replay: the engine model schedules while the tier sets its clock (docs/replay.md).

Open-loop replay (``--schedule recorded``) keeps every recorded step and only stretches the
timeline. Here the engine model that recorded the trace (kvemu.engine: continuous batching, token
budget, chunked prefill, prefix cache, HBM capacity and eviction, tier policy) runs again, step by
step: each step is planned from the engine's state at its start, its KV operations are replayed
through the backend (measured or emulated), and the step's end as the backend timed it becomes the
engine's clock. Requests that arrived by then join the next step, so a slower tier changes the
batches, and a window of requests is replayed with everything before it (its history).

Steps that move no KV (decodes under ``offload``) and stream no weights take their modelled compute
and do not call C; C keeps the async store stream across calls, and every call starts at the
engine's clock.

How the loop is built. The scheduler (``engine.scheduler.engine_steps``) is a coroutine: it yields
a ``StepPlan`` (start, modelled compute, its entries as rows of the engine's log, whether it moves
KV, its new tokens, the requests it finishes, the asynchronous loads it issues) and receives a
``StepOutcome`` (when the step ended, and when each of its loads is done); with nothing to do under
a router it yields ``Idle(deadline_ns)`` and receives when to wake; steps that are decodes alone
until the next that finishes a request come as one ``DecodeRun`` (their modelled computes, the
next arrival), and the loop sends back how many ran before that arrival (``RunOutcome``). Nothing
else passes between them: the engine's log holds only the entries, which the loop reads.

- ``inputs``: what the engine schedules from, rebuilt from the trace (EngineInputs), whether a
  trace can be re-planned (schedule_source), the blocks the tier may hold by chunk (chunk_keys);
- ``loop``: one instance's loop (ClosedLoop): plans run through the backend (one C call per step
  that moves KV), async loads on a load stream, entries folded into the instance's Accumulator;
- ``router``: several instances (Router, ROUTING): arrivals routed at their time, the instances'
  clocks kept in step (in lockstep on emulated and virtual tiers);
- ``tierqueue``: one tier shared by several instances (shared_tier on the engine side, TierQueue
  for the emulated tier's bandwidth);
- ``run``: what replay.run calls: each instance thread's body (closed_body), the engines' totals,
  the schedule's results metadata;
- ``disagg``: prefill/decode disaggregation (run_disagg): a prefill side, the hand-offs, a decode
  side, each side's instances run as above.
"""

from .inputs import KV_LOADS, SCHEDULES, EngineInputs, chunk_keys, engine_inputs, schedule_source
from .loop import ClosedLoop
from .router import ROUTING, Router
from .run import closed_body, closed_totals, replayed_load, time_scale_of
from .tierqueue import TierQueue, shared_tier

__all__ = ["KV_LOADS", "ROUTING", "SCHEDULES", "ClosedLoop", "EngineInputs", "Router", "TierQueue", "chunk_keys",
           "closed_body", "closed_totals", "engine_inputs", "replayed_load", "schedule_source",
           "shared_tier", "time_scale_of"]
