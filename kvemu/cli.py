"""Command line: parse, call the library, print. Data goes to stdout, progress to stderr."""

from __future__ import annotations

if __name__ == "__main__":  # python -m kvemu.cli: run as python -m kvemu is (kvemu/__main__.py: signals
    import runpy              # held, then the handlers, before the imports below); this file is not imported

    runpy.run_module("kvemu", run_name="__main__")

import errno
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

from . import __version__, interrupt, jsontext
from .backend_spec import spec_forms
from .bounds import DEFAULT_TIER_EVICTION
from .blockrule import rule_text
from .engine.gpus import GPU_ALIASES, GPU_PRESETS
from .errors import ConfigError, KvemuError, OptionError, out_of_memory_message
from .interrupt import interrupted_message, run_command
from .output import check_destination
from .plots import INSTALL_HINT as PLOT_INSTALL_HINT, unavailable_reason
from .policies import policy_names
from .prices import check_amortise_years, cost_line, load_prices
from .record_options import FLAGS as RECORD_OPTION_FLAGS, OPTIONS as RECORD_OPTIONS
from .replay_options import FLAGS as REPLAY_OPTION_FLAGS, OPTIONS as REPLAY_OPTIONS
from .plan_options import CLI_OPTIONS as PLAN_OPTIONS
from .printable import one_line, safe_text, shorten_words
from .progress import Progress
from .schema import check_entries, read_header, read_trace, upgrade_trace
from .stackrules import DEFAULT_PLACEMENT, ONE_LEVEL_PLACEMENT, PLACEMENT_DOCS, PLACEMENTS, SELECTIVE
from .stackspec import parse_tiers
from .units import check_number, human_bytes, parse_range, parse_size

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
        code, message = interrupted_message(exc)
        super().__init__(one_line(message or ""))
        self.quiet = message is None
        self.exit_code = code

    def show(self, file=None) -> None:
        if not self.quiet:
            super().show(file)


#: The flag of each field of the Python API's options (errors.OptionError.field), so that a message
#: names what the user typed: ``replay.stores.timing`` -> ``--store-timing``.
RECORD_FLAGS: dict[str, str] = RECORD_OPTION_FLAGS
#: Made from the option table (kvemu/replay_options.py OPTIONS).
REPLAY_FLAGS: dict[str, str] = REPLAY_OPTION_FLAGS


def flag_message(command: str | None, e: OptionError) -> str:
    """An OptionError's message with the command line's flags in place of the fields' names."""
    flags = {"record": RECORD_FLAGS, "replay": REPLAY_FLAGS, "plan": RECORD_FLAGS}.get(command or "", {})
    return e.render(lambda name: flags.get(name, name))


def unusable_name_message(e: BaseException) -> str | None:
    """The line for a file name no file can have, wherever a library call met it first: longer
    than the file system takes (OSError ENAMETOOLONG) or through a loop of symbolic links (ELOOP,
    or the RuntimeError of ``Path.resolve``); None for any other error, which stays a bug to fix."""
    if isinstance(e, OSError) and e.errno in (errno.ENAMETOOLONG, errno.ELOOP) and e.filename:
        return f"{e.filename}: {e.strerror} (no file can have this name)"
    if type(e) is RuntimeError and str(e).startswith("Symlink loop from "):
        return f"{str(e)[len('Symlink loop from '):].strip(chr(39))}: a loop of symbolic links (no file can have this name)"
    return None


class _Group(click.Group):
    def invoke(self, ctx):
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


def _size_text(n: int) -> str:
    """A size as --help shows it: ``4GiB``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def table_option(o, dest: str):
    """The click option of one declared option (kvemu.option_table.Opt): its flag, help, type and
    default, as the parameter ``dest``."""
    default = o.default
    kw = {"help": o.help_text(), **({"metavar": o.metavar} if o.metavar else {})}
    if o.kind == "bool":
        return click.option(o.flag, dest, is_flag=True, default=bool(default), **kw)
    if o.kind == "choice":
        kw["type"] = click.Choice(list(o.choice_list()))
    elif o.kind in ("int", "float"):
        kw["type"] = {"int": int, "float": float}[o.kind]
    elif o.kind == "size":
        kw["callback"] = _flag_size(o.flag)
        default = None if default is None else _size_text(default)
    elif o.kind == "range":
        kw["callback"] = _range(o.flag)
    elif o.kind == "file":
        kw["type"] = click.Path(dir_okay=False)
    elif o.kind == "folder":
        kw["type"] = click.Path(file_okay=False)
    return click.option(o.flag, dest, default=default, show_default=default is not None, **kw)


def table_options(table, insert: dict | None = None, groups=None, dest=lambda o: o.key()):
    """The click options of every declared option with a flag in ``table``, in its order (those of
    ``groups`` alone if given), each as the parameter ``dest(opt)`` (replay: ``group__field``);
    ``insert`` puts a command's own option before a flag (``{"--dataset": out_option}``)."""
    insert = insert or {}

    def wrap(f):
        made = []
        for o in table:
            if o.flag is None or (groups is not None and o.group not in groups):
                continue
            if o.flag in insert:
                made.append(insert[o.flag])
            made.append(table_option(o, dest(o)))
        for option in reversed(made):
            f = option(f)
        return f

    return wrap


def _flag_size(flag: str):
    def convert(ctx, param, value):
        return None if value is None else parse_size(value, flag)

    return convert


def force_option(f):
    return click.option("--force", is_flag=True, default=False, help="Replace an existing output file.")(f)


# ---------------------------------------------------------------------------------------- record
def _record_options(*groups):
    """`record`'s declared options of ``groups`` (kvemu/record_options.py OPTIONS), each as the
    parameter of its flat name (``hbm_kv_gib``, RecordOptions.from_flat's)."""
    return table_options(RECORD_OPTIONS, groups=groups, dest=lambda o: o.sweep or o.field)


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
@_record_options("workload")
@realrun_options
@_record_options("engine", "gpu", "weights")
@_record_options("deployment")
@_record_options("output")
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
    if not compute or compute.get("model") == "roofline":
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

    gpu_model = compute_model(tr.header.meta)
    rows = [
        ("model", f"{s['model']} ({tr.header.meta['model']['kv_dtype']}, {s['tokens_per_block']} tokens/block, "
                  f"{human_bytes(s['block_bytes_all_layers'])}/block)"),
        ("KV bytes per token", _bytes_per_token_text(s)),
        ("GPU step times", gpu_model["text"]),
        ("workload", f"{tr.header.meta['workload']['source']}"),
        ("tier policy", s["tier_policy"]),
        ("tier eviction", _tier_eviction_text(tr.header.meta.get("engine", {}))),
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
        *_sessions_row(tr.header.meta.get("sessions")),
        ("deployment", _deployment_text(tr.header.meta)),
        ("file size", human_bytes(s["file_bytes"])),
        ("checksums", tr.header.checksums),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        _echo(f"{k:<{width}}  {one_line(v)}")


def _tier_eviction_text(eng: dict) -> str:
    """What the recorded engine's tier evicted, and over how many blocks (record --tier-eviction)."""
    policy = eng.get("tier_policy")
    if policy == "none":
        return "none (no tier)"
    name = eng.get("tier_eviction") or DEFAULT_TIER_EVICTION
    if "tier_eviction" not in eng:
        name += " (not recorded: the engine's default)"
    cap = eng.get("tier_capacity_blocks")
    if cap is None:
        return f"{name}; the tier is unbounded and evicts nothing"
    return f"{name}, over {cap:,} blocks{' (the resident pool)' if policy == 'resident' else ''}"


def _sessions_row(sessions: dict | None) -> list[tuple[str, str]]:
    """The trace's session graph in one row (docs/replay.md, "Sessions"); none without one."""
    if sessions is None:
        return []
    follow = sum(1 for p in sessions["parent"] if p >= 0)
    return [("sessions", f"{sessions['sessions']:,} sessions, {follow:,} follow-ups (turns up to "
                         f"{sessions['max_turn']}), gaps from {sessions['gap_from']}; closed loop releases a "
                         f"follow-up when its parent completes plus its gap (--arrivals session)")]


def _block_rule_text(rule: dict | None) -> str:
    """The block rule a trace's workload was read with (docs/workloads.md), or why there is none."""
    if rule is None:
        return "none recorded (the ratio below counts the trace's full engine blocks)"

    return rule_text(rule)


def _bytes_per_token_text(s: dict) -> str:
    """KV bytes per token at the summary's context lengths, and the KV groups when not all full."""
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
    tr = read_trace(trace_path)
    n = check_entries(tr)
    if isinstance(tr.header.meta.get("gpu"), dict):  # the engine model's trace: its compute model's parameters
        from .analysis import check_compute_meta

        check_compute_meta(tr.header.meta, trace_path)
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
    meta = upgrade_trace(trace_path, out, force=force)
    _echo(f"wrote {out}: v{meta['version']} trace (from v1 {trace_path}), schedule: "
               f"{_schedule_text(meta['schedule'])}")


# ---------------------------------------------------------------------------------------- replay
@cli.command(context_settings=CONTEXT)
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("--backend", "backend_spec", default=None,
              help=f"{spec_forms()}, each with options KEY=VALUE after a comma (docs/backends.md). "
                   "Needed unless --tiers is given.")
@table_options(REPLAY_OPTIONS, insert={"--dataset": click.option(
    "--out", default=None, type=click.Path(dir_okay=False), help="Results file to write (.parquet).")})
def replay(trace_path, backend_spec, out, **flags):
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
    from .replay import replay as run_replay
    from .replay_options import options_from

    tiers = flags.pop("tier__stack")
    stack = parse_tiers(tiers) if tiers is not None else None
    if backend_spec is None and stack is None:
        raise click.UsageError("give --backend B (one tier) or --tiers SPEC (a stack)")
    if backend_spec is None:
        backend_spec = stack.levels[0].backend
    options = options_from({**flags, "tier__stack": stack})
    schedule = options.schedule.schedule
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
    --out mooncake-here.toml, measured in a network namespace of its own (its client binds every interface;
    where no namespace can be made, mooncake:allow_exposed=1 accepts that). The output names the software
    generation measured and its software share of the KV time.

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
        render = render_software_table
    else:
        result = measure(backend_spec, buffer_bytes=buffer_bytes, hops=hops, name=name,
                         log=lambda m: _echo(f"calibrate: {m}", err=True))
        render = render_table
    for w in result["warnings"]:
        _warn(w)
    if out:
        write_profile(result, out, force=force, force_load=force_load)
        _echo(f"wrote {out}", err=True)
    _echo(jsontext.document(result, indent=2) if as_json else render(result))


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
@click.option("--no-cache", "no_cache", is_flag=True, default=False,
              help="Compute each trace's capacity curve afresh, neither reading nor writing the capacity cache "
                   "($XDG_CACHE_HOME/kvemu/capacity, else ~/.cache/kvemu/capacity; KVEMU_NO_CACHE=1 does the same).")
def report(results, as_json, as_csv, baseline, slo, html_path, force, traces, fallback, rank, no_cache):
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
        check_destination(html_path, force, inputs=[*results, *traces])

    progress = Progress("report: capacity curve" + ("" if no_cache else " (kept in the capacity cache for the "
                                                                      "next report)"), total=100, unit="%")
    rep = build_report(list(results), baseline=baseline, slo=slo, traces=traces, fallback=fallback,
                       rank=[label for label in rank.split(",") if label] if rank is not None else None,
                       cache=not no_cache, progress=progress)
    progress.close()
    if as_json:
        _echo(render_json(rep))
    elif as_csv:
        _echo(render_csv(rep), nl=False)
    else:
        _echo(render_table(rep))
    if html_path:
        written = render_html(rep, html_path, force=force)
        missing = unavailable_reason()
        note = f" (no plots: {missing}; {PLOT_INSTALL_HINT} in the kvemu checkout adds them)" if missing else ""
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
@click.option("--compression", is_flag=True, default=False,
              help="Take each medium's declared inline compression (price table [medium.NAME.compression], e.g. "
                   "CXL on Marvell Structera X/A, up to 3.64x): a level's capacity is the KV bytes it holds, its "
                   "devices and cost those bytes over the ratio (docs/analysis.md, \"Feasibility limits\").")
def analyze_capacity(trace_path, load_gbps, points, as_json, stack, policies, sweep, warmup, placement, promote,
                     selective_hits, prices_path, amortise_years, html_path, force, compression):
    """Prefix-hit ratio and modelled TTFT as a function of tier capacity (LRU, exact stack distances),
    or, with --stack, --policies or --sweep, of a stack of levels: the share of prompt tokens each
    level serves per policy (see --policies), modelled TTFT, throughput and cost. TTFT and TPOT are
    queued at the trace's offered load (the unloaded TTFT beside them), loads stall their steps and
    count as GPU time; the output states the tolerance checked against closed-loop replays
    (docs/analysis.md, "Queueing").

    \b
    Example:
      kvemu analyze capacity mooncake.parquet --load-gbps 25
      kvemu analyze capacity mooncake.parquet --policies fifo,lru,optimal
      kvemu analyze capacity mooncake.parquet --stack local-dram=512GiB,cxl-pool=0 \\
          --sweep cxl-pool=0,1TiB,2TiB,4TiB,8TiB,16TiB --policies lru,optimal --placement inclusive --html sweep.html
    """
    from .analysis import capacity_curve, capacity_ttft_parts, prefix_threshold_runs, ttft_from_parts
    from .capacity import QUEUE_CHECK, curve_queued_ttft

    check_number(load_gbps, "--load-gbps", 0.0, 1e5, lo_open=True)
    if not 2 <= points <= 10_000:
        raise UserError("--points must be from 2 to 10000")
    # --prices (or a non-default --amortise-years) alone: price the single-tier curve, as a stack of
    # that one level over the same grid (before, the price file was silently ignored)
    if html_path is not None and sweep is None:
        raise UserError("--html draws a sweep: give --sweep LEVEL=SIZES (and --stack)")
    stacked = (stack is not None or policies is not None or sweep is not None or prices_path is not None
               or amortise_years != 3.0 or placement is not None or promote or selective_hits is not None
               or compression)
    if warmup != 0.0 and not stacked:
        # an option the curve does not use is refused, not ignored
        raise UserError("--warmup applies to a stack analysis (--stack, --policies, --sweep or --prices): the plain "
                        "capacity curve counts every request")
    if html_path is not None:
        # before any work: an existing page is kept without --force, the trace and price table always
        check_destination(html_path, force, inputs=[trace_path, *([prices_path] if prices_path else [])]
                          + ([stack] if stack and stack.endswith(".toml") else []))
    rules = _stack_rules(stack, placement, promote, selective_hits)
    if stacked:
        return _analyze_stack(trace_path, load_gbps, points, as_json, stack, policies, sweep, warmup,
                              prices_path, amortise_years, html_path, force, rules, compression)
    tr = read_trace(trace_path)
    # one stack-distance pass, over the tables' runs, for the curve, the unbounded ratio and the TTFTs
    thresholds = prefix_threshold_runs(tr)
    curve = capacity_curve(tr, points=points, thresholds=thresholds)
    # a real-run trace has no GPU model to price prefills with: hit ratios only
    nan = float("nan")
    if "gpu" in tr.header.meta:
        memo = {}  # each (new, cached) pair's prefill time, for the grid's and the recorded pairs
        parts = capacity_ttft_parts(tr, curve, thresholds, prefill_memo=memo)
        ttft = ttft_from_parts(curve, *parts, load_gbps)  # each request's prefill and load alone
        for row, q in zip(ttft, curve_queued_ttft(tr, curve, *parts, load_gbps, prefill_memo=memo)):
            row.update({"queued_mean_ttft_ms": q["mean_ms"], "queued_p50_ttft_ms": q["p50_ms"],
                        "queued_p99_ttft_ms": q["p99_ms"], "gpu_busy_s": q["gpu_busy_s"]})
    else:
        ttft = [{"mean_ttft_ms": nan, "median_ttft_ms": nan, "queued_mean_ttft_ms": nan, "queued_p50_ttft_ms": nan,
                 "queued_p99_ttft_ms": nan} for _ in curve["capacity_blocks"]]
    if as_json:
        _echo(jsontext.document({**curve, "load_gbps": load_gbps, "ttft": ttft,
                                 "checked_against_replay": QUEUE_CHECK}, indent=2))
        return
    _echo(f"{'capacity':>12} {'tokens':>14} {'hit ratio':>10} {'of max':>7} {'mean TTFT ms':>13} "
               f"{'p50 TTFT ms':>12} {'queued p50':>11} {'queued p99':>11}")
    unb = curve["unbounded_hit_ratio"]
    for i, cap in enumerate(curve["capacity_blocks"]):
        r = curve["hit_ratio"][i]
        mark = "  <- 95% of max" if cap == curve["saturation_blocks"] else ""
        _echo(f"{human_bytes(curve['capacity_bytes'][i]):>12} {curve['capacity_tokens'][i]:>14,} {r:>10.4f} "
                   f"{(r / unb if unb else 0):>7.0%} {ttft[i]['mean_ttft_ms']:>13.1f} "
                   f"{ttft[i]['median_ttft_ms']:>12.1f} {ttft[i]['queued_p50_ttft_ms']:>11.1f} "
                   f"{ttft[i]['queued_p99_ttft_ms']:>11.1f}{mark}")
    if "gpu" in tr.header.meta:
        _echo(f"unbounded prefix-hit ratio {unb:.4f}; mean and p50 TTFT modelled for prefill alone (no queueing), "
              f"cached prefixes loaded at {load_gbps:g} GB/s; queued: with queueing at the trace's offered load "
              f"(docs/analysis.md, \"Queueing\")")
        _echo(f"checked against the closed loop (the stack form's model): {QUEUE_CHECK['text']}")
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
                   amortise_years, html_path=None, force=False, rules=None, compression=False):
    """`analyze capacity` of a stack of levels (kvemu/capacity.py): parse, evaluate, print."""
    from .capacity import (QUEUE_CHECK, QUEUE_MODEL, StackAnalysis, default_level, measurement_rule,
                           parse_policies, parse_stack, parse_sweep)
    from .feasibility import stack_feasibility

    pols = parse_policies(policies) if policies is not None else ("lru",)
    levels = parse_stack(stack) if stack is not None else [default_level(load_gbps, 0)]
    sweep_name, sweep_caps = parse_sweep(sweep, levels) if sweep is not None else (None, None)
    check_amortise_years(amortise_years)
    prices = load_prices(prices_path)
    if compression:
        prices = prices.with_compression()
        if not prices.compressed:
            raise UserError(f"--compression: no medium of {prices.path} declares inline compression "
                            f"([medium.NAME.compression])")
    tr = read_trace(trace_path)
    an = StackAnalysis(tr, warmup)
    gpus = int(((tr.header.meta or {}).get("gpu") or {}).get("gpus", 1))
    if sweep_name is None and stack is None:  # the one level over the capacity grid
        sweep_name = "tier"
        sweep_caps = [b * an.block_bytes for b in an.grid(points)]
    grid = [None] if sweep_name is None else sweep_caps
    rows = []
    for cap in grid:
        lv = levels if cap is None else [type(v)(v.name, v.profile, cap, v.policy) if v.name == sweep_name else v
                                         for v in levels]
        # whether the point can be built: per level, the devices and switch it implies (kvemu/feasibility.py)
        feas = stack_feasibility(prices, lv, instances=1, gpus_per_instance=gpus, compression=compression)
        for pol in pols:
            rows.append({"swept_capacity_bytes": cap, **an.evaluate(lv, pol, prices=prices,
                                                                     amortise_years=amortise_years, **rules),
                         "feasibility": feas, "buildable": all(f["ok"] for f in feas)})
    rule = measurement_rule(an.warmup, an.first_counted, tr.n_requests)
    doc = {"trace": str(trace_path), "measurement_rule": rule, "policies": list(pols), **rules,
           "stack": [v.describe(v.policy or "(per run)") for v in levels],
           "sweep": None if sweep_name is None else {"level": sweep_name, "capacity_bytes": grid},
           "prices": prices.describe(), "amortise_years": amortise_years, "compression": bool(compression),
           "queue_model": QUEUE_MODEL, "checked_against_replay": QUEUE_CHECK, "points": rows}
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
            + f" {'recompute':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'unloaded':>9} {'TPOT p50':>9} {'TPOT p99':>9}"
            f" {'out tok/s':>10}"
            f" {'GPU-h':>8} {'$/1M out':>9} {'capacity':>9} {'wear':>7} {'J/req':>9}  build")
    _echo(head)
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        cost = r.get("cost") or {}
        t = r["ttft_ms"] or {}
        u = r.get("ttft_unloaded_ms") or {}
        d = r.get("tpot_ms") or {}
        cap = human_bytes(r["swept_capacity_bytes"]) if r["swept_capacity_bytes"] is not None else ""
        _echo(f"{cap:>10} {r['policy']:>8} {r['hbm_share']:>6.3f} "
              + " ".join(f"{lv['hit_share']:>10.3f}" for lv in r["levels"])
              + f" {r['recompute_share']:>9.3f} {fmt(t.get('p50'), '9.1f'):>9} {fmt(t.get('p99'), '9.1f'):>9} "
              f"{fmt(u.get('p50'), '9.1f'):>9} "
              f"{fmt(d.get('p50'), '9.2f'):>9} {fmt(d.get('p99'), '9.2f'):>9} "
              f"{fmt(r.get('throughput_output_tokens_per_s'), '10.1f'):>10} {fmt(cost.get('gpu_hours'), '8.3f'):>8} "
              f"{fmt(cost.get('usd_per_million_output_tokens'), '9.3f'):>9} "
              f"{fmt(cost.get('capacity_usd_per_million_output_tokens'), '9.3f'):>9} "
              f"{fmt(cost.get('wear_usd_per_million_output_tokens'), '7.3f'):>7} {fmt(cost.get('joules_per_request'), '9.1f'):>9}"
              f"  {'; '.join(f['level'] + ' ' + f['short'] for f in r['feasibility'] if f['capacity_bytes'])}")
    _echo("shares: of the counted requests' prompt tokens, served by HBM, by each level (under the placement "
          "rule above), or recomputed; TTFT ms modelled with queueing at the trace's offered load ("
          f"{QUEUE_MODEL}; docs/analysis.md, \"Queueing\"), unloaded the p50 of each request's prefill and loads "
          "alone; TPOT ms each request's on the recorded engine timeline scaled by the modelled GPU busy time; tok/s "
          "over the modelled GPU busy time, the levels' loads included (they stall their step); GPU-hours and cost "
          "over the span the GPUs are held, first arrival to last modelled completion, at least the busy time "
          "(prices.priced_duration_s, as a replay's); "
          "$/1M out = GPU + capacity (each "
          "level's provisioned capacity, amortised) + wear (a flash level's writes against its rated endurance), "
          "the last two also apart, in $ per million output tokens")
    seen = []  # each distinct level build once, in sweep order
    for r in rows:
        for f in r["feasibility"]:
            line = f"{f['level']} {human_bytes(f['capacity_bytes'])}: {f['reason']}"
            if f["capacity_bytes"] and line not in seen:
                seen.append(line)
    _echo(f"build (one instance of {gpus} GPU(s); devices and switches from the price table's limits, "
          f"docs/analysis.md \"Feasibility limits\"" + (", inline compression taken" if compression else "") + "):")
    for line in seen:
        _echo(f"  {line}")
    if any(r.get("queue_model") for r in rows):
        _echo(f"checked against the closed loop: {QUEUE_CHECK['text']}")
    notes = sorted({n for r in rows for n in (r.get("cost") or {}).get("notes", [])})
    _echo(f"prices: {prices.path} ({prices.title}, {prices.date}; sha256 {prices.digest[:12]}), capacity "
          f"amortised over {amortise_years:g} years" + "".join(f"; {n}" for n in notes))


def _breakeven_options(f):
    """`record`'s model and GPU options, defaulting to the trace's (and without one, to record's)."""
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
    from .analysis import breakeven_gbps, breakeven_timing, gpu_figures
    from .report import build_report, tier_bandwidth

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
    gpu_dict = gpu_figures(h.meta) if h is not None and not options else timing.to_dict()
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


# ------------------------------------------------------------------------------------------ plan
#: `kvemu record`'s option groups `kvemu plan` records with (--workload, --model): a colocated trace
#: (a stack is not replayed disaggregated), written where the plan puts it.
PLAN_RECORD_GROUPS = ("workload", "engine", "gpu", "weights")


@cli.command("plan", context_settings=CONTEXT)
@click.argument("trace_path", metavar="[TRACE]", required=False, type=click.Path(dir_okay=False))
@click.option("--slo", required=True, metavar="TARGETS",
              help="Latency targets, METRIC_pPCT=DURATION,... (METRIC ttft or tpot, PCT 50, 90 or 99), e.g. "
                   "ttft_p90=2s,tpot_p50=50ms; and/or a goodput target, the share of requests meeting per-request "
                   "bounds, e.g. 'ttft<=2s,tpot<=50ms,goodput>=90%' (DistServe's SLO attainment).")
@click.option("--level", "levels", multiple=True, required=True, metavar="PROFILE=SIZES",
              help="A candidate level below HBM, top first (repeatable): a built-in tier profile and the capacities "
                   "to try, 0 leaving it out, e.g. --level local-dram=0,256GiB --level cxl-pool=0,1TiB,2TiB.")
@table_options(PLAN_OPTIONS, dest=lambda o: o.field)
@click.option("--json", "as_json", is_flag=True, default=False, help="Print JSON instead of text.")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="Also write a page plotting the frontier and the per-level shares.")
@click.option("--force", is_flag=True, default=False, help="Replace an existing --html file.")
@click.option("--workload", "workload_spec", default=None,
              help="Instead of a TRACE: record this workload first (as kvemu record --workload, with the record "
                   "options below), into a temporary trace the plan removes.")
@click.option("--model", default=None, help="With --workload: the model (as kvemu record --model).")
@_record_options(*PLAN_RECORD_GROUPS)
@click.pass_context
def plan_command(ctx, trace_path, slo, levels, as_json, html_path, force, workload_spec, model, **options):
    """The cheapest stack of levels below HBM that meets a latency target: search a grid with the
    stack analysis, keep the Pareto frontier of $ per million output tokens against the SLO, replay
    its cheapest points in the closed loop in virtual time (docs/analysis.md, "Planner").

    \b
    Example:
      kvemu plan traces/chat-llama3-8b-offload.parquet --slo ttft_p90=100ms \\
          --level local-dram=0,1GiB --level cxl-pool=0,2GiB,4GiB --level nvme=0,16GiB --policies lru,s3fifo
    """
    from .plan import RecordInput, parse_level, parse_slo, plan, render_html, render_text
    from .plan_options import OPTIONS as PLAN_TABLE, options_from_flags
    from .progress import Progress

    mine = {o.field for o in PLAN_TABLE}
    rec = {k: v for k, v in options.items() if k not in mine}
    given = [f"--{k.replace('_', '-')}" for k in rec
             if ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT]
    if trace_path is not None and (workload_spec is not None or model is not None):
        raise UserError("give a TRACE or --workload with --model to record one, not both")
    if trace_path is None:
        if workload_spec is None or model is None:
            raise UserError("give a TRACE, or --workload and --model to record one first")
        from .record_options import RecordOptions

        source = RecordInput(workload_spec, model, RecordOptions.from_flat(**rec))
    else:
        if given:
            raise UserError(f"{', '.join(given)}: record options, for --workload and --model (a TRACE is recorded "
                            f"already)")
        source = trace_path
    targets = parse_slo(slo)
    choices = [parse_level(x) for x in levels]
    opts = options_from_flags({k: v for k, v in options.items() if k in mine})
    prices_path = opts.prices_path
    inputs = [p for p in (trace_path, prices_path) if p]
    if html_path is not None:
        from .output import check_destination

        check_destination(html_path, force, inputs=inputs)
    prog = Progress("plan: analysing candidates", unit="candidates")
    doc = plan(source, targets, choices, opts, progress=prog, log=lambda m: _echo(f"plan: {m}", err=True))
    prog.close()
    if html_path is not None:
        wrote = render_html(doc, html_path, force, inputs=inputs)
        _echo(f"wrote {wrote}", err=True)
    _echo(jsontext.document(doc, indent=2) if as_json else render_text(doc))


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
    if result.plan is not None:  # the demo ends with the plan
        _echo("\n" + "\n".join(result.plan_lines()))


def main():
    """The kvemu command, for callers that import this module first (the handlers then come after
    its imports; the console script and ``python -m kvemu.cli`` install them before). A Mooncake
    replay's private network namespace (kvemu.isolation) is tried here too: with this module's
    threads it cannot be made, and the store's refusal says so."""
    import sys

    from .isolation import enter_for_command

    enter_for_command(sys.argv[1:])
    run_command(lambda: cli)
