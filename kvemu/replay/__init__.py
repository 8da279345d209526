"""Replay a trace through a C backend and compose the serving timeline from what was measured.

Python streams the trace's entries and prepares whole batches (the batch's own block tables
mapped to arena slots, entry and step arrays) and hands them to C, which performs and times every
block access. Python never loops per access.

Time model (docs/replay.md): C adds the measured KV time of a step to its modelled GPU compute
layer by layer, serially or pipelined (``overlap``). Closed loop (``closed``) re-plans each
step with the engine model from the clock those times produced; the recorded schedule keeps each
step's batch and rebuilds the timeline from the step durations (a step starts when the previous
one ended, and not before its requests arrived). Request metrics follow from the step end times.

Modules: ``options`` what a replay can be told (ReplayOptions); ``run`` the flow, a stage a
function, the recorded and closed schedules, repetitions and --dataset; ``describe`` the results'
metadata, built from each stage's piece;
``arena`` the tier arena's shape and size and the per-batch block tables; ``instances`` the
serving instances and their backends; ``accumulate`` each instance's timeline, sums and
inter-token-gap spill, and the results writer; ``closed`` the closed loop (a package: the loop,
the router, the shared tier's queue, its glue and the schedule's results); ``weights`` weights in
the tier, replayed; ``dataset`` the results dataset's layout; ``host`` the host's facts. This module re-exports what the rest of kvemu uses.
"""

import sys
import types

from ..replay_options import (DEFAULT_MAX_MEMORY, MAX_INSTANCES, MAX_REPEAT, SHARING, CostOptions, DataPathOptions,
                      DisaggOptions, InstanceOptions,
                      OutputOptions, ReplayOptions, ScheduleOptions, StoreOptions, TierOptions, WindowOptions)
from .run import Results, replay
from .arena import layer_plan, transfer_shape
from .dataset import backend_label, dataset_path, partition_folder, partition_value
from .host import host_facts

__all__ = ["CostOptions", "DEFAULT_MAX_MEMORY", "DataPathOptions", "DisaggOptions", "InstanceOptions", "MAX_INSTANCES", "MAX_REPEAT",
           "OutputOptions",
           "ReplayOptions", "Results", "SHARING", "ScheduleOptions", "StoreOptions", "TierOptions", "WindowOptions",
           "backend_label", "dataset_path", "host_facts", "layer_plan", "partition_folder", "partition_value", "replay",
           "transfer_shape"]


class _ReplayModule(types.ModuleType):
    """This package is also the function kvemu.replay (run.replay): ``kvemu.replay(trace, backend,
    options, out=...)``, whichever of the two ``kvemu.replay`` names."""

    def __call__(self, *args, **kwargs):
        return replay(*args, **kwargs)


sys.modules[__name__].__class__ = _ReplayModule
