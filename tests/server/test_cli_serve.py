"""``ragserve serve`` as a real process (worker processes, real signals): serves with auth,
then SIGTERM drains an in-flight stream before the process exits."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from stacks import make_assets, serve_process


def test_serve_refuses_a_missing_index(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from ragserve.cli.main import main

    argv = ["serve", "--model", "tiny", "--index", str(tmp_path / "none"), "--port", "0"]
    assert main(argv) == 2
    assert "no index directory" in capsys.readouterr().err


def test_api_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch) -> None:
    from ragserve.cli.serve import read_api_key

    monkeypatch.delenv("RAGSERVE_API_KEY", raising=False)
    assert read_api_key(None) is None
    monkeypatch.setenv("RAGSERVE_API_KEY", " env-key\n")
    assert read_api_key(None) == "env-key"
    key_file = tmp_path / "key"
    key_file.write_text("file-key\n")
    assert read_api_key(str(key_file)) == "file-key"
    monkeypatch.setenv("RAGSERVE_API_KEY", "")
    with pytest.raises(ValueError, match="empty"):
        read_api_key(None)
    key_file.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        read_api_key(str(key_file))
    with pytest.raises(ValueError, match="cannot read"):
        read_api_key(str(tmp_path / "missing"))


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return make_assets(tmp_path_factory.mktemp("cli-serve"))


@pytest.mark.slow
@pytest.mark.integration
def test_serve_process_auth_and_sigterm_drain(assets: tuple[str, str], tmp_path) -> None:
    env = {**os.environ, "RAGSERVE_API_KEY": "k3y"}  # a secret never goes on argv
    with serve_process(_argv(assets), tmp_path / "serve.log", env) as (proc, url):
        _exercise(proc, url, tmp_path)


def _argv(assets: tuple[str, str]) -> list[str]:
    model, index = assets
    argv = [model, "--index", index, "--served-model-name", "tiny"]
    return argv + ["--drain-timeout", "180", "--device", "cpu", "--cpu-threads", "1"]


def _stream_through(url: str, signal_it, headers: dict | None = None) -> list[str]:
    """A 100-token completion streamed; ``signal_it()`` once its first event arrived. The
    stream must still end in full (``finish_reason`` length); returns its non-empty lines.
    NOTE: through the worker processes a token took 10-100 ms on this shared 2-core machine
    (load dependent): 100 tokens keep the stream in flight when the signal lands and finish
    well within the drain timeout."""
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 100, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers,
        timeout=120,
    ) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        signal_it()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2].removeprefix("data: "))
    assert "choices" in last, last
    assert last["choices"][0]["finish_reason"] == "length"
    return rest


def _exercise(proc: subprocess.Popen, url: str, tmp_path) -> None:
    assert httpx.get(f"{url}/v1/models").status_code == 401
    # `serve` is co-scheduled by default: /health lists what runs
    cosched = httpx.get(f"{url}/health").json()["cosched"]
    assert cosched == ["split", "gen_chunks", "similarity", "speculation"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model="ragserve/oneshot",
        messages=[{"role": "user", "content": "Tell me about the river Ix."}],
        max_tokens=4,
    )
    assert out.model_extra["documents"] and isinstance(out.choices[0].message.content, str)
    text = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer k3y"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    queues = {s.labels["queue"] for s in families["ragserve:queue_depth"].samples}
    assert any(q.endswith(".pending") for q in queues), queues  # the worker processes' queues
    requests = families["ragserve:requests"].samples
    assert any(s.labels == {"workflow": "oneshot", "status": "ok"} for s in requests)
    sigterm = functools.partial(proc.send_signal, signal.SIGTERM)
    rest = _stream_through(url, sigterm, {"Authorization": "Bearer k3y"})
    text = "".join(json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in rest[:-1])
    assert text  # the answer kept arriving after SIGTERM
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown
    assert proc.wait(timeout=120) in (0, -signal.SIGTERM)
    log = (tmp_path / "serve.log").read_text()
    assert "[generation worker] ragserve.generation.llm_engine: engine ready" in log  # INFO
    assert "Loading weights" not in log  # third-party progress bars are off without -v
    assert "timeout graceful shutdown exceeded" not in log
    assert "leaked semaphore" not in log  # the workers' queues were released at close


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "systemd-stop"])
def test_group_signal_drains_without_restarting_workers(
    assets: tuple[str, str], tmp_path, sig: signal.Signals
) -> None:
    """Ctrl-C signals the terminal's whole process group and systemd's stop SIGTERMs the whole
    cgroup, the workers included: they leave shutdown to the server, so the in-flight stream
    finishes and no worker is restarted."""
    log_path = tmp_path / "serve.log"
    with serve_process(_argv(assets), log_path, new_session=True) as (proc, url):
        _stream_through(url, functools.partial(os.killpg, proc.pid, sig))
        assert proc.wait(timeout=120) in (0, -sig, 128 + sig)
        log = log_path.read_text()
        assert "closing the Server" in log
        assert "worker died" not in log, log
        assert "leaked semaphore" not in log
        # the workers are gone with the server (the group is empty)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail("a worker outlived the server")
