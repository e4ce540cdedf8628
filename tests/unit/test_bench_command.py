"""``llmgw bench``: a table of benchmark names to modules, listed by ``llmgw bench``, dispatched by name."""

from __future__ import annotations

import sys

import pytest

from llmgw import cli
from llmgw.commands.bench import BENCHES


def test_llmgw_bench_lists_its_benchmarks_and_refuses_an_unknown_one(capsys):
    assert cli.main(["bench"]) == 0
    listing = capsys.readouterr().out
    assert all(f"  {name}  " in listing for name in BENCHES) and "fault" in BENCHES
    assert cli.main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_llmgw_bench_fault_dispatches_to_its_module(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "fault", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: llmgw bench fault") and "--json" in help_text and "--duration" in help_text


def test_llmgw_bench_without_the_benchmarks_says_how_to_get_them(capsys, monkeypatch):
    for name in ["llmgw.bench", *(module for module, _ in BENCHES.values())]:  # as from the wheel, without them
        monkeypatch.setitem(sys.modules, name, None)  # (also when another test imported them already)
    assert cli.main(["bench", "routing", "--quick"]) == 2
    said = capsys.readouterr().err
    assert "the benchmarks are not in this installation of llmgw" in said
    assert "pip install -e '.[bench]'" in said and "llmgw bench routing --help" in said


def test_llmgw_bench_proxy_dispatches_to_the_data_plane_benchmark(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "proxy", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: llmgw bench proxy")
    assert all(flag in help_text for flag in ("--targets", "--baseline", "--vllm-router", "--repeat", "--json"))


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_benchmarks_help_names_it_as_llmgw_bench_name(name, capsys):
    program = sys.argv[0]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", name, "--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out.split("\n", 1)[0]
    assert usage.startswith(f"usage: llmgw bench {name} ") or usage == f"usage: llmgw bench {name}", usage
    assert sys.argv[0] == program  # set for the benchmark's parser only
