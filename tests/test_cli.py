"""The command line: the demo serves a batch with the engine and matches transformers; the
walkthrough runs every op and reports a match with the reference."""

import json
import subprocess
import sys

from paged_attention_ext.tools.cli import main


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_demo_serves_with_preemption_and_matches_reference(capsys):
    assert main(["demo", "--json"]) == 0
    out = capsys.readouterr()
    report = last_json(out.out)
    assert report["matches_reference"] is True and report["ok"] is True
    assert report["preemptions"]["swap"] > 0 and set(report["preemptions"]) == {"swap", "recompute"}
    assert report["tokens_per_s"] > 0
    assert 0 < report["kv_utilization"] <= 1
    assert report["sharing_saved_pct"] > 0 and report["prefix_cache_hit_rate"] > 0
    assert "reference" in out.out and "serving" in out.err  # report on stdout, progress on stderr


def test_demo_with_compiled_decode_matches_reference(capsys):
    # The cheap "eager" backend: the same compiled-decode path without inductor's compile time.
    assert main(["demo", "--json", "--compile-decode", "eager"]) == 0
    report = last_json(capsys.readouterr().out)
    assert report["matches_reference"] is True
    assert report["engine"]["compiled_decode"]["steps"] > 0


def test_walkthrough_reports_success_as_json(capsys):
    assert main(["walkthrough", "--json"]) == 0
    report = last_json(capsys.readouterr().out)
    assert report["ok"] is True
    assert set(report["checks"]) >= {"prefill (multi-token)", "copy_blocks (copy-on-write)",
                                     "swap_blocks (out and back)", "decode after swap-in"}
    assert all(error < 1e-4 for error in report["checks"].values())
    # Forking shares full blocks: fewer physical blocks than block-table entries.
    assert report["blocks_used"] * 16 < report["tokens"] + 16 * report["sequences"]


def test_module_entry_point(tmp_path):
    # Outside the source tree: `python -m` puts the working directory first on sys.path.
    result = subprocess.run([sys.executable, "-m", "paged_attention_ext", "walkthrough", "--json"],
                            capture_output=True, text=True, check=True, cwd=tmp_path)
    assert last_json(result.stdout)["ok"] is True
