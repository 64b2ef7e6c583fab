"""Configuration as data: a config file (TOML / YAML) round-trips, flags override it, bad keys
are refused by name, and ``serve`` is co-scheduled by default."""

from __future__ import annotations

import dataclasses

import pytest

from ragserve.cli.launch_config import (
    ConfigError,
    LaunchConfig,
    dump_toml,
    from_mapping,
    read_file,
    tomllib,
)
from ragserve.cli.main import UsageError, build_parser
from ragserve.cli.serve import serve_launch_config
from ragserve.runtime import CoScheduleConfig, ServerConfig
from ragserve.server import ServeConfig


def custom() -> LaunchConfig:
    return LaunchConfig(
        model="/models/llama",
        index="/data/index",
        embedder="all-minilm-l6-v2",
        workflows=("mygraphs:agent",),
        runtime=ServerConfig(
            engine_kwargs={"device": "cpu", "dtype": "bfloat16", "kv_cache_bytes": 1 << 28},
            default_nprobe=16,
            max_active_requests=512,
            cosched=CoScheduleConfig(enable_speculation=False, budget_s=0.004, cache_topk=8),
        ),
        serve=ServeConfig(host="0.0.0.0", port=9000, api_key="k", max_num_inflight=32),
    )


def test_toml_round_trip_is_exact(tmp_path) -> None:
    config = custom()
    text = dump_toml(config)
    assert from_mapping(tomllib.loads(text)) == config
    path = tmp_path / "ragserve.toml"
    path.write_text(text)
    assert from_mapping(read_file(path)) == config
    assert from_mapping(tomllib.loads(dump_toml(LaunchConfig()))) == LaunchConfig()


def test_yaml_and_kv_cache_gb_and_cosched_names(tmp_path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "ragserve.yaml"
    path.write_text(
        "model: m\nindex: i\ncosched: split,similarity\n"
        "engine:\n  kv_cache_gb: 0.5\n  max_num_seqs: 8\nserve:\n  port: 1234\n"
    )
    config = from_mapping(read_file(path))
    assert dict(config.runtime.engine_kwargs) == {"kv_cache_bytes": 1 << 29, "max_num_seqs": 8}
    assert config.runtime.cosched.enabled == ("split", "similarity")
    assert config.serve.port == 1234


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"modle": "x"}, "modle"),
        ({"engine": {"kv_cache_mb": 1}}, "kv_cache_mb"),
        ({"runtime": {"transforms": []}}, "transforms"),
        ({"cosched": {"enable_warp": True}}, "enable_warp"),
        ({"cosched": "split,warp"}, "warp"),
        ({"serve": {"port": "eighty"}}, "port"),
        ({"serve": {"port": 70000}}, "port"),
        ({"runtime": {"queue_size": 0}}, "queue_size"),
        ({"engine": "cpu"}, "engine"),
        ({"workflows": "a:b"}, "workflows"),
    ],
)
def test_bad_keys_and_values_are_named(data, named) -> None:
    with pytest.raises(ConfigError, match=named):
        from_mapping(data)


def test_flags_override_the_file_which_overrides_defaults(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(dump_toml(custom()))
    argv = ["serve", "--config", str(path), "--port", "9100", "--cosched", "off"]
    argv += ["--kv-cache-gb", "1", "--max-model-len", "1024", "--workflow", "more:graph"]
    argv += ["--host-kv-cache-gb", "0.5"]
    config = serve_launch_config(build_parser().parse_args(argv))
    assert config.serve.port == 9100 and config.serve.host == "0.0.0.0"  # flag, then file
    assert config.runtime.cosched.enabled == ()
    assert config.runtime.cosched.cache_topk == 8  # knobs from the file are kept
    engine = dict(config.runtime.engine_kwargs)
    assert engine["kv_cache_bytes"] == 1 << 30 and engine["max_model_len"] == 1024
    assert engine["host_kv_cache_bytes"] == 1 << 29 and engine["dtype"] == "bfloat16"
    with pytest.raises(UsageError, match="--host-kv-cache-gb must be >= 0"):
        serve_launch_config(build_parser().parse_args(["serve", "--host-kv-cache-gb", "-1"]))
    assert config.workflows == ("mygraphs:agent", "more:graph")
    assert config.runtime.default_nprobe == 16


def test_serve_is_co_scheduled_by_default() -> None:
    config = serve_launch_config(build_parser().parse_args(["serve"]))
    assert config.runtime.cosched == CoScheduleConfig()
    assert config.runtime.cosched.enabled == ("split", "gen_chunks", "similarity", "speculation")
    assert config.index == "factbook" and config.model == "smollm2-135m-instruct"
    assert config.serve.served_model_name == "smollm2-135m-instruct"


def test_print_config_round_trips_through_the_command(capsys) -> None:
    from ragserve.cli.main import main

    argv = ["serve", "--print-config", "--cosched", "split", "--device", "cpu", "--nprobe", "4"]
    assert main(argv) == 0
    config = from_mapping(tomllib.loads(capsys.readouterr().out))
    assert config.runtime.cosched.enabled == ("split",)
    assert dict(config.runtime.engine_kwargs) == {"device": "cpu"}
    assert config.runtime.default_nprobe == 4


def test_server_config_holds_data_only() -> None:
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    assert "transforms" not in names and "cosched" in names
    with pytest.raises(TypeError, match="cosched"):
        ServerConfig(cosched=("split",))


def test_cosched_from_names() -> None:
    assert CoScheduleConfig.from_names("auto") == CoScheduleConfig()  # the default
    assert CoScheduleConfig.from_names("all") == CoScheduleConfig(auto=False)
    assert CoScheduleConfig.from_names("off").enabled == CoScheduleConfig.none().enabled == ()
    both = CoScheduleConfig.from_names("speculation, split", budget_s=0.01)
    assert both.enabled == ("split", "speculation") and both.budget_s == 0.01
    with pytest.raises(ValueError, match="spec_retrieval warms"):
        CoScheduleConfig.from_names("spec_retrieval")


def test_workflow_specs_load_user_graphs(tmp_path, monkeypatch) -> None:
    from ragserve.cli.main import UsageError
    from ragserve.cli.options import load_workflow
    from ragserve.graph import CompiledGraph

    (tmp_path / "my_graphs_p15.py").write_text(
        "from ragserve.graph import END, START, RAGraph\n"
        "def agent():\n"
        "    g = RAGraph('agent').add_retrieval(0, query='input', topk=2, output='docs')\n"
        "    g.add_generation(1, prompt='{docs} {input}')\n"
        "    return g.add_edge(START, 0).add_edge(0, 1).add_edge(1, END)\n"
        "def broken():\n"
        "    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    name, graph = load_workflow("my_graphs_p15:agent")
    assert name == "agent" and isinstance(graph, CompiledGraph)
    assert load_workflow("helper=my_graphs_p15:agent")[0] == "helper"
    with pytest.raises(UsageError, match="not a RAGraph"):
        load_workflow("my_graphs_p15:broken")
    with pytest.raises(UsageError, match="module:function"):
        load_workflow("my_graphs_p15")
    with pytest.raises(UsageError, match="nope"):
        load_workflow("my_graphs_p15:nope")


def test_api_key_from_the_environment_is_used_but_not_printed(monkeypatch, capsys) -> None:
    from ragserve.cli.main import main

    monkeypatch.setenv("RAGSERVE_API_KEY", "s3cret")
    assert serve_launch_config(build_parser().parse_args(["serve"])).serve.api_key == "s3cret"
    assert main(["serve", "--print-config"]) == 0
    assert "s3cret" not in capsys.readouterr().out
