"""kvemu: record LLM KV-cache access traces and replay them on real memory and storage tiers.

The Python API (docs/python.md); the command line calls the same functions::

    import kvemu

    trace = kvemu.record("synthetic:chat", "llama3-8b", "chat.parquet")
    results = kvemu.replay("chat.parquet", "vemu:cxl-pool",
                           kvemu.ReplayOptions(window=kvemu.WindowOptions(layers=2)), out="chat-cxl.parquet")
    report = kvemu.report(["chat-cxl.parquet"])
    print(kvemu.render_table(report))

Names are imported when first used, so ``import kvemu`` stays light.
"""

__version__ = "0.1.0"

#: name -> (module, attribute) of the public API, imported on first use (PEP 562).
_API = {
    "record": ("kvemu.recording", "record"),
    "RecordOptions": ("kvemu.record_options", "RecordOptions"),
    "WorkloadOptions": ("kvemu.record_options", "WorkloadOptions"),
    "GpuOptions": ("kvemu.record_options", "GpuOptions"),
    "EngineOptions": ("kvemu.record_options", "EngineOptions"),
    "WeightsOptions": ("kvemu.record_options", "WeightsOptions"),
    "DeploymentOptions": ("kvemu.record_options", "DeploymentOptions"),
    "RecordOutputOptions": ("kvemu.record_options", "RecordOutputOptions"),
    "replay": ("kvemu.replay", "replay"),
    "Results": ("kvemu.replay", "Results"),
    "ReplayOptions": ("kvemu.replay_options", "ReplayOptions"),
    "ScheduleOptions": ("kvemu.replay_options", "ScheduleOptions"),
    "WindowOptions": ("kvemu.replay_options", "WindowOptions"),
    "DataPathOptions": ("kvemu.replay_options", "DataPathOptions"),
    "StoreOptions": ("kvemu.replay_options", "StoreOptions"),
    "TierOptions": ("kvemu.replay_options", "TierOptions"),
    "InstanceOptions": ("kvemu.replay_options", "InstanceOptions"),
    "DisaggOptions": ("kvemu.replay_options", "DisaggOptions"),
    "CostOptions": ("kvemu.replay_options", "CostOptions"),
    "OutputOptions": ("kvemu.replay_options", "OutputOptions"),
    "BackendSpec": ("kvemu.backend_spec", "BackendSpec"),
    "report": ("kvemu.report", "report"),
    "Report": ("kvemu.report", "Report"),
    "render_table": ("kvemu.report", "render_table"),
    "render_json": ("kvemu.report", "render_json"),
    "render_csv": ("kvemu.report", "render_csv"),
    "render_html": ("kvemu.report", "render_html"),
    "plan": ("kvemu.plan", "plan"),
    "PlanOptions": ("kvemu.plan", "PlanOptions"),
    "KvemuError": ("kvemu.errors", "KvemuError"),
    "ConfigError": ("kvemu.errors", "ConfigError"),
    "OptionError": ("kvemu.errors", "OptionError"),
    "TraceError": ("kvemu.errors", "TraceError"),
    "ResultsError": ("kvemu.errors", "ResultsError"),
    "BackendError": ("kvemu.errors", "BackendError"),
    "BackendUnavailable": ("kvemu.errors", "BackendUnavailable"),
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    try:
        module, attr = _API[name]
    except KeyError:
        raise AttributeError(f"module 'kvemu' has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(module), attr)
    if name not in ("replay", "report"):  # those two are subpackages too: importing them sets the name
        globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
