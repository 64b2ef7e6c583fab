"""The command line of ``vllm serve`` works on ``ragserve serve`` (issue 29): vLLM's flags under
vLLM's names, no prefix matching on any parser, and one line naming an unknown flag."""

from __future__ import annotations

import argparse
import logging

import pytest

from ragserve.cli.errors import UsageError
from ragserve.cli.main import build_parser, main
from ragserve.cli.serve import serve_launch_config


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_matches_a_prefix_of_a_long_flag(capsys) -> None:
    parsers = list(_parsers(build_parser()))
    assert len(parsers) >= 11 and all(p.allow_abbrev is False for p in parsers)
    # `--api-k` would have been read as --api-key-file (the first report)
    cases = [(["serve", "--api-k", "KEY"], "--api-k"), (["ask", "q", "--top", "2"], "--top")]
    cases.append((["index", "search", "ix", "q", "--js"], "--js"))
    for argv, prefix in cases:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and prefix in lines[0], lines


def test_an_unknown_flag_is_one_line_naming_it(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--swap-space", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unrecognized arguments: --swap-space" in err


def test_vllm_serve_flags_map_onto_the_config(caplog, monkeypatch) -> None:
    monkeypatch.delenv("RAGSERVE_API_KEY", raising=False)
    argv = ["serve", "/models/tiny", "--host", "0.0.0.0", "--port", "9001", "--api-key", "k3y"]
    argv += ["--served-model-name", "tiny", "--max-model-len", "512", "--max-num-seqs", "4"]
    argv += ["--gpu-memory-utilization", "0.5", "--dtype", "float32", "--seed", "7"]
    argv += ["--max-num-batched-tokens", "1024", "--block-size", "32", "--enforce-eager"]
    argv += ["--no-enable-prefix-caching", "--tensor-parallel-size", "1", "--load-format", "dummy"]
    with caplog.at_level(logging.WARNING, logger="ragserve.cli.serve"):
        config = serve_launch_config(build_parser().parse_args(argv))
    assert "visible to other local users" in caplog.text
    assert config.model == "/models/tiny"
    serve = config.serve
    assert (serve.host, serve.port, serve.api_key, serve.served_model_name) == (
        "0.0.0.0",
        9001,
        "k3y",
        "tiny",
    )
    assert dict(config.runtime.engine_kwargs) == {
        "max_model_len": 512,
        "max_num_seqs": 4,
        "kv_cache_memory_fraction": 0.5,
        "dtype": "float32",
        "seed": 7,
        "max_num_batched_tokens": 1024,
        "block_size": 32,
        "enable_cuda_graphs": False,
        "enable_prefix_caching": False,
        "load_format": "dummy",
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-tp", "2"], "--tensor-parallel-size 2: ragserve runs each LLM replica on one device"),
        (["--pipeline-parallel-size", "4"], "--pipeline-parallel-size 4"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be > 0"),
        (["--api-key", "a", "--api-key-file", "f"], "not both"),
        (["--api-key", " "], "--api-key is empty"),
        (["m1", "--model", "m2"], "model given twice"),
    ],
)
def test_vllm_flags_out_of_range_are_usage_errors(argv, message) -> None:
    with pytest.raises(UsageError) as err:
        serve_launch_config(build_parser().parse_args(["serve", *argv]))
    assert message in str(err.value)
