"""Command line: parse, call the library, print. Data goes to stdout, progress to stderr."""

from __future__ import annotations

if __name__ == "__main__":  # python -m kvemu.cli: the kvemu command, handlers before the imports below
    from kvemu.__main__ import main

    main()

import functools
import os
import time

# Arrow's pool is the C library's, so that what a streamed pass over a trace frees goes back to
# the system instead of raising the peak (docs/performance.md, memory): set before anything
# imports pyarrow, which reads it once; a value the user set wins.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")


def replay_allocator(size: int = 128 << 10) -> None:
    """For the commands that replay (replay, sweep, demo), called before they start: glibc serves
    every block over 128 KiB with its own mapping instead of raising that threshold as large
    blocks are freed (M_MMAP_THRESHOLD), so a replay's memory stays flat (docs/performance.md,
    memory). Not for the other commands: it costs a page fault per large array, and `analyze
    capacity` allocates many. Skipped where MALLOC_MMAP_THRESHOLD_ is set or the C library is
    not glibc."""
    import ctypes

    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: its mallopt takes M_MMAP_THRESHOLD = -3
        libc.mallopt(-3, size)
    except (OSError, AttributeError):
        pass


import click

from . import __version__
from . import jsontext
from .backend_spec import spec_forms
from .errors import ConfigError, KvemuError, OptionError, out_of_memory_message
from .plots import INSTALL_HINT as PLOT_INSTALL_HINT
from .policies import policy_names
from .prices import DEFAULT_AMORTISE_YEARS
from .printable import one_line, safe_text, shorten_words
from .stackrules import DEFAULT_PLACEMENT, ONE_LEVEL_PLACEMENT, PLACEMENT_DOCS, PLACEMENTS, SELECTIVE
from .units import parse_range, parse_size

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _echo(message="", **kwargs) -> None:
    """click.echo of text that may hold what files said: control characters escaped
    (kvemu/printable.py), so a trace's metadata or a results label cannot drive the terminal."""
    click.echo(safe_text(message), **kwargs)


class UserError(click.ClickException):
    """One line on stderr, exit code 2, no traceback; a word longer than printable.LONGEST_WORD
    (a 1 MB profile name) shortened, so the line stays one line of a terminal's scrollback."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(shorten_words(message))


class Interrupted(click.ClickException):
    """A signal (kvemu/interrupt.py): one line on what was discarded, exit 128 + its number; a
    broken pipe: quiet unless an output was discarded, exit 141."""

    def __init__(self, exc: BaseException):
        from .interrupt import interrupted_message

        code, message = interrupted_message(exc)
        super().__init__(one_line(message or ""))
        self.quiet = message is None
        self.exit_code = code

    def show(self, file=None) -> None:
        if not self.quiet:
            super().show(file)


#: The flag of each field of the Python API's options (errors.OptionError.field), so that a message
#: names what the user typed: ``replay.stores.timing`` -> ``--store-timing``.
RECORD_FLAGS: dict[str, str] = {
    "workload.max_requests": "--max-requests", "workload.window_ms": "--window-ms",
    "workload.hash_block_tokens": "--hash-block-tokens", "workload.seed": "--seed",
    "workload.time_scale": "--time-scale", "workload.request_rate": "--request-rate",
    "gpu.gpu": "--gpu", "gpu.gpus": "--gpus", "gpu.tp": "--tp", "gpu.pp": "--pp", "gpu.ep": "--ep",
    "gpu.dp_attention": "--dp-attention",
    "gpu.weight_dtype": "--weight-dtype", "gpu.mfu": "--mfu", "gpu.mbu": "--mbu",
    "gpu.step_overhead_us": "--step-overhead-us", "gpu.compute": "--compute", "gpu.engine_era": "--engine-era",
    "engine.tier_policy": "--tier-policy", "engine.block_tokens": "--block-tokens",
    "engine.max_batched_tokens": "--max-batched-tokens", "engine.max_num_seqs": "--max-num-seqs",
    "engine.hbm_kv_gib": "--hbm-kv-gib", "engine.tier_capacity_gib": "--tier-capacity-gib",
    "engine.kv_dtype": "--kv-dtype", "engine.chunk_tokens": "--chunk-tokens", "engine.kv_layout": "--kv-layout",
    "weights.weights_in_tier": "--weights-in-tier", "weights.cold_experts": "--cold-experts",
    "weights.stream": "--weight-stream", "output.force": "--force",
    "deployment.prefill_instances": "--prefill-instances", "deployment.decode_instances": "--decode-instances",
    "deployment.transfer": "--transfer", "deployment.prefill_routing": "--prefill-routing",
    "deployment.decode_routing": "--decode-routing", "deployment.threshold_tokens": "--disagg-threshold",
}
REPLAY_FLAGS: dict[str, str] = {
    "schedule.schedule": "--schedule", "schedule.time_scale": "--time-scale", "schedule.request_rate": "--request-rate",
    "schedule.routing": "--routing", "schedule.kv_load": "--kv-load",
    "window.requests": "--requests", "window.arrival_ms": "--arrival-ms", "window.warmup": "--warmup", "window.layers": "--layers",
    "datapath.link": "--link", "datapath.overlap": "--overlap", "datapath.chunk_tokens": "--chunk-tokens",
    "datapath.layout": "--kv-layout",
    "stores.timing": "--store-timing", "stores.inflight_bytes": "--store-inflight",
    "tier.capacity_bytes": "--tier-capacity", "tier.max_memory_bytes": "--max-memory", "tier.stack": "--tiers",
    "tier.emulate_missing": "--emulate-missing", "tier.devices": "--tier-devices",
    "instances.count": "--instances", "instances.sharing": "--sharing",
    "disagg.prefill_instances": "--prefill-instances", "disagg.decode_instances": "--decode-instances",
    "disagg.transfer": "--transfer", "disagg.prefill_routing": "--prefill-routing",
    "disagg.decode_routing": "--decode-routing", "disagg.threshold_tokens": "--disagg-threshold",
    "disagg.colocated": "--colocated",
    "disagg.decode_chunked_prefill": "--decode-chunked-prefill",
    "cost.prices": "--prices", "cost.amortise_years": "--amortise-years",
    "output.label": "--label", "output.force": "--force", "output.repeat": "--repeat", "output.dataset": "--dataset",
}


def flag_message(command: str | None, e: OptionError) -> str:
    """An OptionError's message with the command line's flags in place of the fields' names."""
    flags = {"record": RECORD_FLAGS, "replay": REPLAY_FLAGS}.get(command or "", {})
    return e.render(lambda name: flags.get(name, name))


def unusable_name_message(e: BaseException) -> str | None:
    """The line for a file name no file can have, wherever a library call met it first: longer
    than the file system takes (OSError ENAMETOOLONG) or through a loop of symbolic links (ELOOP,
    or the RuntimeError of ``Path.resolve``); None for any other error, which stays a bug to fix."""
    import errno

    if isinstance(e, OSError) and e.errno in (errno.ENAMETOOLONG, errno.ELOOP) and e.filename:
        return f"{e.filename}: {e.strerror} (no file can have this name)"
    if type(e) is RuntimeError and str(e).startswith("Symlink loop from "):
        return f"{str(e)[len('Symlink loop from '):].strip(chr(39))}: a loop of symbolic links (no file can have this name)"
    return None


class _Group(click.Group):
    def invoke(self, ctx):
        from . import interrupt

        try:
            interrupt.release()  # a signal held while click parsed is raised here
            return super().invoke(ctx)
        except OptionError as e:
            raise UserError(one_line(flag_message(ctx.invoked_subcommand, e))) from None
        except KvemuError as e:
            raise UserError(one_line(str(e))) from None
        except (KeyboardInterrupt, interrupt.Terminated) as e:
            raise Interrupted(e) from None
        except BrokenPipeError:
            raise Interrupted(interrupt.BrokenPipe()) from None
        except MemoryError:
            raise UserError(out_of_memory_message(ctx.invoked_subcommand)) from None
        except (OSError, RuntimeError) as e:
            why = unusable_name_message(e)
            if why is None:
                raise
            raise UserError(one_line(why)) from None
        finally:
            interrupt.hold()  # the way out: a later signal is reported by main, not raised


@click.group(cls=_Group, context_settings=CONTEXT)
@click.version_option(__version__, prog_name="kvemu")
def cli():
    """Record LLM KV-cache access traces and replay them on real memory and storage tiers.

    \b
    Typical use:
      kvemu demo                                   # record, replay and compare in about a minute
      kvemu record --workload mooncake:conv.jsonl --model llama3-70b --out t.parquet   # your Mooncake JSONL
      kvemu trace info t.parquet
      kvemu replay t.parquet --backend dram --layers 2 --requests 0:50 --out r.parquet
      kvemu replay t.parquet --backend vemu:cxl-pool --layers 2 --requests 0:50 --out other.parquet
      kvemu report r.parquet other.parquet
    """


def _range(what):
    def convert(ctx, param, value):
        return None if value is None else parse_range(value, what)

    return convert


def _size(ctx, param, value):
    return None if value is None else parse_size(value, f"--{param.name.replace('_', '-')}")


def force_option(f):
    return click.option("--force", is_flag=True, default=False, help="Replace an existing output file.")(f)


# ---------------------------------------------------------------------------------------- record
def deployment_options(f):
    """`record`'s prefill/decode deployment: recorded in the trace for replay to run (the RecordOptions
    ``deployment`` group); replay's flags of the same names override it."""
    from .deployment import ROUTING

    opts = [
        click.option("--prefill-instances", "prefill_instances", type=int, default=None,
                     help="The deployment the trace is meant for: this many prefill instances, each with the "
                          "recorded GPUs (with --decode-instances). Recorded in the trace's metadata; closed-loop "
                          "replay runs it by default. The recorded steps stay one colocated instance's."),
        click.option("--decode-instances", "decode_instances", type=int, default=None,
                     help="With --prefill-instances: this many decode instances."),
        click.option("--transfer", default=None,
                     help="With --prefill-instances: the hand-off path replay uses (rdma, rdma-pull, host, pool or "
                          "pool:SPEC, as replay --transfer; default rdma)."),
        click.option("--prefill-routing", type=click.Choice(ROUTING), default=None,
                     help="With --prefill-instances: the prefill side's router (default round-robin)."),
        click.option("--decode-routing", type=click.Choice(ROUTING), default=None,
                     help="With --prefill-instances: the decode side's router (default round-robin)."),
        click.option("--disagg-threshold", "disagg_threshold", type=int, default=None,
                     help="With --prefill-instances: conditional disaggregation below this many prompt tokens."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def engine_options(f):
    """Options of the serving-engine and GPU model, shared by `record` and `demo`."""
    from .engine import TIER_POLICIES
    from .engine.gpus import gpu_names

    opts = [
        click.option("--tier-policy", type=click.Choice(TIER_POLICIES), default="offload", show_default=True,
                     help="none: HBM prefix cache only; offload: write-through to the tier, load prefix hits back; "
                          "resident: KV lives in the tier, decode reads it there."),
        click.option("--gpu", type=click.Choice(gpu_names()), default="H100-SXM", show_default=True,
                     help="GPU preset of the compute-time model (datasheet figures; docs/engine.md). A100, A800, "
                          "H100, H800 and H200-SXM name the SXM parts."),
        click.option("--gpus", type=int, default=None,
                     help="GPUs of one serving instance, = --tp x --pp (default: smallest power of two holding the "
                          "weights in half its HBM). Alone it is split as vLLM advises: tensor parallel inside a "
                          "node of 8, pipeline stages across nodes. Data parallel: replay --instances."),
        click.option("--tp", type=int, default=None,
                     help="Tensor-parallel ranks: compute, weights and KV heads split over them, two all-reduces "
                          "per layer over the GPU's interconnect (default: from --gpus)."),
        click.option("--pp", type=int, default=None,
                     help="Pipeline stages (layers split over them, run one after the other per step; default: "
                          "--gpus / --tp)."),
        click.option("--ep", type=int, default=None,
                     help="Expert-parallel ranks of a MoE model, 1 or --tp: experts split over the tensor-parallel "
                          "ranks, all-to-all dispatch and combine per MoE layer (default: 1)."),
        click.option("--dp-attention", is_flag=True, default=False,
                     help="Attention data-parallel over the --tp ranks (SGLang --enable-dp-attention, TensorRT-LLM "
                          "enable_attention_dp): each rank holds the whole attention weights and its own requests' "
                          "KV (MLA's latent not replicated), MLP and MoE layers stay split; docs/engine.md."),
        click.option("--block-tokens", type=int, default=16, show_default=True, help="Tokens per KV block."),
        click.option("--max-batched-tokens", type=int, default=8192, show_default=True,
                     help="Token budget of one engine step (chunked prefill)."),
        click.option("--max-num-seqs", type=int, default=256, show_default=True, help="Requests in one batch."),
        click.option("--hbm-kv-gib", type=float, default=None,
                     help="HBM KV capacity in GiB (default: GPU memory x 0.9 minus weights)."),
        click.option("--tier-capacity-gib", type=float, default=None,
                     help="Tier capacity in GiB, LRU (default: unbounded)."),
        click.option("--kv-dtype", type=click.Choice(["bf16", "fp16", "fp8"]), default="bf16", show_default=True,
                     help="Dtype of the KV cache (bytes per cached value), independent of the weights."),
        click.option("--weight-dtype", type=click.Choice(["bf16", "fp16", "fp8"]), default="bf16", show_default=True,
                     help="Dtype of the weights; the GEMMs compute in it (fp8 at the GPU's FP8 tensor peak, W8A8; "
                          "on a GPU without FP8, A100/A800, fp8 weights compute at the bf16 peak)."),
        click.option("--mfu", type=float, default=None,
                     help="Achieved fraction of peak FLOP/s, prefill and decode steps alike (default: the --engine-era's "
                          "factors fitted to published measurements, one for prefill and one for decode; "
                          "docs/engine.md)."),
        click.option("--mbu", type=float, default=None,
                     help="Achieved fraction of HBM bandwidth, prefill and decode steps alike (default: fitted, "
                          "per phase)."),
        click.option("--step-overhead-us", type=float, default=None,
                     help="Fixed time per engine step, prefill and decode alike: scheduling, launches (default: "
                          "fitted, per phase; collectives are modelled apart)."),
        click.option("--engine-era", default="2025", show_default=True, metavar="ERA",
                     help="Engine era whose fitted roofline factors are used (docs/engine.md, 'Engine eras'): "
                          "2025, engines of 2025-26 (vLLM, SGLang, TensorRT-LLM with CUDA-graph decode); 2024, "
                          "those of 2023-24."),
        click.option("--compute", default="roofline", show_default=True, metavar="MODEL",
                     help="Compute-time model of a step: roofline (fitted to published measurements) or "
                          "aiconfigurator[:BACKEND[@VERSION]] (NVIDIA aiconfigurator-core's kernels measured on "
                          "real GPUs, BACKEND vllm, sglang or trtllm; pip install '.[aic]'; the roofline where "
                          "its database has no entry; docs/engine.md, 'Compute backends')."),
        click.option("--chunk-tokens", type=int, default=256, show_default=True,
                     help="Offload transfer unit in tokens, recorded in the trace (LMCache moves 256-token "
                          "chunks); a multiple of --block-tokens."),
        click.option("--kv-layout", type=click.Choice(["per-layer", "cross-layer"]), default="per-layer",
                     show_default=True,
                     help="Transfer layout recorded in the trace: one layer of a chunk per transfer, or a chunk's "
                          "blocks of every layer in one (vLLM's cross-layer offloading layout)."),
        click.option("--weights-in-tier", type=float, default=None, metavar="F",
                     help="Put a fraction F (0 to 1) of the weights in the tier: their HBM goes to KV, and every "
                          "step streams them over the GPU's host link, as vLLM's --cpu-offload-gb "
                          "(docs/engine.md, 'Weights in the tier')."),
        click.option("--cold-experts", type=float, default=None, metavar="C",
                     help="MoE presets (mixtral-8x7b, deepseek-v3): put round(C x experts) routed experts of every "
                          "MoE layer in the tier, fetched when a token routes to one (uniform top-k routing)."),
        click.option("--weight-stream", type=click.Choice(["serial", "overlap"]), default="serial",
                     show_default=True,
                     help="How streamed weights compose with compute: serial (each layer loads, then computes, as "
                          "vLLM's CPU offload) or overlap (the next layer's weights prefetched while one computes, "
                          "as FlexGen)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def realrun_options(f):
    """Options of the real-run sources of `record` (docs/sources.md)."""
    opts = [
        click.option("--run", type=click.Choice(["tiny"]), default=None,
                     help="Record a real run instead of the engine model: tiny = a numpy transformer with a paged, "
                          "prefix-sharing KV cache, timed step by step on this CPU."),
        click.option("--from-vllm-events", "vllm_events", type=click.Path(dir_okay=False), default=None,
                     help="Import a capture of vLLM KV cache events (tools/capture_vllm_events.py); needs --model."),
        click.option("--vllm-medium", default=None,
                     help="With --from-vllm-events: import the stores of this medium only (GPU, CPU, ...)."),
        click.option("--requests", type=int, default=8, show_default=True, help="--run tiny: requests."),
        click.option("--prompt-tokens", type=int, default=256, show_default=True, help="--run tiny: prompt tokens."),
        click.option("--output-tokens", type=int, default=32, show_default=True,
                     help="--run tiny: tokens generated per request."),
        click.option("--shared-prefix-tokens", type=int, default=128, show_default=True,
                     help="--run tiny: leading prompt tokens all requests share."),
        click.option("--layers", type=int, default=4, show_default=True, help="--run tiny: layers."),
        click.option("--hidden", type=int, default=256, show_default=True, help="--run tiny: hidden size."),
        click.option("--heads", type=int, default=8, show_default=True, help="--run tiny: query heads."),
        click.option("--kv-heads", type=int, default=2, show_default=True, help="--run tiny: KV heads."),
        click.option("--head-dim", type=int, default=32, show_default=True, help="--run tiny: head dimension."),
        click.option("--vocab", type=int, default=1024, show_default=True, help="--run tiny: vocabulary size."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


_TINY_OPTIONS = ("requests", "prompt_tokens", "output_tokens", "shared_prefix_tokens", "layers", "hidden", "heads",
                 "kv_heads", "head_dim", "vocab")
# engine options a real-run source uses; the others describe the engine model and are refused
_REALRUN_ENGINE_OPTIONS = {"tiny": ("block_tokens", "kv_dtype", "max_num_seqs"), "vllm": ("block_tokens", "kv_dtype")}


@cli.command(context_settings=CONTEXT)
@click.option("--workload", "workload_spec", default=None,
              help="mooncake:PATH, azure:PATH, semianalysis:PATH, bailian:PATH, dynamo:PATH, tair:PATH (each "
                   "with optional :block_tokens=N,scope=global|local,partial=0|1,time_unit=ns|us|ms|s,"
                   "context_cap=N,truncate=drop|head; docs/workloads.md), or synthetic:NAME[:key=val,...] "
                   "(chat, docqa, agent).")
@click.option("--model", default=None,
              help="Preset (llama3-8b, llama3-70b, llama3.1-405b, qwen2.5-72b, mixtral-8x7b, deepseek-v3; "
                   "with sliding, chunked or linear-attention layers: gpt-oss-120b, gemma-3-27b, qwen3-next-80b-a3b, "
                   "llama-4-scout, deepseek-v3.2) "
                   "or a HuggingFace config.json path (Llama, Mistral, Qwen2/3, Mixtral, Qwen MoE, DeepSeek-V2/V3; "
                   "layer_types, sliding_window, attention_chunk_size, linear_* and index_head_dim are read; "
                   "with --workload or --from-vllm-events).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Trace file to write (.parquet).")
@click.option("--max-requests", type=int, default=None, help="Keep the first N requests (after --window-ms).")
@click.option("--window-ms", callback=_range("--window-ms"), default=None,
              help="Keep requests arriving in START:END ms of the workload.")
@click.option("--hash-block-tokens", type=int, default=None,
              help="Tokens per workload hash block (Mooncake default 512, synthetic 256); the other formats' "
                   "defaults and block-rule options: docs/workloads.md.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of synthetic workloads and of --run tiny.")
@click.option("--time-scale", type=float, default=None,
              help="Multiply the workload's arrival times by this (2 = half the load); recorded in the trace.")
@click.option("--request-rate", type=float, default=None,
              help="Rescale the workload's arrivals to this mean rate, requests per second (as vllm bench serve "
                   "--request-rate).")
@realrun_options
@engine_options
@deployment_options
@force_option
@click.pass_context
def record(ctx, workload_spec, model, out, max_requests, window_ms, hash_block_tokens, seed, time_scale, request_rate,
           force, run, vllm_events, vllm_medium, **engine):
    """Record a KV access trace: a workload through the serving-engine model, or a real run.

    \b
    Examples:
      kvemu record --workload synthetic:chat --model llama3-8b --hbm-kv-gib 2 --out chat.parquet   # HBM for ~2 GiB of KV: prefixes come back from the tier
      kvemu record --workload mooncake:../shared/traces/mooncake_conversation_trace.jsonl \\
                   --model llama3-70b --out mooncake.parquet
      kvemu record --workload azure:code.csv --model qwen2.5-72b --max-requests 500 --out azure.parquet
      kvemu record --workload synthetic:chat --model llama3-8b --hbm-kv-gib 2 --prefill-instances 1 \\
                   --decode-instances 1 --out chat-pd.parquet   # a trace for 1 prefill + 1 decode instance
      kvemu record --run tiny --requests 8 --shared-prefix-tokens 128 --out tiny.parquet
      kvemu record --from-vllm-events events.msgpack --model llama3-8b --out vllm.parquet
      kvemu record --workload synthetic:chat --model mixtral-8x7b --gpus 1 --weight-dtype fp8 \\
                   --cold-experts 0.5 --out chat-cold.parquet
    """
    tiny = {k: engine.pop(k) for k in _TINY_OPTIONS}
    sources = [s for s, v in (("--workload", workload_spec), ("--run", run), ("--from-vllm-events", vllm_events)) if v]
    if len(sources) != 1:
        raise UserError("give one of --workload, --run tiny or --from-vllm-events"
                        + (f" (got {', '.join(sources)})" if sources else ""))

    def given(names):
        return [n for n in names if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT]

    def refuse(names, why):
        bad = given(names)
        if bad:
            raise UserError(f"{', '.join('--' + n.replace('_', '-') for n in bad)}: {why}")

    t0 = time.perf_counter()
    if workload_spec is not None:
        refuse(_TINY_OPTIONS, "only for --run tiny")
        refuse(["vllm_medium"], "only for --from-vllm-events")
        if model is None:
            raise UserError("--workload needs --model")
        from . import recording
        from .record_options import RecordOptions

        options = RecordOptions.from_flat(max_requests=max_requests, window_ms=window_ms,
                                          hash_block_tokens=hash_block_tokens, seed=seed, time_scale=time_scale,
                                          request_rate=request_rate, force=force, **engine)
        meta = recording.record(workload_spec, model, out, options)
    else:
        kind = "tiny" if run else "vllm"
        used = _REALRUN_ENGINE_OPTIONS[kind]
        what = "--run tiny" if run else "--from-vllm-events"
        refuse([n for n in engine if n not in used] + ["max_requests", "window_ms", "hash_block_tokens",
                                                       "time_scale", "request_rate"],
               f"not used by {what} (it records what ran, not the engine model)")
        if run:
            refuse(["model", "vllm_medium"], "not used by --run tiny (its geometry options make the model)")
            from .realrun import record_tiny

            meta = record_tiny(out, **tiny, tokens_per_block=engine["block_tokens"], kv_dtype=engine["kv_dtype"],
                               max_num_seqs=engine["max_num_seqs"], seed=seed, force=force)
        else:
            refuse(_TINY_OPTIONS, "only for --run tiny")
            if model is None:
                raise UserError("--from-vllm-events needs --model (the events carry no model geometry)")
            from .realrun import import_vllm_events

            meta = import_vllm_events(vllm_events, model, out, medium=vllm_medium, kv_dtype=engine["kv_dtype"],
                                      tokens_per_block=engine["block_tokens"] if given(["block_tokens"]) else None,
                                      force=force)
    eng = meta["engine"]
    _echo(f"wrote {out}: {meta['workload']['requests']} requests, {eng['steps']} steps, "
               f"{eng['entries']} batch entries in {time.perf_counter() - t0:.1f} s")
    _compute_notice(meta.get("compute"))
    _load_warning(meta.get("load"))


def _compute_notice(compute) -> None:
    """Say on stderr which steps a compute model other than the roofline priced, and why not all."""
    if not compute:
        return
    if compute.get("fallback"):
        _warn(f"{compute['fallback']}; every step uses the roofline")
        return
    steps = compute["steps"]
    if steps.get("roofline"):
        named = [(compute.get(key) or 0, what) for key, what in (
            ("dp_prefill_steps_roofline", "with a prefill chunk under --dp-attention"),
            ("mla_multi_chunk_steps_roofline", "of several MLA prefill chunks"))]
        rest = steps["roofline"] - sum(n for n, _ in named)
        why = [f"{n} {what}" for n, what in (*named, (rest, "outside its tables")) if n]
        _warn(f"aiconfigurator priced {steps['aiconfigurator']} steps, the roofline {steps['roofline']} "
              f"({', '.join(why)}; docs/engine.md, \"Compute backends\")")


def _load_warning(load) -> None:
    """Say so on stderr when a run's offered load exceeds what its GPUs serve."""
    from .analysis import load_line

    if load and load.get("overloaded"):
        _warn(load_line(load))


# ----------------------------------------------------------------------------------------- trace
@cli.group(cls=_Group, context_settings=CONTEXT)
def trace():
    """Inspect and check trace files."""


@trace.command("info", context_settings=CONTEXT)
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, default=False, help="Print JSON instead of a table.")
@click.option("--instances", type=int, default=8, show_default=True,
              help="Serving instances for the shared-vs-replicated tier capacity figure.")
def trace_info(trace_path, as_json, instances):
    """Summarise a trace: requests, steps, tokens, KV bytes per op, dedup and prefix-hit ratio.

    \b
    Example:
      kvemu trace info chat.parquet --json
    """
    from .analysis import compute_model, deployment_capacity, load_line, trace_load, trace_summary
    from .schema import read_trace

    tr = read_trace(trace_path)
    s = trace_summary(tr)
    dep = deployment_capacity(tr, instances)
    load = trace_load(tr)
    if as_json:
        _echo(jsontext.document({"trace": trace_path, "metadata": tr.header.meta, "summary": s,
                               "deployment": dep, "load": load, "compute_model": compute_model(tr.header.meta),
                               "checksums": tr.header.digest is not None},
                              indent=2))
        return
    from .units import human_bytes

    gpu_model = compute_model(tr.header.meta)
    rows = [
        ("model", f"{s['model']} ({tr.header.meta['model']['kv_dtype']}, {s['tokens_per_block']} tokens/block, "
                  f"{human_bytes(s['block_bytes_all_layers'])}/block)"),
        ("KV bytes per token", _bytes_per_token_text(s)),
        ("GPU step times", gpu_model["text"]),
        ("workload", f"{tr.header.meta['workload']['source']}"),
        ("tier policy", s["tier_policy"]),
        ("transfers", _transfer_shape(tr.header)),
        ("requests", f"{s['requests']:,}"),
        ("steps / entries", f"{s['steps']:,} / {s['entries']:,} ({s['prefill_entries']:,} prefill, "
                            f"{s['decode_entries']:,} decode)"),
        ("input / output tokens", f"{s['input_tokens']:,} / {s['output_tokens']:,}"),
        ("cached tokens", f"{s['cached_tokens']:,} ({s['cached_tokens'] / max(s['input_tokens'], 1):.1%} of input; "
                          f"{s['tier_hit_tokens']:,} from the tier"
                          + ("; an upper bound: one prefix cache for the data-parallel attention ranks, which "
                             "cache their own, docs/engine.md" if gpu_model["dp_attention"] else "") + ")"),
        ("KV stored / loaded / read", f"{human_bytes(s['kv_bytes_stored'])} / {human_bytes(s['kv_bytes_loaded'])} / "
                                      f"{human_bytes(s['kv_bytes_read'])}"),
        ("blocks referenced / unique", f"{s['referenced_blocks']:,} / {s['unique_blocks']:,} "
                                       f"(dedup ratio {s['dedup_ratio']:.2f})"),
        ("KV referenced / unique", f"{human_bytes(s['referenced_kv_bytes'])} / {human_bytes(s['unique_kv_bytes'])}"),
        (f"tier for {instances} instances", f"{human_bytes(dep['shared_bytes'])} shared pool / "
                                            f"{human_bytes(dep['replicated_bytes'])} replicated "
                                            f"(sharing saves {dep['sharing_saves']:.0%})"),
        ("block rule", _block_rule_text(s.get("block_rule"))),
        ("prefix_hit_ratio_unbounded", f"{s['prefix_hit_ratio_unbounded']:.4f}"
                                       + ("" if s.get("block_rule") is None else " (under the block rule; "
                                          f"{s['prefix_hit_ratio_engine_blocks']:.4f} over full "
                                          f"{s['tokens_per_block']}-token engine blocks)")),
        ("makespan (recorded timeline)", f"{s['modelled_makespan_s']:.1f} s"),
        ("offered load", "unknown (no arrivals or steps)" if load is None else
         ("OVERLOADED: " if load["overloaded"] else "below saturation: ") + load_line(load)),
        ("schedule", _schedule_text(tr.header.meta["schedule"])),
        ("deployment", _deployment_text(tr.header.meta)),
        ("file size", human_bytes(s["file_bytes"])),
        ("checksums", tr.header.checksums),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        _echo(f"{k:<{width}}  {one_line(v)}")


def _block_rule_text(rule: dict | None) -> str:
    """The block rule a trace's workload was read with (docs/workloads.md), or why there is none."""
    if rule is None:
        return "none recorded (the ratio below counts the trace's full engine blocks)"
    from .blockrule import rule_text

    return rule_text(rule)


def _bytes_per_token_text(s: dict) -> str:
    """KV bytes per token at the summary's context lengths, and the KV groups when not all full."""
    from .units import human_bytes

    at = ", ".join(f"{human_bytes(v)} at {int(L) // 1024}k" for L, v in s["kv_bytes_per_token_at"].items())
    groups = s["kv_groups"]
    if len(groups) == 1 and groups[0]["kind"] == "full":
        return f"{at} (full attention in every layer)"
    parts = [f"{g['layers']} {g['kind']}" + (f" {g['window']}" if g["window"] else "") for g in groups]
    return f"{at} ({', '.join(parts)})"


def _deployment_text(meta: dict) -> str:
    """The deployment the trace is meant for (metadata ``deployment``, record --prefill-instances)."""
    d = meta.get("deployment")
    if not d:
        return "colocated (none recorded: replay --prefill-instances gives one)"
    gpu = meta.get("gpu") or {}
    each = f" of {gpu['gpus']} x {gpu['name']}" if gpu.get("gpus") and gpu.get("name") else ""
    cond = f", prompts under {d['threshold_tokens']} tokens not disaggregated" if d.get("threshold_tokens") else ""
    return (f"{d['prefill_instances']} prefill + {d['decode_instances']} decode instances{each}, hand-off "
            f"over {d.get('transfer', 'rdma')}, routing {d.get('prefill_routing', 'round-robin')} / "
            f"{d.get('decode_routing', 'round-robin')}{cond}; replayed in closed loop by default "
            f"(the recorded steps are colocated; replay --colocated ignores it)")


def _schedule_text(sched: dict) -> str:
    if sched["closed_loop"]:
        return f"replanned by replay (closed loop, engine model {sched.get('engine_model')})"
    return f"replayed as recorded ({sched.get('why', sched.get('source'))})"


def _transfer_shape(header) -> str:
    from .replay import transfer_shape

    t = transfer_shape(header)
    recorded = t["chunk_tokens_from"] == "trace" and t["layout_from"] == "trace"
    return (f"{t['chunk_tokens']}-token chunks ({t['chunk_blocks']} blocks), {t['layout']}"
            f"{'' if recorded else ' (not recorded: replay defaults)'}")


@trace.command("validate", context_settings=CONTEXT)
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
def trace_validate(trace_path):
    """Check a trace completely (footer, requests, steps, every entry, its checksums); exit 0 if valid, 2 with the reason.

    \b
    Example:
      kvemu trace validate chat.parquet
    """
    from .schema import check_entries, read_trace

    tr = read_trace(trace_path)
    n = check_entries(tr)
    _echo(f"{trace_path}: valid kvemu trace v{tr.header.meta['version']} "
               f"({tr.n_requests} requests, {len(tr.step)} steps, {n} entries); checksums: {tr.header.checksums}")


@trace.command("upgrade", context_settings=CONTEXT)
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="The v2 trace to write.")
@force_option
def trace_upgrade(trace_path, out, force):
    """Rewrite a v1 trace as v2: the same rows, with the v2 metadata (the schedule object).

    kvemu reads v1 traces as they are; upgrading makes the file say what a v2 reader needs.

    \b
    Example:
      kvemu trace upgrade old.parquet --out old-v2.parquet
    """
    from .schema import upgrade_trace

    meta = upgrade_trace(trace_path, out, force=force)
    _echo(f"wrote {out}: v{meta['version']} trace (from v1 {trace_path}), schedule: "
               f"{_schedule_text(meta['schedule'])}")


# ---------------------------------------------------------------------------------------- replay
@cli.command(context_settings=CONTEXT)
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("--backend", "backend_spec", default=None,
              help=f"{spec_forms()}, each with options KEY=VALUE after a comma (docs/backends.md). "
                   "Needed unless --tiers is given.")
@click.option("--tiers", "tiers", default=None,
              help="A stack of tiers below HBM, top first (closed loop; docs/replay.md, \"A stack of tiers\"): "
                   "a .toml file of [[tier]] tables, or levels separated by ';', each BACKEND|cap=SIZE[,policy="
                   f"{'|'.join(policy_names(online=True))}]"
                   "[,link=LINK][,sharing=private|shared][,devices=N], private levels first, e.g. "
                   "\"dram|cap=64GiB;vemu:cxl-pool|cap=2TiB,sharing=shared;vemu:nvme|cap=8TiB,sharing=shared\"; a "
                   "segment without '|' sets the stack's options: "
                   f"'placement={'|'.join(PLACEMENTS)}[,promote=1][,selective_hits=N]' (default {DEFAULT_PLACEMENT}; "
                   "as analyze capacity --placement) "
                   "and, with --kv-load async, 'prefetch=wait_complete|timeout|best_effort[,prefetch_timeout_ms=MS]"
                   "[,prefetch_timeout_per_ki_token_ms=MS]' (SGLang HiCache's prefetch policies; default "
                   "wait_complete, 2000 ms + 100 ms per 1024 tokens).")
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Results file to write (.parquet).")
@click.option("--dataset", default=None, type=click.Path(file_okay=False),
              help="Instead of --out: add the run to a Hive-partitioned results dataset in this folder "
                   "(backend=/host=/run_id=), which kvemu report, DuckDB and pandas read whole.")
@click.option("--overlap", is_flag=True, default=False, help="Pipeline KV loads with compute layer by layer.")
@click.option("--link", type=click.Choice(["cpu", "pcie4-x16", "pcie5-x16", "nvlink-c2c", "cxl-x16", "rdma-200g"]),
              default="pcie5-x16", show_default=True,
              help="How the GPU reaches the tier: pcie4-x16, pcie5-x16, nvlink-c2c, cxl-x16, rdma-200g, or cpu (no link "
                   "limit: the CPU consumes KV); docs/tier-profiles.md.")
@click.option("--store-timing", "store_mode", type=click.Choice(["async", "serial"]), default="async",
              show_default=True,
              help="async: stores overlap later compute, as vLLM's and LMCache's offloading (stalling past "
                   "--store-inflight bytes in flight); serial: on each step's critical path.")
@click.option("--store-inflight", "store_inflight", callback=_size, default="2GiB", show_default=True,
              help="With async stores: bytes in flight before a step stalls.")
@click.option("--chunk-tokens", type=int, default=None,
              help="Transfer unit in tokens (default: the trace's, else 256).")
@click.option("--kv-layout", "layout", type=click.Choice(["per-layer", "cross-layer"]), default=None,
              help="Transfer layout (default: the trace's, else per-layer); cross-layer replays every layer.")
@click.option("--tier-capacity", "tier_capacity", callback=_size, default=None,
              help="Capacity of the tier (all layers), e.g. 64GiB: the arena holds that many chunks and reuses "
                   "the slots of what it evicts, LRU. Closed loop: the replayed engine's tier is bounded too, and a "
                   "prefix chunk it evicted is recomputed (a miss, not a load); recorded: the steps stay the "
                   "recording's, loads of evicted chunks are counted (tier.load_misses_blocks) and timed as loads. "
                   "Default: the trace's recorded tier capacity, else every chunk the replay touches, capped by "
                   "--max-memory.")
@click.option("--schedule", type=click.Choice(["closed", "recorded"]), default=None,
              help="closed: the engine model schedules again, each step from the state the tier's KV times "
                   "produced (default for traces kvemu's engine recorded, with --instances too); recorded: keep "
                   "the trace's steps and stretch the timeline (default for real-run traces); "
                   "docs/replay.md.")
@click.option("--kv-load", "kv_load", type=click.Choice(["in-step", "async"]), default="in-step", show_default=True,
              help="Closed loop: load a prefix from the tier inside the request's first prefill step (as "
                   "recorded), or asynchronously on a stream of its own while running requests go on (vLLM's "
                   "asynchronous KV loading); from a --tiers stack, each level's blocks on that level's own "
                   "stream, the stack's prefetch policy deciding how long a request waits for them.")
@click.option("--time-scale", type=float, default=None,
              help="Closed loop: multiply arrival times by this (2 = half the load).")
@click.option("--request-rate", type=float, default=None,
              help="Closed loop: rescale arrivals to this mean rate, requests per second (as vllm bench serve "
                   "--request-rate).")
@click.option("--requests", "request_range", callback=_range("--requests"), default=None,
              help="Replay requests START:END (ids), with their history: closed loop runs every earlier "
                   "request first; recorded, co-batched requests are replayed too.")
@click.option("--arrival-ms", "arrival_range", callback=_range("--arrival-ms"), default=None,
              help="Replay requests arriving in START:END ms.")
@click.option("--layers", "replay_layers", type=int, default=None,
              help="Replay this many evenly spaced layers; each stands for its share of the model's layers.")
@click.option("--warmup", "replay_warmup", type=float, default=0.0, show_default=True,
              help="Share of the requests, in arrival order, that warm the caches and are not counted (closed "
                   "loop; as analyze capacity --warmup).")
@click.option("--max-memory", callback=_size, default="4GiB", show_default=True,
              help="Largest tier arena: a tier that would need more (unbounded, or a --tier-capacity larger "
                   "than this) is replayed as one of this size, reusing the slots of what it evicts.")
@click.option("--instances", type=int, default=1, show_default=True,
              help="Serving instances (emulated GPUs) replaying together on one tier, one thread each, each with "
                   "its own scheduler in closed loop (requests routed by --routing); recorded: round-robin.")
@click.option("--sharing", type=click.Choice(["shared", "replicated"]), default="shared", show_default=True,
              help="With --instances: one tier arena holding each block once, or a copy per instance.")
@click.option("--routing", type=click.Choice(["round-robin", "least-loaded", "prefix-aware"]), default="round-robin",
              show_default=True,
              help="With --instances, closed loop: how arriving requests are sent to instances (prefix-aware: "
                   "where the request's prefix is held, weighed against the queue there, as Mooncake's conductor).")
@click.option("--prefill-instances", "prefill_instances", type=int, default=None,
              help="Closed loop, prefill/decode disaggregation: this many prefill instances (each with the trace's "
                   "GPUs and parallelism); with --decode-instances. Default: the trace's deployment (record "
                   "--prefill-instances), else colocated (docs/replay.md).")
@click.option("--decode-instances", "decode_instances", type=int, default=None,
              help="With --prefill-instances: this many decode instances.")
@click.option("--transfer", default=None,
              help="With --prefill-instances: how a prefilled request's KV reaches its decode instance: rdma (GPU "
                   "to GPU over the RDMA NIC, layer by layer), rdma-pull (after the prefill, as vLLM's "
                   "NixlConnector), host (staged through host DRAM); each also as rdma:PROFILE, a storage profile "
                   "whose transfer engine's software parts the hand-off pays, as the store does (default "
                   "mooncake-gdr: none); pool or pool:SPEC (stored into the replay's "
                   "tier layer by layer as the prefill computes, loaded from it once stored; SPEC must be the "
                   "backend), pool-serial or pool-serial:SPEC (the stores serial inside the prefill's steps). Default: the trace's deployment's, else rdma.")
@click.option("--prefill-routing", type=click.Choice(["round-robin", "least-loaded", "prefix-aware"]),
              default=None, help="With --prefill-instances: the prefill side's router (default: the trace's "
                                 "deployment's, else round-robin).")
@click.option("--decode-routing", type=click.Choice(["round-robin", "least-loaded", "prefix-aware"]),
              default=None, help="With --prefill-instances: the decode side's router (default: the trace's "
                                 "deployment's, else round-robin).")
@click.option("--decode-chunked-prefill", "decode_chunked_prefill", type=click.Choice(["on", "off"]), default="on",
              show_default=True,
              help="With --prefill-instances: off prefills each prompt the decode instances prefill in one step "
                   "(vLLM's enable_chunked_prefill=False there alone); on: the trace's engine, chunked.")
@click.option("--disagg-threshold", "disagg_threshold", type=int, default=None,
              help="With --prefill-instances: conditional disaggregation, a prompt of fewer tokens is prefilled on "
                   "its decode instance, with no hand-off (default: the trace's deployment's, else none).")
@click.option("--colocated", is_flag=True, default=False,
              help="Replay colocated (--instances instances doing both phases) a trace recorded with a deployment "
                   "(record --prefill-instances), which is otherwise replayed as that deployment.")
@click.option("--label", default=None, help="Name of this run in reports (default: backend/policy).")
@click.option("--repeat", type=int, default=1, show_default=True,
              help="Replay this many times (1-100), each from scratch: the results are the median repetition's, "
                   "with every repetition's figures, so that reports show the spread.")
@click.option("--tier-devices", "tier_devices", type=int, default=None,
              help="Devices of the emulated tier's profile the tier is made of (default: one per instance); a "
                   "shared tier has that many times its bandwidth. 1: one device for all instances.")
@click.option("--emulate-missing", is_flag=True, default=False,
              help="If the backend cannot run here, replay its emulated counterpart (numa -> emu:remote-numa, "
                   "mmap of /dev/dax -> emu:cxl-pool, uring -> emu:nvme); the results say so.")
@click.option("--prices", "prices_path", default=None, type=click.Path(dir_okay=False),
              help="Price table (TOML) for the results' cost section (default: the one kvemu ships, "
                   "kvemu/data/prices.toml).")
@click.option("--amortise-years", type=float, default=DEFAULT_AMORTISE_YEARS, show_default=True,
              help="Amortisation period of the tier's capacity in the cost section.")
@force_option
def replay(trace_path, backend_spec, tiers, out, dataset, overlap, link, store_mode, store_inflight, chunk_tokens,
           layout, tier_capacity, schedule, kv_load, time_scale, request_rate, request_range, arrival_range, replay_layers,
           replay_warmup, max_memory, instances, sharing, routing, prefill_instances, decode_instances, transfer, prefill_routing,
           decode_routing, decode_chunked_prefill, disagg_threshold, colocated, label, repeat, tier_devices, emulate_missing, prices_path,
           amortise_years, force):
    """Replay a trace on a tier backend and write per-request results.

    \b
    Examples:
      kvemu replay chat.parquet --backend dram --out chat-dram.parquet
      kvemu replay mooncake.parquet --backend dram --requests 0:40 --layers 2 --out mc-dram-40.parquet
      kvemu replay chat.parquet --backend emu:cxl-pool --out chat-cxl.parquet     # emulated tier
      kvemu replay chat.parquet --backend vemu:nvme --out chat-nvme-virtual.parquet
      kvemu replay chat.parquet --backend numa:1 --emulate-missing --out chat-numa.parquet
      kvemu replay chat.parquet --backend dram --instances 2 --sharing shared --out chat-pool.parquet
      kvemu replay chat.parquet --backend vemu:cxl-pool --instances 4 --routing prefix-aware --out chat-pa.parquet
      kvemu replay chat.parquet --backend vemu:cxl-pool --prefill-instances 2 --decode-instances 2 --transfer pool \
          --out chat-pd-pool.parquet
      kvemu replay chat-pd.parquet --backend vemu:cxl-pool --transfer pool --out chat-pd-rec.parquet  # its deployment, KV via the pool
      kvemu replay chat-pd.parquet --backend vemu:cxl-pool --colocated --out chat-pd-colo.parquet
    """
    from .backend_spec import BackendSpec
    from .progress import Progress
    from .replay import replay as run_replay
    from .replay.options import (CostOptions, DataPathOptions, DisaggOptions, InstanceOptions, OutputOptions,
                                 ReplayOptions, ScheduleOptions, StoreOptions, TierOptions, WindowOptions)

    from .replay.stack import parse_tiers

    stack = parse_tiers(tiers) if tiers is not None else None
    if backend_spec is None and stack is None:
        raise click.UsageError("give --backend B (one tier) or --tiers SPEC (a stack)")
    if backend_spec is None:
        backend_spec = stack.levels[0].backend
    options = ReplayOptions(
        schedule=ScheduleOptions(schedule=schedule, time_scale=time_scale, request_rate=request_rate, routing=routing,
                                 kv_load=kv_load),
        window=WindowOptions(requests=request_range, arrival_ms=arrival_range, layers=replay_layers,
                             warmup=replay_warmup),
        datapath=DataPathOptions(link=link, overlap=overlap, chunk_tokens=chunk_tokens, layout=layout),
        stores=StoreOptions(timing=store_mode, inflight_bytes=store_inflight),
        tier=TierOptions(capacity_bytes=tier_capacity, max_memory_bytes=max_memory, emulate_missing=emulate_missing,
                         devices=tier_devices, stack=stack),
        instances=InstanceOptions(count=instances, sharing=sharing),
        disagg=DisaggOptions(prefill_instances=prefill_instances, decode_instances=decode_instances, transfer=transfer,
                             prefill_routing=prefill_routing, decode_routing=decode_routing,
                             threshold_tokens=disagg_threshold, colocated=colocated,
                             decode_chunked_prefill=decode_chunked_prefill),
        cost=CostOptions(prices=prices_path, amortise_years=amortise_years),
        output=OutputOptions(label=label, force=force, repeat=repeat, dataset=dataset))
    replay_allocator()
    prog = Progress("replay", unit="steps" if schedule == "recorded" else "requests")
    meta = run_replay(trace_path, BackendSpec.parse(backend_spec), options, out=out, progress=prog, warn=_warn)
    prog.close()
    red = meta["params"]["reductions"]
    sched = meta["schedule"]
    _echo(f"wrote {meta['results_path']}: {red['selected_requests']} requests, {meta['steps']['count']} steps "
               f"({sched['ran']} schedule), "
               f"{len(red['layers']['replayed'])}/{red['layers']['of']} layers on {meta['backend']['spec']} "
               f"({meta['figures']['label']}, link {meta['datapath']['link']['name']}) in {meta['wall_s']:.1f} s "
               f"(arena pre-fault {meta['prefault_s']:.1f} s)")
    cost = meta.get("cost") or {}
    if cost.get("usd_per_million_output_tokens") is not None:
        from .prices import cost_line

        _echo(f"cost: {cost_line(cost)}; {cost['joules_per_request']:.0f} J per request, {cost['gpu_hours']:.4f} "
              f"GPU-hours ({cost['figures']})")


def _warn(message: str) -> None:
    _echo(f"warning: {message}", err=True)


# ------------------------------------------------------------------------------------- calibrate
@cli.command(context_settings=CONTEXT)
@click.option("--backend", "backend_spec", required=True,
              help=f"Backend spec to measure: {spec_forms(measured_only=True)}.")
@click.option("--buffer", "buffer_bytes", callback=_size, default="1GiB", show_default=True,
              help="Buffer (arena) to measure over; keep it far above the last-level cache.")
@click.option("--hops", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="Pointer-chase hops in all (memory tiers).")
@click.option("--name", default=None, help="Name of the profile written (default: measured-BACKEND; with --software "
              "measured-BACKEND-software).")
@click.option("--json", "as_json", is_flag=True, default=False, help="Print JSON instead of a table.")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Write the measured tier profile as TOML, for emu:PATH / vemu:PATH elsewhere.")
@click.option("--force-load", is_flag=True, default=False,
              help="Write --out even when other processes took a share of this host that moved the figures.")
@click.option("--software/--tier", "software", default=None,
              help="Fit the software path (a fixed cost per request, per object, per byte) and write it as a "
                   "profile's software parts, or measure the tier as fio does. Default: --software for a store "
                   "(mooncake, files:DIR: over loopback a store's times are its software), --tier otherwise.")
@click.option("--batches", default="1,4,16,64", show_default=True, metavar="N,N,...",
              help="--software: objects per batch (one request) of the grid; at least two, up to 256.")
@click.option("--sizes", default="4KiB,64KiB,256KiB,1MiB", show_default=True, metavar="SIZE,...",
              help="--software: object sizes of the grid; at least two, multiples of 512 bytes.")
@click.option("--reps", type=click.IntRange(min=2, max=1000), default=5, show_default=True,
              help="--software: timings of every grid point (the fit takes each point's median).")
@force_option
def calibrate(backend_spec, buffer_bytes, hops, name, as_json, out, force, force_load, software, batches, sizes,
              reps):
    """Measure a backend's latency and bandwidth (as Intel MLC / fio do) and make a tier profile of it,
    or fit a storage stack's software path into a profile's software parts (--software).

    Memory tiers: idle latency by pointer chasing a random cycle over the buffer, bandwidth with
    4 MiB block loads, stores and reads. Storage tiers (uring, mooncake): 4 KiB reads at queue depth 1 and
    32, bandwidth with 1 MiB reads. Each figure is the median of 5 rounds. emu:PROFILE measures
    what this host emulates of PROFILE; vemu:PROFILE is refused: in virtual time its figures are
    the profile's own model, with nothing to measure.

    --software (uring:PATH, mooncake, files:DIR): batches of reads over a grid of batch sizes and object
    sizes, fitted by least squares into a fixed cost per request, per object and per byte, with each
    cost's standard error and the fit's R^2 and residuals. The profile written names where and over
    what they were measured (measured_on, transport: tcp-loopback for Mooncake here; a host with RDMA
    NICs runs the same command). For uring:PATH on a file it also measures the file system's share:
    the same reads of a preallocated file in PATH's folder through the file system and with O_DIRECT.
    A replay takes the parts onto another profile's wire and medium with software_from
    (emu:PROFILE,software_from=FILE or vemu:...; docs/tier-profiles.md). Mooncake: --backend mooncake
    (mooncake:allow_exposed=1 where its client binds every interface) --out mooncake-here.toml.

    \b
    Examples:
      kvemu calibrate --backend dram
      kvemu calibrate --backend dram --buffer 256MiB --json
      kvemu calibrate --backend uring:/var/tmp/kv.bin --out nvme-here.toml   # a file on the disk to measure
      kvemu replay chat.parquet --backend emu:nvme-here.toml --out chat-nvme.parquet
      kvemu calibrate --backend uring:/var/tmp/kv.bin --software --out fs-here.toml   # software path fitted
      kvemu replay chat.parquet --backend vemu:nvme,software_from=fs-here.toml --out chat-fs.parquet
    """
    from .backend_spec import BackendSpec
    from .calibrate import calibrate as measure
    from .calibrate import calibrate_software, render_software_table, render_table, write_profile
    from .output import check_destination

    parsed = BackendSpec.parse(backend_spec)
    if software is None:
        software = parsed.kind.store is not None  # a store: its times over loopback are its software
    if out:
        # a profile file measured (emu:PATH.toml) or the tier's own file (uring:PATH, mmap:PATH)
        check_destination(out, force, inputs=parsed.files_read())
    if software:
        grid_batches = [_int_item(x, "--batches") for x in batches.split(",") if x.strip()]
        grid_sizes = [parse_size(x.strip(), "--sizes") for x in sizes.split(",") if x.strip()]
        result = calibrate_software(backend_spec, batches=grid_batches, sizes=grid_sizes, reps=reps, name=name,
                                    log=lambda m: _echo(f"calibrate: {m}", err=True))
        for w in result["warnings"]:
            _warn(w)
        if out:
            write_profile(result, out, force=force, force_load=force_load)
            _echo(f"wrote {out}", err=True)
        _echo(jsontext.document(result, indent=2) if as_json else render_software_table(result))
        return
    result = measure(backend_spec, buffer_bytes=buffer_bytes, hops=hops, name=name,
                     log=lambda m: _echo(f"calibrate: {m}", err=True))
    for w in result["warnings"]:
        _warn(w)
    if out:
        write_profile(result, out, force=force, force_load=force_load)
        _echo(f"wrote {out}", err=True)
    _echo(jsontext.document(result, indent=2) if as_json else render_table(result))


def _int_item(text: str, flag: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{flag}: {text.strip()!r} is not a whole number") from None


# ---------------------------------------------------------------------------------------- report
@cli.command(context_settings=CONTEXT)
@click.argument("results", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, default=False,
              help="JSON: the runs with vLLM benchmark key names, and each trace's sections.")
@click.option("--csv", "as_csv", is_flag=True, default=False, help="CSV, one row per run.")
@click.option("--baseline", default=None, help="Baseline run: label or index (default: fastest measured).")
@click.option("--slo", default=None, help="Goodput SLO: an MLPerf preset (e.g. llama2-70b) or ttft=MS,tpot=MS; "
              "goodput is also given for the TTFT and the TPOT objective apart (DistServe).")
@click.option("--html", "html_path", default=None, metavar="FILE", type=click.Path(dir_okay=False),
              help="Also write a self-contained HTML page (tables and plots) to FILE; "
                   f"plots need matplotlib: {PLOT_INSTALL_HINT} in the kvemu checkout.")
@click.option("--force", is_flag=True, default=False, help="Replace the --html file if it exists.")
@click.option("--trace", "traces", multiple=True, metavar="TRACE", type=click.Path(dir_okay=False),
              help="A trace the runs replayed, for its capacity section (repeatable); by default the "
                   "trace path recorded in the results is used when that file is unchanged.")
@click.option("--fallback", type=click.Choice(["beside", "virtual"]), default="beside", show_default=True,
              help="A run whose figures are an upper bound (host-bound, floor-limited) and whose virtual twin "
                   "(vemu: the same profile, same trace) is given: show the twin beside it, or in its place.")
@click.option("--rank", default=None, metavar="LABEL,...",
              help="Rank only these runs in the verdict (default: every run of a workload).")
def report(results, as_json, as_csv, baseline, slo, html_path, force, traces, fallback, rank):
    """Compare runs side by side: TTFT, TPOT, E2EL, KV GB/s, time breakdown, dedup; per trace, the
    break-even bandwidth of reuse vs recompute with each run's tier GB/s against it, and (with the
    trace) the LRU capacity curve with its modelled TTFT (docs/report.md).

    \b
    Examples:
      kvemu report runs/                  # every results file under runs/
      kvemu report chat-dram.parquet chat-cxl.parquet --json
      kvemu report runs/ --html report.html
      kvemu report chat-dram.parquet --trace moved/chat.parquet   # the trace, moved since the replay
    """
    from .report import build_report, render_csv, render_html, render_json, render_table

    if as_json and as_csv:
        raise UserError("--json and --csv are exclusive")
    if html_path:
        from .output import check_destination

        check_destination(html_path, force, inputs=[*results, *traces])
    rep = build_report(list(results), baseline=baseline, slo=slo, traces=traces, fallback=fallback,
                       rank=[label for label in rank.split(",") if label] if rank is not None else None)
    if as_json:
        _echo(render_json(rep))
    elif as_csv:
        _echo(render_csv(rep), nl=False)
    else:
        _echo(render_table(rep))
    if html_path:
        from .plots import INSTALL_HINT, unavailable_reason

        written = render_html(rep, html_path, force=force)
        missing = unavailable_reason()
        note = f" (no plots: {missing}; {INSTALL_HINT} in the kvemu checkout adds them)" if missing else ""
        _echo(f"wrote {written}{note}", err=True)


# ----------------------------------------------------------------------------------------- sweep
@cli.command(context_settings=CONTEXT)
@click.argument("spec", metavar="SPEC.toml", type=click.Path(dir_okay=False))
@click.option("--dry-run", is_flag=True, default=False, help="Print the expanded matrix (one line per cell) and its estimated cost.")
@click.option("--executor", default="local", show_default=True, metavar="local|dask://HOST:PORT",
              help="Run cells here one at a time, or on a Dask cluster by resources (docs/scale-out.md). "
                   "dask://HOST:PORT uses TLS when TLS files are given (or set in Dask's config), plain TCP "
                   "otherwise, which is refused for an address that is not loopback unless --insecure; "
                   "tls://HOST:PORT always uses TLS.")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Results dataset folder (backend=/host=/run_id=); finished cells in it are skipped.")
@click.option("--tls-ca-file", default=None, metavar="PEM",
              help="Dask over TLS: the cluster's CA certificate, which the scheduler's certificate must be signed "
                   "by [default: distributed.comm.tls.ca-file in Dask's config].")
@click.option("--tls-cert", default=None, metavar="PEM",
              help="Dask over TLS: this client's certificate, signed by a CA the scheduler trusts "
                   "[default: distributed.comm.tls.client.cert].")
@click.option("--tls-key", default=None, metavar="PEM",
              help="Dask over TLS: the key of --tls-cert, unless it is in that file "
                   "[default: distributed.comm.tls.client.key].")
@click.option("--insecure", is_flag=True, default=False,
              help="Allow plain TCP to a scheduler that is not on loopback: whoever can reach it can run code on "
                   "its workers and on this machine. Only on a network you trust.")
def sweep(spec, dry_run, executor, out, tls_ca_file, tls_cert, tls_key, insecure):
    """Replay a matrix of traces x backends x parameters into a results dataset, resumably.

    \b
    Examples:
      kvemu sweep examples/sweep.toml --dry-run
      kvemu sweep examples/sweep.toml --out runs/
      kvemu sweep examples/sweep.toml --out runs/ --executor dask://127.0.0.1:8786   # a scheduler on this host
      kvemu report runs/

    A scheduler elsewhere: --executor tls://HOST:PORT with --tls-ca-file, --tls-cert and --tls-key
    (Dask runs what it is sent: whoever reaches a plain scheduler runs code on its workers and here).
    """
    from .progress import Progress
    from .sweep import load_sweep, plan_lines, run_sweep

    replay_allocator()  # local cells replay in this process
    if dry_run:
        for line in plan_lines(load_sweep(spec), out):
            _echo(line)
        return
    if out is None:
        raise UserError("--out DIR is needed to run a sweep (or use --dry-run)")
    summary = run_sweep(spec, out, executor=executor, progress=Progress("sweep", unit="cells"),
                        log=lambda m: _echo(f"sweep: {m}", err=True),
                        tls={"ca_file": tls_ca_file, "cert": tls_cert, "key": tls_key}, insecure=insecure)
    _echo(f"{summary['ran']} cells run, {summary['already_done']} already done, "
               f"{len(summary['skipped'])} skipped, {len(summary['failed'])} failed; "
               + (f"results in {summary['out']}" if os.path.isdir(summary["out"]) else
                  f"nothing written ({summary['out']} was not kept: it would be empty)"))
    if summary["failed"]:
        raise UserError(f"{len(summary['failed'])} of {summary['cells']} cells failed (see above); "
                        "rerun to retry them")


# --------------------------------------------------------------------------------------- analyze
@cli.group(cls=_Group, context_settings=CONTEXT)
def analyze():
    """Capacity and break-even analyses of a trace."""


@analyze.command("capacity", context_settings=CONTEXT)
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("--load-gbps", type=float, default=20.0, show_default=True,
              help="Tier bandwidth for loading cached prefixes in the modelled TTFT.")
@click.option("--points", type=int, default=24, show_default=True, help="Capacities on the log-spaced grid.")
@click.option("--json", "as_json", is_flag=True, default=False, help="Print JSON instead of a table.")
@click.option("--stack", default=None, metavar="SPEC",
              help="Levels below HBM, top first: NAME=SIZE[:POLICY],... (NAME a built-in tier profile, e.g. "
                   "local-dram=1TiB,cxl-pool=4TiB:fifo) or a .toml file of [[tier]] tables (name, profile, "
                   "capacity, policy). Default: one level, local-dram at --load-gbps, over the capacity grid.")
@click.option("--policies", default=None, metavar="LIST",
              help="Policies to compare, each applied to every level without its own: "
                   f"{', '.join(policy_names())} (default with --stack or --sweep: lru; docs/analysis.md, "
                   "\"Policies\")" + (f"; {', '.join(policy_names(fast=False))} without a fast path: one Python "
                                      "call per reference, the slow path" if policy_names(fast=False) else "")
                   + ".")
@click.option("--sweep", default=None, metavar="LEVEL=SIZES",
              help="Vary one level's capacity (SIZES comma-separated, e.g. cxl-pool=0,1TiB,4TiB,16TiB), the "
                   "others fixed; without --stack, LEVEL is 'tier'.")
@click.option("--warmup", type=float, default=0.0, show_default=True,
              help="Share of the requests, in arrival order, that warm the levels and are not counted.")
@click.option("--placement", default=None, metavar="RULE",
              help=f"Where blocks are written, as replay --tiers placement=: {', '.join(PLACEMENTS)} (default: "
                   f"{DEFAULT_PLACEMENT} with --stack, {ONE_LEVEL_PLACEMENT} for the one level without it; "
                   "docs/analysis.md, \"Placement rules\"); optimal runs under inclusive only.")
@click.option("--promote/--no-promote", default=False, show_default=True,
              help="Copy a block served from a level below the top into the top level, as replay --tiers promote=1.")
@click.option("--selective-hits", type=int, default=None,
              help="write-through-selective: hits before a block is copied into the levels below (default 1), "
                   "as replay --tiers selective_hits=.")
@click.option("--prices", "prices_path", default=None, type=click.Path(dir_okay=False),
              help="Price table (TOML) for the cost figures (default: the one kvemu ships, kvemu/data/prices.toml); "
                   "given alone, the one-level curve is printed in the stack form, priced.")
@click.option("--amortise-years", type=float, default=3.0, show_default=True,
              help="Amortisation period of the levels' capacity in the cost figures.")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="With --sweep: also write the sweep as one self-contained HTML page, per policy the share "
                   "of prompt tokens each level serves and the cost against the swept capacity.")
@click.option("--force", is_flag=True, default=False, help="Replace an existing --html file.")
def analyze_capacity(trace_path, load_gbps, points, as_json, stack, policies, sweep, warmup, placement, promote,
                     selective_hits, prices_path, amortise_years, html_path, force):
    """Prefix-hit ratio and modelled TTFT as a function of tier capacity (LRU, exact stack distances),
    or, with --stack, --policies or --sweep, of a stack of levels: the share of prompt tokens each
    level serves per policy (see --policies), modelled TTFT, throughput and cost.

    \b
    Example:
      kvemu analyze capacity mooncake.parquet --load-gbps 25
      kvemu analyze capacity mooncake.parquet --policies fifo,lru,optimal
      kvemu analyze capacity mooncake.parquet --stack local-dram=512GiB,cxl-pool=0 \\
          --sweep cxl-pool=0,1TiB,2TiB,4TiB,8TiB,16TiB --policies lru,optimal --placement inclusive --html sweep.html
    """
    from .analysis import capacity_curve, capacity_ttft, prefix_hit_thresholds
    from .schema import read_trace
    from .units import human_bytes

    from .units import check_number

    check_number(load_gbps, "--load-gbps", 0.0, 1e5, lo_open=True)
    if not 2 <= points <= 10_000:
        raise UserError("--points must be from 2 to 10000")
    # --prices (or a non-default --amortise-years) alone: price the single-tier curve, as a stack of
    # that one level over the same grid (before, the price file was silently ignored)
    if html_path is not None and sweep is None:
        raise UserError("--html draws a sweep: give --sweep LEVEL=SIZES (and --stack)")
    stacked = (stack is not None or policies is not None or sweep is not None or prices_path is not None
               or amortise_years != 3.0 or placement is not None or promote or selective_hits is not None)
    if warmup != 0.0 and not stacked:
        # an option the curve does not use is refused, not ignored
        raise UserError("--warmup applies to a stack analysis (--stack, --policies, --sweep or --prices): the plain "
                        "capacity curve counts every request")
    if html_path is not None:
        from .output import check_destination

        # before any work: an existing page is kept without --force, the trace and price table always
        check_destination(html_path, force, inputs=[trace_path, *([prices_path] if prices_path else [])]
                          + ([stack] if stack and stack.endswith(".toml") else []))
    rules = _stack_rules(stack, placement, promote, selective_hits)
    if stacked:
        return _analyze_stack(trace_path, load_gbps, points, as_json, stack, policies, sweep, warmup,
                              prices_path, amortise_years, html_path, force, rules)
    tr = read_trace(trace_path)
    thresholds = prefix_hit_thresholds(tr)  # one stack-distance pass for the curve and the TTFTs
    curve = capacity_curve(tr, points=points, thresholds=thresholds)
    # a real-run trace has no GPU model to price prefills with: hit ratios only
    ttft = capacity_ttft(tr, curve, load_gbps, thresholds) if "gpu" in tr.header.meta else \
        [{"mean_ttft_ms": float("nan"), "median_ttft_ms": float("nan")} for _ in curve["capacity_blocks"]]
    if as_json:
        _echo(jsontext.document({**curve, "load_gbps": load_gbps, "ttft": ttft}, indent=2))
        return
    _echo(f"{'capacity':>12} {'tokens':>14} {'hit ratio':>10} {'of max':>7} {'mean TTFT ms':>13} "
               f"{'p50 TTFT ms':>12}")
    unb = curve["unbounded_hit_ratio"]
    for i, cap in enumerate(curve["capacity_blocks"]):
        r = curve["hit_ratio"][i]
        mark = "  <- 95% of max" if cap == curve["saturation_blocks"] else ""
        _echo(f"{human_bytes(curve['capacity_bytes'][i]):>12} {curve['capacity_tokens'][i]:>14,} {r:>10.4f} "
                   f"{(r / unb if unb else 0):>7.0%} {ttft[i]['mean_ttft_ms']:>13.1f} "
                   f"{ttft[i]['median_ttft_ms']:>12.1f}{mark}")
    if "gpu" in tr.header.meta:
        _echo(f"unbounded prefix-hit ratio {unb:.4f}; TTFT modelled for prefill alone (no queueing), "
                   f"cached prefixes loaded at {load_gbps:g} GB/s")
    else:
        _echo(f"unbounded prefix-hit ratio {unb:.4f}; no modelled TTFT (nan): the trace has no GPU compute "
                   f"model (a real run measures its compute)")


def _stack_rules(stack, placement, promote, selective_hits) -> dict:
    """`analyze capacity`'s placement options (kvemu.stackrules), checked before any work."""
    from .stackrules import check_placement, check_selective_hits

    if placement is None:
        placement = DEFAULT_PLACEMENT if stack is not None else ONE_LEVEL_PLACEMENT
    check_placement(placement, "--placement")
    hits = 1 if selective_hits is None else check_selective_hits(selective_hits, "--selective-hits")
    if selective_hits is not None and placement not in SELECTIVE:  # refused, not ignored (as --tiers)
        raise UserError(f"--selective-hits is for --placement {' or '.join(SELECTIVE)} (the hits before a block "
                        f"is copied below); this analysis's placement is {placement}")
    return {"placement": placement, "promote": bool(promote), "selective_hits": hits}


def _analyze_stack(trace_path, load_gbps, points, as_json, stack, policies, sweep, warmup, prices_path,
                   amortise_years, html_path=None, force=False, rules=None):
    """`analyze capacity` of a stack of levels (kvemu/capacity.py): parse, evaluate, print."""
    from .capacity import (StackAnalysis, default_level, measurement_rule, parse_policies, parse_stack,
                           parse_sweep)
    from .prices import check_amortise_years, load_prices
    from .schema import read_trace
    from .units import human_bytes

    pols = parse_policies(policies) if policies is not None else ("lru",)
    levels = parse_stack(stack) if stack is not None else [default_level(load_gbps, 0)]
    sweep_name, sweep_caps = parse_sweep(sweep, levels) if sweep is not None else (None, None)
    check_amortise_years(amortise_years)
    prices = load_prices(prices_path)
    tr = read_trace(trace_path)
    an = StackAnalysis(tr, warmup)
    if sweep_name is None and stack is None:  # the one level over the capacity grid
        sweep_name = "tier"
        sweep_caps = [b * an.block_bytes for b in an.grid(points)]
    grid = [None] if sweep_name is None else sweep_caps
    rows = []
    for cap in grid:
        lv = levels if cap is None else [type(v)(v.name, v.profile, cap, v.policy) if v.name == sweep_name else v
                                         for v in levels]
        for pol in pols:
            rows.append({"swept_capacity_bytes": cap, **an.evaluate(lv, pol, prices=prices,
                                                                     amortise_years=amortise_years, **rules)})
    rule = measurement_rule(an.warmup, an.first_counted, tr.n_requests)
    doc = {"trace": str(trace_path), "measurement_rule": rule, "policies": list(pols), **rules,
           "stack": [v.describe(v.policy or "(per run)") for v in levels],
           "sweep": None if sweep_name is None else {"level": sweep_name, "capacity_bytes": grid},
           "prices": prices.describe(), "amortise_years": amortise_years, "points": rows}
    if html_path is not None:
        from .report.html import render_capacity_sweep_html

        wrote = render_capacity_sweep_html(doc, html_path, force, inputs=[trace_path])
        click.echo(f"wrote {wrote}", err=True)
    if as_json:
        _echo(jsontext.document(doc, indent=2))
        return
    _echo(f"measurement: {rule}")
    _echo(f"placement: {rules['placement']} ({PLACEMENT_DOCS[rules['placement']]})"
          + (", promote" if rules["promote"] else "")
          + (f", selective_hits {rules['selective_hits']}" if rules["placement"] in SELECTIVE else ""))
    _echo("stack (top first, below the trace's own HBM prefix cache): " + ", ".join(
        f"{v.name} ({v.profile.name}, {v.profile.bandwidth_gbps:g} GB/s, "
        f"{'capacity swept' if v.name == sweep_name else human_bytes(v.capacity_bytes) + ' provisioned'}, "
        f"priced as {(prices.medium_of(v.profile.name) or v.profile).name})" for v in levels))
    names = [v.name for v in levels]
    head = (f"{'capacity' if sweep_name else '':>10} {'policy':>8} {'HBM':>6} "
            + " ".join(f"{n[:10]:>10}" for n in names)
            + f" {'recompute':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'out tok/s':>10}"
            f" {'GPU-h':>8} {'$/1M out':>9} {'capacity':>9} {'wear':>7} {'J/req':>9}")
    _echo(head)
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        cost = r.get("cost") or {}
        t = r["ttft_ms"] or {}
        d = r.get("tpot_ms") or {}
        cap = human_bytes(r["swept_capacity_bytes"]) if r["swept_capacity_bytes"] is not None else ""
        _echo(f"{cap:>10} {r['policy']:>8} {r['hbm_share']:>6.3f} "
              + " ".join(f"{lv['hit_share']:>10.3f}" for lv in r["levels"])
              + f" {r['recompute_share']:>9.3f} {fmt(t.get('p50'), '9.1f'):>9} {fmt(t.get('p99'), '9.1f'):>9} "
              f"{fmt(d.get('p50'), '9.2f'):>9} {fmt(d.get('p99'), '9.2f'):>9} "
              f"{fmt(r.get('throughput_output_tokens_per_s'), '10.1f'):>10} {fmt(cost.get('gpu_hours'), '8.3f'):>8} "
              f"{fmt(cost.get('usd_per_million_output_tokens'), '9.3f'):>9} "
              f"{fmt(cost.get('capacity_usd_per_million_output_tokens'), '9.3f'):>9} "
              f"{fmt(cost.get('wear_usd_per_million_output_tokens'), '7.3f'):>7} {fmt(cost.get('joules_per_request'), '9.1f'):>9}")
    _echo("shares: of the counted requests' prompt tokens, served by HBM, by each level (under the placement "
          "rule above), or recomputed; TTFT ms modelled for prefill alone (no "
          "queueing); TPOT ms the recorded step times scaled by the modelled GPU busy time; tok/s, GPU-hours and "
          "cost over the trace's modelled GPU busy time (docs/analysis.md); $/1M out = GPU + capacity (each "
          "level's provisioned capacity, amortised) + wear (a flash level's writes against its rated endurance), "
          "the last two also apart, in $ per million output tokens")
    notes = sorted({n for r in rows for n in (r.get("cost") or {}).get("notes", [])})
    _echo(f"prices: {prices.path} ({prices.title}, {prices.date}; sha256 {prices.digest[:12]}), capacity "
          f"amortised over {amortise_years:g} years" + "".join(f"; {n}" for n in notes))


def _breakeven_options(f):
    """`record`'s model and GPU options, defaulting to the trace's (and without one, to record's)."""
    from .engine.gpus import GPU_ALIASES, GPU_PRESETS

    opts = [
        click.option("--model", default=None, metavar="MODEL",
                     help="Model preset or config.json, as record --model (default: the trace's; needed without "
                          "a TRACE)."),
        click.option("--gpu", default=None, metavar="GPU",
                     help=f"GPU preset, as record --gpu: {', '.join(GPU_PRESETS)}, or {', '.join(GPU_ALIASES)} for "
                          f"the SXM parts (default: the trace's, else H100-SXM)."),
        click.option("--gpus", type=int, default=None,
                     help="GPUs recomputing the prefix together, = --tp x --pp as record (default: the trace's, "
                          "else as record: the smallest power of two holding the weights in half its HBM)."),
        click.option("--tp", type=int, default=None,
                     help="Tensor-parallel ranks, as record --tp: their all-reduces count in the recompute time "
                          "(default: the trace's, else from --gpus)."),
        click.option("--pp", type=int, default=None, help="Pipeline stages, as record --pp (default: the trace's)."),
        click.option("--ep", type=int, default=None,
                     help="Expert-parallel ranks of a MoE model, as record --ep (default: the trace's)."),
        click.option("--dp-attention/--no-dp-attention", default=None,
                     help="Attention data-parallel over the --tp ranks, as record --dp-attention (default: the "
                          "trace's, else off)."),
        click.option("--mfu", type=float, default=None,
                     help="Achieved fraction of peak FLOP/s, 0.001 to 1 (default: the trace's, else the fitted "
                          "prefill factor of the default engine era, 2025, docs/engine.md); 1 = the datasheet peak, "
                          "as the Mooncake paper assumes."),
        click.option("--weight-dtype", default=None, metavar="bf16|fp16|fp8",
                     help="Weight dtype; the GEMMs compute in it, as record (default: the trace's, else bf16)."),
        click.option("--kv-dtype", default=None, metavar="bf16|fp16|fp8",
                     help="KV cache dtype: the bytes a load moves (default: the trace's, else bf16)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _parallel_text(timing) -> str:
    """``tp 8 x pp 2, ep 8; `` for a timing that models parallelism (empty for older traces')."""
    if timing.tp <= 0:
        return ""
    return (f"tp {timing.tp}" + (f" x pp {timing.pp}" if timing.pp > 1 else "")
            + (f", ep {timing.ep}" if timing.ep > 1 else "")
            + (", dp attention" if timing.dp_attention else "") + "; ")


@analyze.command("breakeven", context_settings=CONTEXT)
@click.argument("trace_path", metavar="[TRACE", required=False, type=click.Path(dir_okay=False))
@click.argument("results", metavar="[RESULTS...]]", nargs=-1, type=click.Path())
@_breakeven_options
@click.option("--json", "as_json", is_flag=True, default=False, help="Print JSON instead of a table.")
def analyze_breakeven(trace_path, results, model, gpu, gpus, tp, pp, ep, dp_attention, mfu, weight_dtype, kv_dtype,
                      as_json):
    """Tier bandwidth at which loading a reused prefix beats recomputing it, per prefix length,
    for the trace's model and GPU, or for --model and --gpu without a trace (options given with a
    trace take the place of what it recorded); each results file's measured load GB/s (read GB/s
    for a run that loaded nothing) is placed against it. docs/analysis.md compares it with the
    Mooncake paper term by term.

    \b
    Examples:
      kvemu analyze breakeven mooncake.parquet mc-dram-40.parquet
      kvemu analyze breakeven --model llama3-70b --gpu A800-80GB --gpus 8 --mfu 1
    """
    from .analysis import breakeven_gbps, breakeven_timing
    from .report import build_report, tier_bandwidth
    from .schema import read_header
    from .units import human_bytes

    options = {k: v for k, v in (("model", model), ("gpu", gpu), ("gpus", gpus), ("tp", tp), ("pp", pp),
                                 ("ep", ep), ("dp_attention", dp_attention), ("mfu", mfu),
                                 ("weight_dtype", weight_dtype), ("kv_dtype", kv_dtype))
               if v is not None}
    h = read_header(trace_path) if trace_path is not None else None
    if h is not None and "gpu" not in h.meta:
        raise UserError(f"{trace_path}: has no GPU compute model (a real-run trace measures compute); "
                        f"break-even needs a trace recorded from a workload, or --model and --gpu without a trace")
    timing = breakeven_timing(h.meta if h is not None else None, **options)
    name = timing.model.name
    rows = breakeven_gbps(timing)
    runs = []
    if results:
        rep = build_report(list(results), recorded_traces=False)
        for g in rep.groups:
            for row in g.rows:
                run_model = row.run.meta["trace"]["model"].get("name")
                if run_model != name:
                    _echo(f"skipping {row.run.path}: replayed a {run_model} trace, not {name}", err=True)
                    continue
                gbps, op = tier_bandwidth(row.run)  # load GB/s, or read GB/s for a run without loads
                runs.append({"label": row.run.label, "load_gbps": gbps if op else None, "op": op})
    # a trace's recorded GPU figures as they are; the model priced, where options changed it
    gpu_dict = h.meta["gpu"] if h is not None and not options else timing.to_dict()
    if as_json:
        _echo(jsontext.document({"model": name, "gpu": gpu_dict, "breakeven": rows, "runs": runs, "trace": trace_path,
                          "options": options, "kv_dtype": timing.model.kv_dtype,
                          "kv_bytes_per_token": timing.model.kv_bytes_per_token}, indent=2))
        return
    within = "" if timing.model.uniform else " inside every window"
    _echo(f"{name} ({human_bytes(timing.model.kv_bytes_per_token)} of {timing.model.kv_dtype} KV per token{within}) on "
          f"{timing.gpus} x {timing.gpu.name} ({_parallel_text(timing)}{timing.compute} {timing.peak_tflops:g} "
          f"TFLOP/s each, mfu {timing.mfu:g}): loading a prefix beats recomputing it above")
    _echo(f"{'prefix tokens':>14} {'KV bytes':>10} {'recompute ms':>13} {'break-even GB/s':>16}"
          + "".join(f" {r['label'][:14]:>15}" for r in runs))
    for r in rows:
        verdict = "".join(f" {('-' if x['load_gbps'] is None else ('reuse wins' if x['load_gbps'] >= r['breakeven_gbps'] else 'recompute')):>15}"
                          for x in runs)
        _echo(f"{r['prefix_tokens']:>14,} {human_bytes(r['kv_bytes']):>10} {r['recompute_ms']:>13.1f} "
              f"{r['breakeven_gbps']:>16.2f}{verdict}")


# ------------------------------------------------------------------------------------------ demo
@cli.command(context_settings=CONTEXT)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for the demo's files (default: a new kvemu-demo-TIMESTAMP folder).")
def demo(out_dir):
    """Memory pool or storage? Record a built-in long-context chat workload, replay it 3 times each
    on host DRAM and this host's disk (measured) and on HBM only, a CXL pool, RDMA storage and NVMe
    (virtual time), then on tier stacks, then disaggregated on llama3-70b (2 prefill + 2 decode
    instances, over RDMA and through the pool, against 4 colocated; virtual time), and print the
    verdict and the hand-off's share of TTFT first, then the whole comparison.

    \b
    Example:
      kvemu demo --out kvdemo
    """
    from .demo import run_demo
    from .report import render_table

    replay_allocator()
    result = run_demo(out_dir)
    _echo(result.screen())
    _echo("\n" + render_table(result.report))
    _echo(f"\nfiles: {result.folder}\nHTML report: {result.html}")


def main():
    """The kvemu command, for callers that import this module first (the handlers then come after
    its imports; the console script and ``python -m kvemu.cli`` install them before)."""
    from .__main__ import main

    main()
