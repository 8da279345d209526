"""kvemu: record LLM KV-cache access traces and replay them on real memory and storage tiers."""

__version__ = "0.1.0"
