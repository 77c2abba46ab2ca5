"""``zero3d launch``: start a training script on one or many nodes through torchrun.

We do not write a process manager: every node runs torchrun's agent (through
``python -m parallel3d.launch.agent``, which takes torchrun's arguments and ends cleanly on signals)
with the static rendezvous flags (``--nnodes/--node-rank/--master-addr/--master-port``), or
the c10d rendezvous when the job is elastic (``--max-restarts``, ``--nnodes MIN:MAX``), and
this module only works out those flags from the command line, a DeepSpeed-style hostfile or
the Slurm environment. With a multi-host hostfile and no Slurm, the head node starts each
node's torchrun over ssh (like DeepSpeed's ssh runner); under Slurm, ``srun`` has already put
one ``zero3d launch`` on every node, so each starts only its own torchrun. Locally the agent
runs under `parallel3d.runtime.lifeline.run_supervised`: stop signals are forwarded and nothing the job
started outlives the launcher.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from parallel3d.errors import ConfigError
from parallel3d.runtime.lifeline import STOP_SIGNALS, run_supervised

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29500
SSH = ["ssh", "-o", "BatchMode=yes"]  # no password prompts: fail fast when keys are not set up
# Environment variables forwarded to remote nodes over ssh (prefix match), like DeepSpeed's
# EXPORT_ENVS: the worker needs the same Python path, thread and communication settings.
EXPORT_PREFIXES = ("PYTHON", "OMP_", "NCCL_", "GLOO_", "TORCH_", "CUDA_", "HF_", "TRANSFORMERS_", "DS_", "ZERO3D_")


def torchrun_command(
    target: list[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = DEFAULT_PORT,
    module: bool = False,
    min_nodes: int | None = None,
    max_restarts: int = 0,
    rdzv_id: str = "zero3d",
) -> list[str]:
    """The exact argv that runs ``target`` (a script and its args, or a module with ``module``).

    With ``max_restarts`` > 0 or fewer ``min_nodes`` than ``nnodes`` the job is elastic: torchrun's
    c10d rendezvous at ``master_addr:master_port`` (hosted by the agent there) instead of the
    static one, so the agent can restart the workers after one dies and a new round may have
    fewer nodes; ``--node-rank`` is then the rendezvous' to decide.
    """
    if not target:
        raise ConfigError("launch needs a training script (or -m module) to run")
    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank must be in [0, nnodes={nnodes}), got {node_rank}")
    if not 0 < master_port < 65536:
        raise ConfigError(f"--master-port must be in 1..65535, got {master_port}")
    min_nodes = nnodes if min_nodes is None else min_nodes
    if not 1 <= min_nodes <= nnodes:
        raise ConfigError(f"--nnodes {min_nodes}:{nnodes}: the minimum must be in 1..{nnodes} (the maximum)")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    cmd = [sys.executable, "-m", "parallel3d.launch.agent", "--nproc-per-node", str(nproc_per_node)]
    if max_restarts or min_nodes < nnodes:
        cmd += ["--nnodes", f"{min_nodes}:{nnodes}" if min_nodes < nnodes else str(nnodes),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master_addr}:{master_port}", "--rdzv-id", rdzv_id,
                "--max-restarts", str(max_restarts)]
    else:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", master_addr,
                "--master-port", str(master_port)]
    if module:
        cmd.append("-m")
    return cmd + list(target)


def worker_env(nproc_per_node: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with OMP_NUM_THREADS set if unset.

    torchrun would set it to 1 with a warning; splitting this node's cores among its workers
    is a better default on CPU, where the threads do the actual work.
    """
    env = dict(os.environ if base is None else base)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc_per_node))
    return env


def free_port() -> int:
    """A TCP port free on this machine now (for single-node runs, which own the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_local(target: list[str], nproc_per_node: int, module: bool = False, max_restarts: int = 0) -> int:
    """Run ``target`` on this machine under torchrun with ``nproc_per_node`` workers.

    Uses a free port rather than 29500 so two local runs (or tests) do not collide. With
    ``max_restarts`` the agent restarts all workers (up to that many times) after one fails.
    """
    port = free_port()
    cmd = torchrun_command(target, nproc_per_node=nproc_per_node, master_port=port, module=module,
                           max_restarts=max_restarts, rdzv_id=f"zero3d-local-{port}")
    logger.info("running %s", shlex.join(cmd))
    return run_supervised(cmd, worker_env(nproc_per_node))


# -- hosts: DeepSpeed hostfile, --include/--exclude, Slurm nodelist ------------------------

HOSTFILE_FORMAT = "'HOSTNAME slots=N' (N >= 1), a '# comment' or a blank line"


@dataclass(frozen=True)
class Host:
    """One node: its name, how many worker slots it has, and which slots were selected."""

    name: str
    slots: int
    selected: tuple[int, ...] | None = None  # from --include/--exclude host:0,1 (device indices)

    @property
    def nproc(self) -> int:
        return self.slots if self.selected is None else len(self.selected)


def parse_hostfile(path: str | os.PathLike) -> list[Host]:
    """Hosts of a DeepSpeed hostfile; a bad line is one error naming file, line and format."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"hostfile {path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"hostfile {path} is not text (byte {exc.start} is not UTF-8); expected lines of "
                          f"{HOSTFILE_FORMAT}") from None
    hosts: dict[str, Host] = {}
    for lineno, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
        if match is None or int(match[2]) < 1:
            raise ConfigError(f"{path}:{lineno}: bad hostfile line {raw.strip()!r}; expected {HOSTFILE_FORMAT}")
        if match[1] in hosts:
            raise ConfigError(f"{path}:{lineno}: host {match[1]!r} is listed twice")
        hosts[match[1]] = Host(match[1], int(match[2]))
    if not hosts:
        raise ConfigError(f"hostfile {path} lists no hosts; expected lines of {HOSTFILE_FORMAT}")
    return list(hosts.values())


def _parse_selection(spec: str, flag: str) -> dict[str, tuple[int, ...] | None]:
    """DeepSpeed's ``host1@host2:0,2`` syntax: host -> selected slots (None = all)."""
    out: dict[str, tuple[int, ...] | None] = {}
    for part in filter(None, spec.split("@")):
        name, _, slots = part.partition(":")
        try:
            out[name] = tuple(int(s) for s in slots.split(",")) if slots else None
        except ValueError:
            raise ConfigError(f"{flag} {spec!r}: slots must be integers, as in 'host1@host2:0,2'") from None
    if not out:
        raise ConfigError(f"{flag} {spec!r} names no host; expected e.g. 'host1@host2:0,2'")
    return out


def filter_hosts(hosts: list[Host], include: str | None = None, exclude: str | None = None) -> list[Host]:
    """Apply ``--include`` (keep only these hosts/slots) or ``--exclude`` (drop them)."""
    if include and exclude:
        raise ConfigError("--include and --exclude are mutually exclusive")
    spec, flag = (include, "--include") if include else (exclude, "--exclude")
    if not spec:
        return hosts
    sel = _parse_selection(spec, flag)
    by_name = {h.name: h for h in hosts}
    for name, slots in sel.items():
        if name not in by_name:
            raise ConfigError(f"{flag}: host {name!r} is not among the hosts {sorted(by_name)}")
        bad = [s for s in slots or () if not 0 <= s < by_name[name].slots]
        if bad:
            raise ConfigError(f"{flag}: {name} has slots 0..{by_name[name].slots - 1}, not {bad}")
    out = []
    for h in hosts:
        if include:
            if h.name in sel:
                out.append(h if sel[h.name] is None else replace(h, selected=tuple(sorted(set(sel[h.name])))))
        elif h.name not in sel:
            out.append(h)
        elif sel[h.name] is not None:
            keep = tuple(s for s in range(h.slots) if s not in sel[h.name])
            if keep:
                out.append(replace(h, selected=keep))
    if not out:
        raise ConfigError(f"{flag} {spec!r} leaves no hosts")
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed nodelist -> host names: ``node[01-03,07],gpu1`` -> node01, node02, ...

    Written out because ``scontrol show hostnames`` is not always there; keeps zero padding
    and handles several bracket groups in one name (``r[1-2]n[1-2]``).
    """
    names: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        match = re.search(r"\[([^\]]*)\]", item)
        if match is None:
            names.append(item)
            continue
        head, tail = item[: match.start()], item[match.end() :]
        for rng in match[1].split(","):
            lo, _, hi = rng.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ConfigError(f"cannot expand Slurm nodelist {nodelist!r}: bad range {rng!r}")
            for i in range(int(lo), int(hi or lo) + 1):
                names.extend(expand_nodelist(f"{head}{i:0{len(lo)}d}{tail}"))
    return names


def slurm_info(env: Mapping[str, str]) -> tuple[list[str], int] | None:
    """Node list and this node's rank from ``SLURM_*`` (the step's values when inside srun).

    One ``zero3d launch`` must run per node (``srun --ntasks-per-node=1 zero3d launch ...``);
    each then starts only its own node's torchrun.
    """
    if "SLURM_JOB_ID" not in env:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    hosts = expand_nodelist(nodelist)
    nnodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    if nnodes and int(nnodes) != len(hosts):
        raise ConfigError(f"Slurm says {nnodes} nodes but its nodelist {nodelist!r} has {len(hosts)}")
    node_rank = int(env.get("SLURM_NODEID") or env.get("SLURM_PROCID") or 0)
    return hosts, node_rank


# -- plan: what runs where -----------------------------------------------------------------

@dataclass(frozen=True)
class NodeCommand:
    host: str
    node_rank: int
    argv: list[str]
    env: dict[str, str]  # extra variables for this node (CUDA_VISIBLE_DEVICES from a slot selection)


@dataclass(frozen=True)
class Plan:
    nodes: list[NodeCommand]
    mode: str  # "local": run nodes[own] here; "ssh": start every node over ssh
    own: int | None  # index of this machine's node in local mode


def build_plan(args: argparse.Namespace, env: Mapping[str, str]) -> Plan:
    """Resolve flags, hostfile and Slurm into one torchrun command per node.

    Precedence: explicit flags, then the hostfile, then Slurm, then single-node defaults.
    """
    slurm = slurm_info(env)
    hosts: list[Host] | None = None
    if args.hostfile:
        hosts = filter_hosts(parse_hostfile(args.hostfile), args.include, args.exclude)
        counts = {h.nproc for h in hosts}
        if len(counts) > 1:
            raise ConfigError(f"hostfile {args.hostfile}: every host needs the same number of slots, got "
                              + ", ".join(f"{h.name}={h.nproc}" for h in hosts))
        slots = counts.pop()
        if args.nproc_per_node is not None and args.nproc_per_node > slots:
            raise ConfigError(f"--nproc-per-node {args.nproc_per_node} exceeds the hostfile's slots={slots}")
    elif slurm is not None:
        slots = args.nproc_per_node if args.nproc_per_node is not None else 1
        hosts = filter_hosts([Host(h, slots) for h in slurm[0]], args.include, args.exclude)
    elif args.include or args.exclude:
        raise ConfigError("--include/--exclude need a --hostfile (or a Slurm allocation)")
    nproc = args.nproc_per_node if args.nproc_per_node is not None else (hosts[0].nproc if hosts else 1)
    min_nodes, max_nodes = args.nnodes if args.nnodes is not None else (None, None)
    nnodes = len(hosts) if hosts else (max_nodes if max_nodes is not None else 1)
    if hosts and max_nodes is not None and max_nodes != nnodes:
        raise ConfigError(f"--nnodes {max_nodes} disagrees with the {nnodes} hosts of the "
                          + ("hostfile" if args.hostfile else "Slurm nodelist"))
    if not hosts and nnodes > 1 and not args.master_addr:
        raise ConfigError(f"--nnodes {nnodes} needs --master-addr (the address of node 0), or use --hostfile")
    master = args.master_addr or (hosts[0].name if hosts and nnodes > 1 else "127.0.0.1")
    port = args.master_port if args.master_port is not None else (free_port() if nnodes == 1 else DEFAULT_PORT)
    names = [h.name for h in hosts] if hosts else [f"node{r}" for r in range(nnodes)]
    # every node's agent must name the same rendezvous: the Slurm job, or node 0's address
    rdzv_id = f"zero3d-slurm-{env['SLURM_JOB_ID']}" if slurm is not None else f"zero3d-{master}-{port}"
    target = [args.script, *args.script_args]
    nodes = []
    for rank in range(nnodes):
        extra = {}
        if hosts and hosts[rank].selected is not None:
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, hosts[rank].selected[:nproc]))
        argv = torchrun_command(target, nproc_per_node=nproc, nnodes=nnodes, node_rank=rank,
                                master_addr=master, master_port=port, module=args.module, min_nodes=min_nodes,
                                max_restarts=args.max_restarts, rdzv_id=rdzv_id)
        nodes.append(NodeCommand(names[rank], rank, argv, extra))
    source = "--node-rank"
    if args.node_rank is not None:
        own = args.node_rank
    elif slurm is not None:
        own, source = slurm[1], "SLURM_NODEID"
    elif nnodes > 1 and args.hostfile:
        return Plan(nodes, "ssh", None)
    else:
        own = 0
    if not 0 <= own < nnodes:
        raise ConfigError(f"{source} must be in [0, {nnodes}) for {nnodes} nodes, got {own}")
    return Plan(nodes, "local", own)


def ssh_command(node: NodeCommand, env: Mapping[str, str], cwd: str) -> list[str]:
    """How the head node starts ``node`` remotely: ssh, cd to the same (shared) directory,
    forward the relevant environment, run torchrun with the same Python path."""
    exports = {k: v for k, v in env.items() if k.startswith(EXPORT_PREFIXES)} | node.env
    assigns = [f"{k}={shlex.quote(v)}" for k, v in sorted(exports.items())]
    if "OMP_NUM_THREADS" not in exports:  # split the remote node's cores among its workers
        n = node.argv[node.argv.index("--nproc-per-node") + 1]
        assigns.append(f'OMP_NUM_THREADS="$(( $(nproc) / {n} > 1 ? $(nproc) / {n} : 1 ))"')
    remote = f"cd {shlex.quote(cwd)} && exec env {' '.join(assigns)} {shlex.join(node.argv)}"
    return [*SSH, node.host, remote]


def _run_ssh(plan: Plan, env: Mapping[str, str]) -> int:
    """Start every node over ssh; if one fails or a stop signal comes, stop the others.

    Returns the failed node's exit code (128 + the signal after a stop signal). Ending an ssh
    client ends its remote session, and the remote agent dies with it (`parallel3d.launch.agent`).
    """
    procs = [subprocess.Popen(ssh_command(n, env, os.getcwd()), env=dict(env)) for n in plan.nodes]
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in STOP_SIGNALS}
    try:
        while not received:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(0.5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    failed = [128 + received[0]] if received else failed
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        p.wait()
    return failed[0] if failed else 0


# -- command line --------------------------------------------------------------------------

def whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high]; anything else is one usage error saying so
    (``--nproc-per-node 0`` used to be read as "not given")."""
    allowed = f">= {low}" if high is None else f"in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be a whole number {allowed}, got {text!r}")
        return value

    return parse


def node_range(text: str) -> tuple[int, int]:
    """An argparse type for ``--nnodes``: ``N`` -> (N, N), ``MIN:MAX`` -> (MIN, MAX), 1 <= MIN <= MAX."""
    low, colon, high = text.partition(":")
    try:
        low_n, high_n = int(low), int(high if colon else low)
    except ValueError:
        low_n = high_n = 0
    if not 1 <= low_n <= high_n:
        raise argparse.ArgumentTypeError(f"must be N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return low_n, high_n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zero3d launch", allow_abbrev=False,
        description="Run a training script on one or many nodes through torchrun "
                    "(hostfile in DeepSpeed's format, or Slurm's SLURM_* variables).")
    p.add_argument("--nproc-per-node", type=whole_number(1), help="workers per node (default: hostfile slots, else 1)")
    p.add_argument("--nnodes", type=node_range, metavar="N|MIN:MAX",
                   help="number of nodes (default: hosts in the hostfile/Slurm, else 1); MIN:MAX lets the job go on "
                        "with as few as MIN nodes after it loses some (elastic, with --max-restarts)")
    p.add_argument("--node-rank", type=whole_number(0), help="this node's rank: run only its part (no ssh)")
    p.add_argument("--master-addr", help="node 0's address (default: first host, else 127.0.0.1)")
    p.add_argument("--master-port", type=whole_number(1, 65535),
                   help=f"rendezvous port (default {DEFAULT_PORT}; a free one on one node)")
    p.add_argument("--max-restarts", type=whole_number(0), default=0,
                   help="restart all workers up to this many times after one fails (default 0)")
    p.add_argument("--hostfile", help="DeepSpeed hostfile: lines of 'HOSTNAME slots=N'")
    p.add_argument("--include", help="only these hosts/slots, e.g. 'host1@host2:0,1'")
    p.add_argument("--exclude", help="leave out these hosts/slots, e.g. 'host3' or 'host1:0'")
    p.add_argument("--dry-run", action="store_true", help="print each node's command and exit")
    p.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, default=[], help="arguments of the training script")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``zero3d launch``; returns the exit code (2 for bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage and the message
        return int(exc.code or 0)
    env = dict(os.environ)
    try:
        plan = build_plan(args, env)
    except ConfigError as exc:
        print(f"zero3d launch: error: {exc}", file=sys.stderr)
        return 2
    nproc = int(plan.nodes[0].argv[plan.nodes[0].argv.index("--nproc-per-node") + 1])
    if args.dry_run:
        for node in plan.nodes:
            cmd = ssh_command(node, env, os.getcwd()) if plan.mode == "ssh" else node.argv
            prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in node.env.items()) if plan.mode == "local" else ""
            print(f"{node.host}: {prefix}{shlex.join(cmd)}")
        return 0
    if plan.mode == "ssh":
        return _run_ssh(plan, env)
    node = plan.nodes[plan.own]
    logger.info("node %s (rank %d of %d): %s", node.host, node.node_rank, len(plan.nodes), shlex.join(node.argv))
    return run_supervised(node.argv, worker_env(nproc, env) | node.env)


if __name__ == "__main__":  # python -m parallel3d.launch.launcher ARGS runs as zero3d does
    sys.exit(main())
