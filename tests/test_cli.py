"""The command line: the demo serves a batch with the engine and matches transformers; the
walkthrough runs every op and reports a match with the reference; every option has a plain-text
help."""

import argparse
import json
import subprocess
import sys

import pytest

from paged_attention_ext.tools.cli import build_parser, main


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


def parsers():
    """The command and each subcommand, by name."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"paged-attention": parser, **sub.choices}


@pytest.mark.parametrize("name", list(parsers()))
def test_every_option_has_a_plain_text_help(name):
    parser = parsers()[name]
    actions = list(parser._actions)
    for action in parser._actions:  # the subcommands' one-line summaries
        actions += getattr(action, "_choices_actions", [])
    for action in actions:
        label = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS and action.help.strip(), \
            f"{name} {label} has no help"
        assert "``" not in action.help, f"{name} {label}: reStructuredText in its help"
    text = parser.format_help()
    assert parser.description and "``" not in text and ":mod:" not in text and ":func:" not in text


def test_help_prints_plain_text(capsys):
    for argv in (["--help"], ["simulate", "--help"], ["memory", "--help"]):
        with pytest.raises(SystemExit) as exit:
            main(argv)
        assert exit.value.code == 0
        out = capsys.readouterr().out
        assert "paged-attention" in out and "``" not in out
    main_help = parsers()["paged-attention"].format_help()
    assert all(command in main_help for command in ("demo", "walkthrough", "memory", "simulate"))
