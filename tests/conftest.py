"""Shared fixtures: small workloads built by hand and traces recorded from them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kvemu.engine import EngineConfig, make_timing, record_trace
from kvemu.models import resolve_model
from kvemu.workloads import Workload

# Tests mirror the package in folders; a test may import another's helpers by module name
# (from test_report import ...), whichever file runs first or alone.
for _folder in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

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


@pytest.fixture(scope="session", autouse=True)
def _capacity_cache_home(tmp_path_factory):
    """The report's capacity cache (kvemu/report/curve_cache.py) in a folder of this session's, not
    the user's cache home; subprocesses inherit it."""
    import os

    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache-home"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="session", autouse=True)
def _dask_scratch(tmp_path_factory):
    """Dask workers' scratch space (and so a sweep cell's folder, kvemu/sweep.py) in this session's
    folder, not /tmp/dask-scratch-space: a worker a test kills cannot clean up after itself.
    Subprocesses inherit it."""
    import os

    before = os.environ.get("DASK_TEMPORARY_DIRECTORY")
    os.environ["DASK_TEMPORARY_DIRECTORY"] = str(tmp_path_factory.mktemp("dask-scratch"))
    if "dask" in sys.modules:
        sys.modules["dask"].config.refresh()
    yield
    if before is None:
        os.environ.pop("DASK_TEMPORARY_DIRECTORY", None)
    else:
        os.environ["DASK_TEMPORARY_DIRECTORY"] = before


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


# ------------------------------------------------------------------------------------- slow tests
#: Files whose every test is slow: the README's, docs/cli.md's and --help's examples, fuzz campaigns, C builds
#: under sanitizers, signals sent to real replays (marked here by name, so the files stay as they are).
SLOW_FILES = {"test_examples.py", "test_interrupt.py", "test_c_fuzz.py", "test_fuzz_trace.py", "test_c_build.py"}
#: Single slow tests (file::name, every parametrisation): end-to-end runs, Dask clusters, full traces,
#: property-based campaigns; seconds to minutes each (a full run's --durations, docs/performance.md, "The test suite").
SLOW_TESTS = {
    "test_demo.py::test_the_demo_first_screen_answers_the_question",
    "test_backend_mooncake.py::test_ctrl_c_mid_replay_stops_the_master_and_removes_its_folder",
    "test_sweep.py::test_local_sweep_writes_the_dataset_and_a_report",
    "test_sweep.py::test_resume_skips_done_cells_and_reruns_a_deleted_one",
    "test_sweep.py::test_a_half_written_file_is_not_a_finished_cell",
    "test_sweep.py::test_dask_places_cells_on_the_worker_with_the_resource",
    "test_sweep.py::test_dask_cell_needing_a_resource_no_worker_has_fails_clearly",
    "test_sweep.py::test_an_interrupted_sweep_keeps_finished_cells_and_leaves_no_work_folder",
    "test_engine.py::test_full_mooncake_conversation_trace",
    "test_analysis.py::test_mooncake_small_cache_reaches_well_under_half_of_unbounded",
    "test_workloads.py::test_any_mooncake_bytes_load_or_raise_workload_error",
    "test_workloads.py::test_any_azure_bytes_load_or_raise_workload_error",
    "test_engine_fit.py::test_script_prints_markdown",
    "test_engine_fit.py::test_defaults_are_the_fit_and_its_surrogate_is_the_library",
    "test_engine_fit.py::test_fit_recovers_known_factors",
    "test_tier_order.py::test_latency_moves_in_place_reads_and_bandwidth_moves_copies",
    "test_tier_order.py::test_virtual_time_ranks_the_built_in_tiers",
    "test_tier_order.py::test_measured_dram_keeps_up_with_a_cxl_pool_or_says_it_is_host_bound",
    "test_backend_emu.py::test_emu_and_chase_under_sanitizers",
    "test_figures.py::test_any_json_gives_a_well_formed_block",
    "test_backend_dram.py::test_any_input_replays_exactly_or_fails_cleanly",
    "test_corruption.py::test_single_bit_flips_in_a_trace_are_detected",
    "test_report_verdict.py::test_repetitions_give_every_figure_its_spread",
    "test_closed_loop.py::test_async_loads_do_not_stall_running_requests",
    "test_report_html.py::test_render_html_writes_once_and_replaces_only_with_force",
    "test_report_html.py::test_page_embeds_three_png_figures_per_trace",
    "test_report_html.py::test_figures_survive_awkward_data",
    "test_report_sections.py::test_html_has_the_section_tables_and_their_figures",
    "test_hostile.py::test_a_low_soft_descriptor_limit_is_raised_for_many_instances",
    "test_hostile.py::test_a_file_size_limit_on_the_spill_is_one_line",
    "test_hostile.py::test_running_out_of_file_descriptors_is_one_line",
    "test_hostile.py::test_out_of_memory_is_one_line_with_the_limit",
    "test_hostile.py::test_a_leftover_tier_file_says_which_file_to_remove",
    "test_figures.py::test_html_badges_every_kind_and_flag",
    "test_sweep.py::test_out_in_a_read_only_folder_is_one_line_output_error",
}


def pytest_collection_modifyitems(config, items):
    files = {}
    for item in items:
        files.setdefault(item.path.name, item.path)
        if item.path.name in SLOW_FILES or f"{item.path.name}::{getattr(item, 'originalname', item.name)}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    # a renamed test would leave the slow set without a word: refuse the run instead
    missing = [n for n in sorted(SLOW_TESTS) if n.split("::")[0] in files
               and f"def {n.split('::')[1]}(" not in files[n.split("::")[0]].read_text()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS names tests that do not exist: {', '.join(missing)}")
