"""zero3d launch: hostfile, Slurm and flag resolution via --dry-run, plus one real local run."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from parallel3d.launch import launcher
from parallel3d.errors import ConfigError
from parallel3d.launch.launcher import expand_nodelist, filter_hosts, main, parse_hostfile, torchrun_command

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST", "SLURM_NNODES",
              "SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES", "SLURM_NODEID", "SLURM_PROCID")


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    for var in SLURM_VARS:
        monkeypatch.delenv(var, raising=False)


def dry_run(capsys, *argv: str) -> dict[str, list[str]]:
    """Run ``zero3d launch --dry-run`` and return {host: argv} from its output lines."""
    assert main(["--dry-run", *argv]) == 0
    out = {}
    for line in capsys.readouterr().out.splitlines():
        host, _, cmd = line.partition(": ")
        out[host] = shlex.split(cmd)
    return out


def torchrun_flags(argv: list[str]) -> dict[str, str]:
    i = argv.index("parallel3d.launch.agent")
    return {argv[j]: argv[j + 1] for j in range(i + 1, argv.index("--master-port") + 2, 2)}


def test_torchrun_command_exact():
    cmd = torchrun_command(["train.py", "--config", "ds.json"], nproc_per_node=8, nnodes=2, node_rank=1,
                           master_addr="h0", master_port=1234)
    assert cmd == [sys.executable, "-m", "parallel3d.launch.agent", "--nproc-per-node", "8", "--nnodes", "2",
                   "--node-rank", "1", "--master-addr", "h0", "--master-port", "1234", "train.py", "--config", "ds.json"]
    assert torchrun_command(["pkg.mod", "-x"], nproc_per_node=1, module=True)[-3:] == ["-m", "pkg.mod", "-x"]


@pytest.mark.parametrize("kw,msg", [({"nproc_per_node": 0}, "--nproc-per-node"),
                                    ({"nproc_per_node": 1, "nnodes": 2, "node_rank": 2}, "--node-rank"),
                                    ({"nproc_per_node": 1, "master_port": 70000}, "--master-port")])
def test_torchrun_command_rejects(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        torchrun_command(["t.py"], **kw)


def test_hostfile_parsing(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# cluster\nworker-0 slots=4\n\n  worker-1   slots=4   # second box\n")
    assert [(h.name, h.slots) for h in parse_hostfile(f)] == [("worker-0", 4), ("worker-1", 4)]


@pytest.mark.parametrize("text,line", [("a slots=2\nb slot=2\n", 2), ("a\n", 1), ("a slots=0\n", 1),
                                       ("a slots=2 extra\n", 1), ("# c\n\na slots=x\n", 3)])
def test_hostfile_bad_line(tmp_path, capsys, text, line):
    f = tmp_path / "hosts"
    f.write_text(text)
    with pytest.raises(ConfigError, match=rf"{f}:{line}: bad hostfile line .*expected 'HOSTNAME slots=N'"):
        parse_hostfile(f)
    assert main(["--hostfile", str(f), "--dry-run", "t.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{f}:{line}: bad hostfile line" in err


def test_hostfile_missing_empty_duplicate_unequal(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        parse_hostfile(tmp_path / "nope")
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="lists no hosts"):
        parse_hostfile(tmp_path / "empty")
    (tmp_path / "dup").write_text("a slots=1\na slots=1\n")
    with pytest.raises(ConfigError, match="dup:2: host 'a' is listed twice"):
        parse_hostfile(tmp_path / "dup")
    (tmp_path / "uneq").write_text("a slots=2\nb slots=4\n")
    with pytest.raises(ConfigError, match="same number of slots.*a=2, b=4"):
        launcher.build_plan(launcher.build_parser().parse_args(["--hostfile", str(tmp_path / "uneq"), "t.py"]), {})


def test_binary_hostfile_is_one_message(tmp_path, capsys):
    f = tmp_path / "hosts"
    f.write_bytes(b"\x81\xe8\x00garbage\xff" * 20)
    assert main(["--hostfile", str(f), "--dry-run", "t.py"]) == 2
    err = capsys.readouterr().err
    assert err == (f"zero3d launch: error: hostfile {f} is not text (byte 0 is not UTF-8); expected lines of "
                   f"{launcher.HOSTFILE_FORMAT}\n")


@pytest.mark.parametrize("flag,value,allowed", [("--nproc-per-node", "0", ">= 1"), ("--max-restarts", "-1", ">= 0"),
                                                ("--node-rank", "-1", ">= 0"), ("--master-port", "0", "in 1..65535")])
def test_bad_numbers_are_refused_not_replaced(capsys, flag, value, allowed):
    """A zero used to be read as "not given" and replaced by the default."""
    assert main([flag, value, "--dry-run", "t.py"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == f"zero3d launch: error: argument {flag}: must be a whole number {allowed}, got '{value}'"


def test_hostfile_ssh_dry_run(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    f = tmp_path / "hosts"
    f.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    out = dry_run(capsys, "--hostfile", str(f), "train.py", "--config", "ds.json")
    assert list(out) == ["worker-0", "worker-1"]
    for rank, (host, ssh) in enumerate(out.items()):
        assert ssh[:4] == ["ssh", "-o", "BatchMode=yes", host]
        remote = ssh[4]
        assert remote.startswith(f"cd {shlex.quote(str(Path.cwd()))} && exec env ")
        assert "OMP_NUM_THREADS=" in remote
        inner = shlex.split(remote[remote.index(sys.executable):])
        assert inner == torchrun_command(["train.py", "--config", "ds.json"], nproc_per_node=2, nnodes=2,
                                         node_rank=rank, master_addr="worker-0", master_port=29500)


def test_hostfile_with_node_rank_runs_own_part(tmp_path, capsys):
    f = tmp_path / "hosts"
    f.write_text("a slots=8\nb slots=8\nc slots=8\n")
    out = dry_run(capsys, "--hostfile", str(f), "--node-rank", "2", "--nproc-per-node", "4", "-m", "pkg.train", "-x")
    assert list(out) == ["a", "b", "c"]
    for rank, argv in enumerate(out.values()):
        assert torchrun_flags(argv) == {"--nproc-per-node": "4", "--nnodes": "3", "--node-rank": str(rank),
                                        "--master-addr": "a", "--master-port": "29500"}
        assert argv[-3:] == ["-m", "pkg.train", "-x"]


def test_include_exclude(tmp_path, capsys):
    hosts = [launcher.Host("a", 4), launcher.Host("b", 4), launcher.Host("c", 4)]
    assert [h.name for h in filter_hosts(hosts, exclude="b")] == ["a", "c"]
    assert [(h.name, h.nproc) for h in filter_hosts(hosts, include="a:0,1@c:2,3")] == [("a", 2), ("c", 2)]
    assert [(h.name, h.selected) for h in filter_hosts(hosts, exclude="a:0@b")] == [("a", (1, 2, 3)), ("c", None)]
    for kw, msg in [({"include": "z"}, "'z' is not among"), ({"include": "a:9"}, "slots 0..3"),
                    ({"include": "a", "exclude": "b"}, "mutually exclusive"), ({"exclude": "a@b@c"}, "leaves no hosts")]:
        with pytest.raises(ConfigError, match=msg):
            filter_hosts(hosts, **kw)
    f = tmp_path / "hosts"
    f.write_text("a slots=4\nb slots=4\n")
    line = capsys.readouterr() and None
    assert main(["--hostfile", str(f), "--include", "b:1,3", "--master-port", "1", "--dry-run", "t.py"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("b: CUDA_VISIBLE_DEVICES=1,3 ") and "--nproc-per-node 2 --nnodes 1" in line
    assert "--master-addr 127.0.0.1" in line
    assert main(["--include", "a", "--dry-run", "t.py"]) == 2
    assert "need a --hostfile" in capsys.readouterr().err


def test_expand_nodelist():
    assert expand_nodelist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_nodelist("gpu5,cpu[8-10],x") == ["gpu5", "cpu8", "cpu9", "cpu10", "x"]
    assert expand_nodelist("r[1-2]n[1,3]") == ["r1n1", "r1n3", "r2n1", "r2n3"]
    with pytest.raises(ConfigError, match="bad range"):
        expand_nodelist("n[a-b]")


def test_slurm_dry_run(capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-03,07]")
    monkeypatch.setenv("SLURM_NNODES", "4")
    monkeypatch.setenv("SLURM_NODEID", "2")
    monkeypatch.setenv("SLURM_PROCID", "2")
    out = dry_run(capsys, "--nproc-per-node", "8", "train.py", "--config", "ds.json")
    assert list(out) == ["node01", "node02", "node03", "node07"]
    for rank, argv in enumerate(out.values()):
        assert argv == torchrun_command(["train.py", "--config", "ds.json"], nproc_per_node=8, nnodes=4,
                                        node_rank=rank, master_addr="node01", master_port=29500)
    plan = launcher.build_plan(launcher.build_parser().parse_args(["t.py"]), dict(__import__("os").environ))
    assert plan.mode == "local" and plan.own == 2  # this node runs only its own part, started by srun
    monkeypatch.setenv("SLURM_NNODES", "3")
    assert main(["--dry-run", "t.py"]) == 2
    assert "Slurm says 3 nodes" in capsys.readouterr().err


@pytest.mark.parametrize("argv,msg", [
    (["--nproc-per-node", "x", "t.py"], "must be a whole number >= 1, got 'x'"),
    (["--nnodes", "2", "t.py"], "needs --master-addr"),
    (["--nnodes", "2", "--master-addr", "h", "--node-rank", "5", "t.py"], "--node-rank must be in [0, 2)"),
    (["--nproc-per-node", "2"], "required: script"),
])
def test_bad_arguments(capsys, argv, msg):
    assert main(["--dry-run", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_elastic_flags_dry_run(capsys):
    """--max-restarts or --nnodes MIN:MAX: torchrun's c10d rendezvous at node 0's address, one id for every node."""
    out = dry_run(capsys, "--nnodes", "1:2", "--max-restarts", "3", "--master-addr", "10.0.0.1", "--master-port", "6000",
                  "--nproc-per-node", "2", "t.py", "--lr", "1")
    argv = out["node0"]
    assert argv[argv.index("parallel3d.launch.agent") + 1:] == [
        "--nproc-per-node", "2", "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:6000",
        "--rdzv-id", "zero3d-10.0.0.1-6000", "--max-restarts", "3", "t.py", "--lr", "1"]
    restarts_only = dry_run(capsys, "--max-restarts", "1", "--master-port", "6001", "t.py")["node0"]
    assert restarts_only[restarts_only.index("--nnodes") + 1] == "1" and "--rdzv-backend" in restarts_only


@pytest.mark.parametrize("value", ["0", "3:2", "0:2", "a:b", "2:", ":2"])
def test_bad_node_range(capsys, value):
    assert main(["--nnodes", value, "--dry-run", "t.py"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"zero3d launch: error: argument --nnodes: must be N or MIN:MAX with 1 <= MIN <= MAX, got '{value}'")


def test_multinode_flags_dry_run(capsys):
    out = dry_run(capsys, "--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "6000",
                  "--nproc-per-node", "2", "t.py")
    assert list(out) == ["node0", "node1"]
    assert torchrun_flags(out["node1"])["--node-rank"] == "1"


def test_real_local_run(tmp_path, monkeypatch):
    """Two local workers through torchrun: they rendezvous and all-reduce; failures propagate."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "open(os.path.join(sys.argv[1], f'r{dist.get_rank()}'), 'w').write(f\"{t.item()} {os.environ['OMP_NUM_THREADS']}\")\n"
        "dist.destroy_process_group()\n"
        "sys.exit(int(sys.argv[2]))\n")
    assert main(["--nproc-per-node", "2", str(script), str(tmp_path), "0"]) == 0
    for r in range(2):
        total, threads = (tmp_path / f"r{r}").read_text().split()
        assert float(total) == 3.0 and int(threads) >= 1
    assert launcher.run_local([str(script), str(tmp_path), "3"], 2) != 0


def test_ssh_runner_starts_every_node(tmp_path, monkeypatch):
    """The ssh runner for real, with ssh replaced by a local shell: two 'nodes' on this machine
    rendezvous through node 0 (nnodes=2); when one node fails, the others are stopped."""
    monkeypatch.setattr(launcher, "ssh_command", _local_shell(launcher.ssh_command))
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == int(sys.argv[2]): sys.exit(3)\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
        "open(os.path.join(sys.argv[1], f'r{dist.get_rank()}'), 'w').write(str(t.item()))\n"
        "dist.destroy_process_group()\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port = str(launcher.free_port())
    assert main(["--hostfile", str(hosts), "--master-port", port, str(script), str(tmp_path), "-1"]) == 0
    assert [(tmp_path / f"r{r}").read_text() for r in range(2)] == ["2.0", "2.0"]
    port = str(launcher.free_port())
    assert main(["--hostfile", str(hosts), "--master-port", port, str(script), str(tmp_path), "1"]) != 0


def _local_shell(ssh_command):
    def command(node, env, cwd):
        argv = ssh_command(node, env, cwd)
        return ["sh", "-c", argv[-1]]  # drop the host: run the remote command here
    return command
