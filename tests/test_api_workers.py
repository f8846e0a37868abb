"""`python -m server --api-workers N` (server.api_workers): front-end processes sharing the
port in front of engine processes; a front end killed and started again while the other
serves on; SIGTERM stops all; an engine process killed is started again, every front end told;
what `auto` picks; the server without the processes extra."""
import concurrent.futures
import http.client
import os
import re
import signal
import subprocess
import sys
import threading
import time

from server.__main__ import auto_api_workers, has_accelerator
from tests.server_harness import call
from tests.test_parallel import requests, scores

ARGS = ["--max-prefill-tokens", "256", "--max-seqs", "8", "--page-size", "8",
        "--skip-warmup", "--noaccess_log", "--compile-cache-dir", ""]


class Launched:
    """The server's process, its port, and its log as it comes (a thread reads it)."""

    def __init__(self, model_dir: str, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "server", "--model-path", model_dir,
                                      "--port", "0", *ARGS, *args], stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
        serving = self.wait_for(r"serving .* on http://127\.0\.0\.1:(\d+)", 240)
        self.port = int(serving.group(1))
        self.front_ends = [int(p) for p in re.search(r"front ends \(pids ([\d ]+)\)",
                                                     serving.group(0)).group(1).split()]
        self.engines = [int(m.group(1)) for line in self.lines
                        if (m := re.search(r"engine process (\d+)", line))]

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.proc.kill()
        raise AssertionError(f"no {pattern!r} in the log:\n" + "".join(self.lines[-30:]))


def test_front_ends_share_the_port_and_one_killed_comes_back(engines, model_dirs):
    server = Launched(model_dirs["qwen3"], "--api-workers", "2")
    try:
        assert len(server.front_ends) == 2 and len(server.engines) == 1
        reqs = requests("qwen3", seed=31, n=7)
        engines["qwen3"].flush_prefix_cache()
        answers = [call(server.port, "POST", "/v1/score", r) for r in reqs]  # a connection
        assert [a[0] for a in answers] == [200] * len(reqs)                  # each
        assert [a[1]["scores"] for a in answers] == scores(engines["qwen3"], reqs)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            concurrent_answers = list(pool.map(
                lambda r: call(server.port, "POST", "/v1/score", r), reqs * 3))
        assert [a[0] for a in concurrent_answers] == [200] * len(reqs) * 3

        listening = _listening(server.port)
        assert len(listening) == 2
        os.kill(server.front_ends[0], signal.SIGKILL)
        deadline = time.monotonic() + 30  # until the kernel has closed its listening socket
        while len(left := _listening(server.port) & listening) > 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # (a connection it gave that socket meanwhile is reset)
        assert len(left) == 1
        for r in reqs[:4]:  # new connections go to the front end left
            assert call(server.port, "POST", "/v1/score", r)[0] == 200
        again = int(server.wait_for(r"front end 0 ended .* started again \(pid (\d+)\)",
                                    60).group(1))
        assert again not in server.front_ends and _alive(again)
        outcomes, load = _load(server.port, reqs, clients=8)
        time.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)  # with requests in flight in both
        assert server.proc.wait(60) == 0         # front ends: each answered, or refused
        load.join(30)
        assert outcomes and set(outcomes) <= {200, 503, "refused"}, set(outcomes)
        assert outcomes.count(200) >= 8
        assert not any(_alive(p) for p in [again, server.front_ends[1], *server.engines])
    finally:
        server.proc.kill()


def test_an_engine_process_killed_is_started_again_for_every_front_end(engines, model_dirs):
    """Both front ends hear of it: /health says so (503) on every connection until it is
    ready, then scores are the same as before."""
    server = Launched(model_dirs["qwen3"], "--api-workers", "2")
    try:
        reqs = requests("qwen3", seed=37, n=4)
        engines["qwen3"].flush_prefix_cache()
        want = scores(engines["qwen3"], reqs)
        os.kill(server.engines[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while call(server.port, "GET", "/health")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # one front end has heard, and the other as soon
        health = [call(server.port, "GET", "/health")[:2] for _ in range(20)]  # on both
        assert {status for status, _ in health} == {503}, health
        assert all("replica 0: its engine process is starting again" in body["message"]
                   for _, body in health), health[0]
        assert call(server.port, "POST", "/v1/score", reqs[0])[0] == 503
        server.wait_for(r"replica 0 serves again", 240)
        *_, again = [int(m.group(1)) for line in server.lines
                     if (m := re.search(r"replica 0: engine process (\d+)", line))]
        assert again != server.engines[0]
        time.sleep(0.2)
        assert {call(server.port, "GET", "/health")[0] for _ in range(20)} == {200}
        assert [call(server.port, "POST", "/v1/score", r)[1]["scores"] for r in reqs] == want
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        assert not any(_alive(p) for p in [again, *server.front_ends])
    finally:
        server.proc.kill()


def _listening(port: int) -> set[int]:
    """The inodes of the IPv4 sockets listening on `port` (/proc/net/tcp)."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in list(table)[1:]]
    return {int(row[9]) for row in rows
            if int(row[1].split(":")[1], 16) == port and row[3] == "0A"}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _load(port: int, reqs: list[dict], clients: int):
    """Clients sending `reqs` over and over until the server stops taking connections:
    (each request's status, or "refused" or "reset", and the thread running them)."""
    outcomes = []

    def client(k: int) -> None:
        while True:
            try:
                outcomes.append(call(port, "POST", "/v1/score", reqs[k % len(reqs)])[0])
            except ConnectionRefusedError:
                outcomes.append("refused")
                return
            except (ConnectionResetError, http.client.RemoteDisconnected):
                outcomes.append("reset")
                return

    def run() -> None:
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, range(clients)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return outcomes, thread


def test_auto_is_one_process_on_cpu_and_two_front_ends_a_replica_on_accelerators(
        tmp_path, monkeypatch):
    assert auto_api_workers(replicas=1, cores=2, accelerator=False) == 1
    assert auto_api_workers(replicas=8, cores=180, accelerator=False) == 1
    assert auto_api_workers(replicas=1, cores=2, accelerator=True) == 2
    assert auto_api_workers(replicas=4, cores=96, accelerator=True) == 8
    assert auto_api_workers(replicas=8, cores=4, accelerator=True) == 4
    assert auto_api_workers(replicas=1, cores=1, accelerator=True) == 1
    assert not has_accelerator("cpu") and has_accelerator("tpu") and has_accelerator("cuda,cpu")
    import server.__main__
    monkeypatch.setattr(server.__main__, "_DEVICE_FILES", (str(tmp_path / "accel[0-9]*"),))
    assert not has_accelerator("")
    (tmp_path / "accel0").touch()
    assert has_accelerator("")


def test_without_the_processes_extra_one_process_serves(model_dirs):
    """pyzmq and msgspec are an extra: `python -m server` serves without them (auto: one
    process on CPU), and --api-workers 2 says what to install."""
    run_without = ("import runpy, sys; sys.modules['zmq'] = sys.modules['msgspec'] = None; "
                   "runpy.run_module('server', run_name='__main__', alter_sys=True)")
    command = [sys.executable, "-c", run_without, "--model-path", model_dirs["qwen3"],
               "--port", "0", *ARGS]
    refused = subprocess.run([*command, "--api-workers", "2"], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 1 and "pip install 'jax-score[processes]'" in refused.stderr
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if match := re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", line):
                break
        else:
            raise AssertionError(f"exited with {proc.wait()} before serving")
        port = int(match.group(1))
        assert {call(port, "POST", "/v1/score", r)[0] for r in requests("qwen3", 5, 2)} == {200}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
