"""The command line: the demo runs every op and reports a match with the reference."""

import json
import subprocess
import sys

from paged_attention_ext.cli import main


def test_demo_reports_success_as_json(capsys):
    assert main(["demo", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["ok"] is True
    assert set(report["checks"]) >= {"prefill (multi-token)", "copy_blocks (copy-on-write)",
                                     "swap_blocks (out and back)", "decode after swap-in"}
    assert all(error < 1e-4 for error in report["checks"].values())
    # Forking shares full blocks: fewer physical blocks than block-table entries.
    assert report["blocks_used"] * 16 < report["tokens"] + 16 * report["sequences"]


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "paged_attention_ext", "demo", "--json"],
                            capture_output=True, text=True, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1])["ok"] is True
