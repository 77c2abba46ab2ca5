"""`zero3d launch --nnodes 1:2 --max-restarts 1`: a job that loses a node goes on with fewer ranks.

Two "nodes" on this machine (one launcher each, one worker per node) train the tiny job with a
fixed global batch; every process of node 1 is killed mid-training. Node 0's worker loses its
peer, torchrun's agent restarts it in a new rendezvous round of one node, and it resumes from
the latest checkpoint on dp 1 (twice the accumulation steps, the same 16-block batch), so the
run's training losses are those of an uninterrupted two-process run. Node 0 is started first: its agent
hosts the rendezvous (``--master-addr``), which the job cannot lose; node 1 starts once that port
listens. The uninterrupted run starts when node 1 is killed: node 0's agent then waits in the
rendezvous' last call for a second node, and the reference trains meanwhile instead of before
the elastic run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import yaml

from parallel3d.launch.launcher import free_port
from tests.test_job_signals import MARK, PEER_LOSS_TIMEOUT_S, job_processes
from tests.test_train_cli import ROOT, assert_close_records, read_metrics, tiny_job

# The rendezvous' last call: how long an agent whose round has its minimum of nodes waits for more
# (torchrun's --rdzv-conf, read from PET_RDZV_CONF; torch's default 30 s). Node 1 must join within
# it of node 0 (it does ~1.5 s after its start on an idle machine), and after node 1 is lost node 0
# waits all of it before it goes on alone.
LAST_CALL_S = 10


def wait_for_listener(port: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Wait until a socket of this machine listens on TCP ``port`` (read from /proc, no connection made)."""
    deadline = time.monotonic() + timeout
    while True:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
            if any(row[1].endswith(f":{port:04X}") and row[3] == "0A" for row in rows):  # 0A: LISTEN
                return
        assert proc.poll() is None and time.monotonic() < deadline, f"nothing listens on port {port}"
        time.sleep(0.1)


def elastic_job(run) -> dict:
    job = tiny_job(run, max_steps=12, save_interval=4, eval_interval=0, progress=False)
    del job["engine"]["gradient_accumulation_steps"]
    job["engine"]["train_batch_size"] = 16  # dp 2: 2 micro-batches of 4 per rank; dp 1: 4
    job["engine"]["comm"] = {"timeout_s": PEER_LOSS_TIMEOUT_S}  # node 0's worker explains the lost peer sooner
    return job


def test_a_job_that_loses_a_node_goes_on_with_fewer_ranks(tmp_path, cache_dir):
    env = dict(os.environ, ZERO3D_CACHE=str(cache_dir), PYTHONPATH=str(ROOT))
    nodes_env = {**env, "PET_RDZV_CONF": f"last_call_timeout={LAST_CALL_S}"}
    for name in ("reference", "elastic"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "job.yaml").write_text(yaml.safe_dump(elastic_job(tmp_path / name / "run")))
    marks, nodes, port = [uuid.uuid4().hex for _ in range(3)], [], str(free_port())  # node 0, node 1, reference
    logs = [open(tmp_path / f"{name}.txt", "w") for name in ("node0", "node1", "reference")]

    def start(node: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "parallel3d.cli", "launch", "--nnodes", "1:2", "--nproc-per-node", "1",
             "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", port, "--node-rank", str(node),
             "-m", "parallel3d.job.run", "job.yaml"],
            cwd=tmp_path / "elastic", env={**nodes_env, MARK: marks[node]}, stdout=subprocess.DEVNULL,
            stderr=logs[node])

    try:
        nodes.append(start(0))
        wait_for_listener(int(port), nodes[0])  # node 0's agent binds the rendezvous port before node 1's tries
        nodes.append(start(1))
        run = tmp_path / "elastic" / "run"
        deadline = time.monotonic() + 300
        while not ((run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= 7):
            assert time.monotonic() < deadline and nodes[0].poll() is None, (tmp_path / "node0.txt").read_text()[-3000:]
            time.sleep(0.2)
        for pid in job_processes(marks[1]):
            os.kill(pid, signal.SIGKILL)
        nodes.append(subprocess.Popen([sys.executable, "-m", "parallel3d.cli", "train", "job.yaml", "--nproc-per-node",
                                       "2"], cwd=tmp_path / "reference", env={**env, MARK: marks[2]},
                                      stdout=subprocess.DEVNULL, stderr=logs[2]))
        assert nodes[2].wait(300) == 0, (tmp_path / "reference.txt").read_text()[-3000:]
        assert nodes[0].wait(500) == 0, (tmp_path / "node0.txt").read_text()[-3000:]
    finally:
        for mark in marks:
            for pid in job_processes(mark):
                os.kill(pid, signal.SIGKILL)
        for proc in nodes:
            proc.wait(30)
        for log in logs:
            log.close()
    said = (tmp_path / "node0.txt").read_text()
    assert "world 1 (dp 1)" in said and "resumed from" in said and "Traceback" not in said, said[-3000:]
    got, want = read_metrics(run), read_metrics(tmp_path / "reference" / "run")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(13))
    for g, w in zip(got, want):  # (validation reads train.eval_batches per rank: another set on dp 1)
        assert (g.get("lr"), g.get("tokens")) == (w.get("lr"), w.get("tokens")), (g, w)
        assert_close_records(g, w, ("loss",), rel=1e-5)
