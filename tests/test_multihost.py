"""Multi-host on one machine: two processes of two CPU devices each, joined by
jax.distributed, serve through one TP 4 mesh over both; the scores are one device's."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from runtime.distributed import DistConfig
from tests.assertions import assert_scores_close
from tests.server_harness import OK, call, metric

REQUESTS = [dict(OK, apply_softmax=True), OK, dict(query=[3, 1, 4, 1, 5], items=[[9, 2], [6]],
                                                    label_token_ids=[5, 319])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(model_dir: str, rank: int, coordinator: str, log_path) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    args = ["--model-path", model_dir, "--port", "0", "--tp-size", "4", "--nnodes", "2",
            "--node-rank", str(rank), "--dist-init-addr", coordinator, "--page-size", "8",
            "--max-prefill-tokens", "256", "--max-seqs", "8", "--skip-warmup"]
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "server", *args], stderr=log,
                                stdout=log, env=env)


def wait_for_log(path, pattern: str, proc: subprocess.Popen, seconds: float = 180):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with open(path) as f:
            if match := re.search(pattern, f.read()):
                return match
        assert proc.poll() is None, f"node exited with {proc.returncode}:\n{open(path).read()}"
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {path}:\n{open(path).read()}")


def test_two_hosts_serve_one_mesh_with_one_device_scores(model_dirs, engines, tmp_path):
    coordinator = f"127.0.0.1:{free_port()}"
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    nodes = [start_node(model_dirs["qwen3"], rank, coordinator, logs[rank]) for rank in (0, 1)]
    try:
        port = int(wait_for_log(logs[0], r"on http://127\.0\.0\.1:(\d+)", nodes[0]).group(1))
        for req in REQUESTS:
            status, payload, _ = call(port, "POST", "/v1/score", req)
            assert status == 200, payload
            assert_scores_close(payload["scores"], engines["qwen3"].score(**req).scores)
        forwards = int(metric(port, "jax_score_forwards_total"))
        nodes[0].send_signal(signal.SIGTERM)
        assert nodes[0].wait(60) == 0
        assert nodes[1].wait(60) == 0  # node 0's stop step ended it
        assert f"node 0 stopped after {forwards} forwards" in logs[1].read_text()
    finally:
        for node in nodes:
            node.kill()
            node.wait(30)


@pytest.mark.parametrize("kw, fragment", [
    (dict(nnodes=2), "--dist-init-addr HOST:PORT"),
    (dict(nnodes=2, node_rank=2, init_addr="h:1"), "--node-rank 2"),
    (dict(nnodes=2, init_addr="no-port"), "got 'no-port'")])
def test_bad_multihost_flags_are_refused(kw, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        DistConfig(**kw)
