"""``ragserve serve --ray [ADDRESS] --llm-replicas N --index-shards M`` parsing (issue 17)."""

from __future__ import annotations

import argparse

import pytest

from ragserve.cli import serve


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", "--model", "m", "--index", "i", *argv])


def _scale_out(*argv: str) -> dict:
    """The scale-out fields of the ``ServerConfig`` that ``serve``'s flags give."""
    runtime = serve.serve_launch_config(_parse(*argv), key_from_env=False).runtime
    names = ("backend", "ray_address", "num_llm_replicas", "num_index_shards")
    return {name: getattr(runtime, name) for name in names}


def test_ray_flags_map_to_server_config_fields() -> None:
    from ragserve.runtime import ServerConfig

    default = ServerConfig()
    assert _scale_out() == {
        "backend": default.backend,
        "ray_address": default.ray_address,
        "num_llm_replicas": 1,
        "num_index_shards": 1,
    }
    local = _scale_out("--ray", "--llm-replicas", "2", "--index-shards", "3")
    assert local == {
        "backend": "ray",
        "ray_address": None,
        "num_llm_replicas": 2,
        "num_index_shards": 3,
    }
    joined = _scale_out("--ray", "10.0.0.1:6379")
    assert joined["ray_address"] == "10.0.0.1:6379" and joined["num_llm_replicas"] == 1


def test_replicas_without_ray_are_refused(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from ragserve.cli.main import main

    argv = ["serve", "--model", "m", "--index", str(tmp_path), "--llm-replicas", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "need backend='ray'" in err and "Traceback" not in err


def test_server_config_validates_the_backend_fields() -> None:
    from ragserve.runtime import ServerConfig

    assert ServerConfig(backend="ray", num_llm_replicas=2, num_index_shards=2).ray_address is None
    for kwargs, field in [
        ({"backend": "slurm"}, "backend"),
        ({"backend": "ray", "num_llm_replicas": 0}, "num_llm_replicas"),
        ({"backend": "ray", "num_index_shards": 0}, "num_index_shards"),
        ({"backend": "ray", "in_process": True}, "in_process"),
        ({"backend": "ray", "ray_num_cpus": 0}, "ray_num_cpus"),
        ({"backend": "ray", "shard_partition": "hash"}, "shard_partition"),
    ]:
        with pytest.raises(ValueError, match=field):
            ServerConfig(**kwargs)


def test_ray_backend_needs_paths_not_live_objects() -> None:
    from ragserve.runtime import Server, ServerConfig

    with pytest.raises(TypeError, match="index must be a name or a path for Ray actors"):
        Server("tiny", object(), config=ServerConfig(backend="ray"))  # before any cluster
