"""Synthetic workloads, allocation strategies, the replay, internal waste and sharing."""

import json

import numpy as np
import pytest

from paged_attention_ext.tools.cli import main
from paged_attention_ext.tools.simulator import (STRATEGIES, beam_search_savings, internal_waste,
                                           make_strategy, parallel_sampling_savings, replay)
from paged_attention_ext.tools.workloads import (WORKLOADS, Request, clipped_lognormal_mean,
                                           fit_lognormal_mu, load_trace, save_trace, synthetic_trace)


@pytest.fixture(scope="module")
def traces():
    return {name: synthetic_trace(name, 300, seed=0) for name in WORKLOADS}


# ---- workloads ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_synthetic_means_match_the_paper_and_respect_max_len(name):
    trace = synthetic_trace(name, 20000, seed=1)
    model = WORKLOADS[name]
    assert np.mean([r.prompt_len for r in trace]) == pytest.approx(model.prompt_mean, rel=0.03)
    assert np.mean([r.output_len for r in trace]) == pytest.approx(model.output_mean, rel=0.03)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.prompt_len + r.output_len <= 2048
               for r in trace)


def test_seed_reproduces_the_trace():
    assert synthetic_trace("sharegpt", 50, seed=3) == synthetic_trace("sharegpt", 50, seed=3)
    assert synthetic_trace("sharegpt", 50, seed=3) != synthetic_trace("sharegpt", 50, seed=4)


def test_fitted_mu_gives_the_clipped_mean():
    mu = fit_lognormal_mu(338.0, 1.0, 1, 2048)
    assert clipped_lognormal_mean(mu, 1.0, 1, 2048) == pytest.approx(338.0, rel=1e-9)
    assert mu > np.log(338.0) - 0.5  # clipping the tail off needs a larger mu


def test_trace_file_round_trip(tmp_path):
    trace = synthetic_trace("alpaca", 20, seed=0)
    save_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace
    (tmp_path / "bad.jsonl").write_text('{"prompt_len": 3, "output_len": 2}\n{"prompt_len": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(tmp_path / "bad.jsonl")


# ---- strategies ----------------------------------------------------------------------------

def test_paged_waste_stays_below_one_block_while_growing():
    paged = make_strategy("paged", pool_tokens=1024, block_size=16)
    assert paged.admit(0, 5, final_len=200)
    for length in range(6, 201):
        assert paged.grow(0, length)
        assert 0 <= paged.held(0) - length < 16
    assert paged.reserved == 208


def test_full_pool_refuses_without_change():
    paged = make_strategy("paged", pool_tokens=64, block_size=16)
    assert paged.admit(0, 64, 65)
    assert not paged.grow(0, 65) and paged.held(0) == 64
    assert not paged.admit(1, 1, 2)
    pow2 = make_strategy("pow2", pool_tokens=90, max_len=64)
    assert pow2.admit(0, 5, 40) and pow2.held(0) == 8
    assert pow2.grow(0, 9) and pow2.held(0) == 16
    assert pow2.admit(1, 40, 40) and pow2.held(1) == 64
    assert not pow2.grow(0, 17) and pow2.reserved == 80


# ---- replay ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_replay_utilisation_per_strategy(traces, name):
    # A pool small enough that requests wait under every strategy.
    stats = {s: replay(traces[name], make_strategy(s, pool_tokens=8192)) for s in STRATEGIES}
    # The oracle reserves exactly the final length: full when each request finishes.
    assert stats["oracle"].mean_waste_at_finish == 0 == stats["oracle"].max_waste_at_finish
    assert stats["paged"].max_waste_at_finish < 16
    assert stats["max_len"].utilisation < 0.4
    assert stats["max_len"].mean_batch == 8192 // 2048
    for other in ("max_len", "pow2", "oracle"):
        assert stats["paged"].utilisation > stats[other].utilisation
        assert stats["paged"].mean_batch > stats[other].mean_batch
    floor = {"sharegpt": 0.96, "alpaca": 0.88}[name]  # Alpaca's ~80-token sequences: see docs
    assert stats["paged"].utilisation > floor


def test_replay_preempts_and_releases_everything(traces):
    paged = make_strategy("paged", pool_tokens=2048, block_size=16)
    stats = replay(traces["sharegpt"][:60], paged)
    assert stats.preemptions > 0 and stats.peak_reserved <= 2048
    assert paged.reserved == 0 and not paged.tables


def test_replay_rejects_a_request_larger_than_the_pool():
    with pytest.raises(ValueError, match="does not fit"):
        replay([Request(100, 10)], make_strategy("paged", pool_tokens=64))


# ---- internal waste ----------------------------------------------------------------------------

BLOCK_SIZES = [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 64, 100, 128, 255, 256]


def test_mean_internal_waste_is_half_a_block():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 1025, size=400)
    trace = [Request(int(n) // 2, int(n) - int(n) // 2) for n in lengths]
    for bs in BLOCK_SIZES:
        stats = internal_waste(trace, bs)
        assert stats.max_waste < bs
        assert abs(stats.mean_waste - (bs - 1) / 2) <= 0.06 * bs + 0.5, bs
        assert stats.mean_table_len == pytest.approx(np.mean(-(-lengths // bs)))


# ---- sharing -------------------------------------------------------------------------------------

def test_parallel_sampling_shares_full_prompt_blocks_and_copies_the_last():
    # Prompt 40 = 2 full blocks + 8 tokens; each sample copies the partial block on write.
    # Steps 1-8: 3 blocks per sample, 4 distinct; steps 9-10: 4 per sample, 6 distinct.
    stats = parallel_sampling_savings([Request(40, 10)], num_samples=2, block_size=16)
    assert (stats.block_refs, stats.blocks_used) == (8 * 6 + 2 * 8, 8 * 4 + 2 * 6)
    assert stats.saved_fraction == pytest.approx(20 / 64)


def test_sharing_savings_grow_with_width(traces):
    trace = traces["sharegpt"][:40]
    assert parallel_sampling_savings(trace, 1, 16).saved_fraction == 0
    parallel = [parallel_sampling_savings(trace, n, 16).saved_fraction for n in (2, 3, 4)]
    beam = [beam_search_savings(trace, n, 16, switch_prob=0.1).saved_fraction for n in (2, 3, 4)]
    assert 0 < parallel[0] < parallel[1] < parallel[2]
    assert 0 < beam[0] < beam[1] < beam[2]
    assert all(b > p for b, p in zip(beam, parallel))  # beams also share generated prefixes
    assert beam_search_savings(trace, 3, 16, switch_prob=0.0).saved_fraction == parallel[1]


# ---- command line --------------------------------------------------------------------------------

def test_cli_simulate_json_and_trace_file(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    args = ["simulate", "--workload", "alpaca", "--num-requests", "60", "--pool-tokens", "8192",
            "--parallel-samples", "2", "--beam-width", "2", "--json"]
    assert main(args + ["--save-trace", str(path)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["strategies"]) == set(STRATEGIES)
    assert report["parallel_sampling"]["saved_fraction"] > 0
    assert report["beam_search"]["saved_fraction"] > report["parallel_sampling"]["saved_fraction"]
    assert main(["simulate", "--trace", str(path), "--pool-tokens", "8192", "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert replayed["strategies"] == report["strategies"]


def test_cli_simulate_reports_progress_on_stderr(capsys):
    assert main(["simulate", "--workload", "alpaca", "--num-requests", "60", "--pool-tokens",
                 "8192", "--parallel-samples", "2", "--beam-width", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out.strip().splitlines()[-1])  # stdout: the report, JSON last
    assert set(report["strategies"]) == set(STRATEGIES)
    lines = err.strip().splitlines()
    # One line per phase as it starts (the trace, 4 strategies, 2 sharing modes), then the total.
    assert [line.split("]")[0] for line in lines[:-1]] == [f"simulate: [{i}/7" for i in range(1, 8)]
    for name in STRATEGIES:
        assert any(f"through the {name} strategy" in line for line in lines)
    assert "parallel sampling" in lines[5] and "beam search" in lines[6]
    assert lines[-1].startswith("simulate: done in ")
    assert "simulate: [" not in out


# ---- KV groups ----------------------------------------------------------------------------

def test_kv_groups_fit_more_long_requests_in_the_same_bytes():
    from paged_attention_ext.kv_groups import KVGroupLayout
    from paged_attention_ext.tools.simulator import PagedGroups

    trace = [Request(3000, 64) for _ in range(40)]
    layout = KVGroupLayout.from_windows([None if (i + 1) % 6 == 0 else 256 for i in range(12)])
    grouped = PagedGroups(32768, 16, layout)
    stats = replay(trace, grouped)
    single = replay(trace, make_strategy("paged", 32768, 4096, 16))
    # One table: 10 requests of ~3064 tokens in 32768 slots. Groups: the full layers' share
    # (1/6) plus the sliding layers' windows, and each prompt held whole while prefilled.
    assert single.peak_batch == 10
    assert stats.peak_batch >= 3 * single.peak_batch
    utilisation = grouped.group_utilisation()
    assert len(utilisation) == 6 and all(0.5 < u <= 1.0 for u in utilisation)
    assert grouped.manager.num_used_device_blocks == 0  # every request released


def test_simulate_with_a_layer_pattern(tmp_path, capsys):
    trace = tmp_path / "long.jsonl"
    trace.write_text("".join('{"prompt_len": 2000, "output_len": 32}\n' for _ in range(30)))
    assert main(["simulate", "--trace", str(trace), "--max-len", "4096", "--pool-tokens", "16384",
                 "--preset", "gemma-3-1b", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    groups = report["kv_groups"]
    assert [g["sliding_window"] for g in groups["groups"]][:2] == [None, 512]
    assert groups["peak_batch"] > 2 * groups["peak_batch_single_table"]


def test_simulate_says_which_kv_group_is_padded(tmp_path, capsys):
    trace = tmp_path / "short.jsonl"
    trace.write_text("".join('{"prompt_len": 100, "output_len": 8}\n' for _ in range(10)))
    assert main(["simulate", "--trace", str(trace), "--preset", "gemma-3-27b", "--json"]) == 0
    out, err = capsys.readouterr()
    groups = json.loads(out.strip().splitlines()[-1])["kv_groups"]["groups"]
    # 10 full layers set the group size; the 52 sliding ones fill 5 groups and leave 2 layers.
    assert [g["padded_layers"] for g in groups] == [0, 0, 0, 0, 0, 0, 8]
    assert len({g["bytes_per_token"] for g in groups}) == 1  # one page size for every group
    rows = [line for line in out.splitlines() if line.startswith("  group ")]
    assert "padded to 10 layers" in rows[6] and "share one pool" in rows[6]
    assert not any("padded" in row for row in rows[:6])
    assert "through paged-groups" in err  # the KV groups' phase has its progress line


def test_simulate_chunked_layers_fit_more_long_requests(tmp_path, capsys):
    """Llama-4's pattern (3 chunked : 1 full) at a small chunk: the chunked groups hold a
    chunk per request, so more long requests fit than with one table for every layer."""
    trace = tmp_path / "long.jsonl"
    trace.write_text("".join('{"prompt_len": 2000, "output_len": 32}\n' for _ in range(30)))
    assert main(["simulate", "--trace", str(trace), "--max-len", "4096", "--pool-tokens", "16384",
                 "--layers", "8", "--kv-heads", "2", "--head-size", "64", "--layer-pattern", "3:1",
                 "--attention-chunk-size", "256", "--json"]) == 0
    out, _ = capsys.readouterr()
    assert "(3 chunked (chunks of 256) : 1 full)" in out
    groups = json.loads(out.strip().splitlines()[-1])["kv_groups"]
    assert [(g["kind"], g["chunk_size"]) for g in groups["groups"]] == [
        ("full attention", None)] + [("chunks of 256", 256)] * 3
    assert groups["peak_batch"] > 2 * groups["peak_batch_single_table"]
