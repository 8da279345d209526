"""Real-run trace sources: KV traffic observed in a model that actually ran, rather than modelled.

- ``tiny``: a numpy transformer with a paged, prefix-sharing KV cache, recorded layer by layer
  (``record_tiny``; ``kvemu record --run tiny``).
- ``hf``: a HuggingFace ``transformers`` cache that records ``update()`` calls during
  ``model.generate`` (library hook; needs ``kvemu[hf]`` and torch).
- ``vllm_events``: vLLM's KV cache events (ZMQ publisher, msgpack) imported as a trace
  (``import_vllm_events``; ``kvemu record --from-vllm-events``; needs ``kvemu[vllm]``).

All three build their traces with ``tracebuild.TraceBuilder``. What each captures and what it
cannot is in docs/sources.md.
"""

from .tiny import TinyConfig, TinyModel, record_tiny, run_tiny
from .vllm_events import import_vllm_events, read_event_batches

__all__ = ["record_tiny", "run_tiny", "TinyConfig", "TinyModel", "import_vllm_events", "read_event_batches"]
