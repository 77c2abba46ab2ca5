"""Devices and links as the planner's time model sees them: a roofline per op, alpha-beta per link.

* Compute: an op takes ``max(FLOPs / (peak x compute_efficiency), bytes / (memory bandwidth x
  memory_efficiency))`` (the roofline); FLOPs and bytes come from the fake-tensor profile.
* Collectives: ``steps x latency + payload x wire_factor / bandwidth`` per call, ``wire_factor``
  being ``comm_counter``'s ring accounting (2 (n-1)/n for an all-reduce...), ``steps`` the ring's
  hops (2 (n-1) for an all-reduce, n - 1 for a reduce-scatter or all-gather, 1 for a p2p).
* Links per mesh axis. Ranks are laid out tp fastest, then dp, then pp (``parallel3d.runtime.mesh``), so a
  group of ``size`` ranks ``stride`` apart sits inside one node when ``stride x size <= gpus per
  node`` and then moves over NVLink. Otherwise its ring crosses nodes; the ``k = gpus_per_node /
  stride`` members it has in each node share the node's network cards with the other groups of
  that axis, one card per GPU, so it moves ``k x network_bandwidth`` per node hop (NCCL runs one
  ring per card), never more than NVLink.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parallel3d.runtime.comm_counter import wire_factor
from parallel3d.errors import ConfigError


def ring_steps(op: str, n: int) -> int:
    """Latency-bound hops of a ring collective on ``n`` ranks (1 for point-to-point)."""
    if op in ("send", "recv"):
        return 1
    if n <= 1:
        return 0
    return 2 * (n - 1) if op == "all_reduce" else n - 1


@dataclass(frozen=True)
class Link:
    """One mesh axis's link: bandwidth per GPU (bytes/s, one direction) and latency per hop (s)."""

    bandwidth: float
    latency: float

    def seconds(self, op: str, payload: float, n: int) -> float:
        """Time of one collective of ``payload`` bytes (comm_counter's payload convention) on ``n`` ranks."""
        return ring_steps(op, n) * self.latency + payload * wire_factor(op, n) / self.bandwidth


@dataclass(frozen=True)
class Hardware:
    """A cluster of identical devices. Rates in FLOP/s and bytes/s, sizes in bytes, latencies in s."""

    name: str
    gpus: int
    gpus_per_node: int
    memory: float
    peak_flops: float
    memory_bandwidth: float
    nvlink: Link
    network: Link
    compute_efficiency: float = 0.75
    memory_efficiency: float = 0.8
    foreach_optimizer: bool = True  # torch.optim's foreach path (CUDA): one master-sized temporary
    attention: str = "flash"  # how scaled_dot_product_attention runs (profile.ATTENTION)

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"device count {self.gpus} and devices per node {self.gpus_per_node} must be >= 1")
        if self.memory <= 0:
            raise ConfigError(f"device memory must be positive, got {self.memory} bytes")
        for name in ("compute_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"{name.replace('_', ' ')} must be in (0, 1], got {value}")

    def with_devices(self, gpus: int, gpus_per_node: int | None = None, memory: float | None = None) -> Hardware:
        return replace(self, gpus=gpus, gpus_per_node=gpus_per_node or self.gpus_per_node,
                       memory=memory if memory is not None else self.memory)

    @property
    def flop_rate(self) -> float:
        """FLOP/s that matrix products reach: no op runs faster (the floor of `op_seconds`)."""
        return self.peak_flops * self.compute_efficiency

    def op_seconds(self, flops: float, moved: float) -> float:
        """The roofline time of one op."""
        return max(flops / self.flop_rate, moved / (self.memory_bandwidth * self.memory_efficiency))

    def link(self, stride: int, size: int) -> Link:
        """The link of a group of ``size`` ranks ``stride`` apart (see the module docstring)."""
        if stride * size <= self.gpus_per_node:
            return self.nvlink
        per_node = max(1, self.gpus_per_node // stride)
        return Link(min(self.nvlink.bandwidth, per_node * self.network.bandwidth), self.network.latency)


def a100(gpus: int = 8, gpus_per_node: int = 8) -> Hardware:
    """DGX A100 (80 GB): 312 TFLOP/s bf16, 2.0 TB/s HBM, NVLink 300 GB/s per direction per GPU, one
    200 Gb/s InfiniBand card (25 GB/s) per GPU (the numbers of Narayanan et al. 2021, Selene)."""
    return Hardware("A100-80GB", gpus, gpus_per_node, 80e9, 312e12, 2.039e12, Link(300e9, 5e-6), Link(25e9, 10e-6))


def h100(gpus: int = 8, gpus_per_node: int = 8) -> Hardware:
    """DGX H100 (80 GB): 989 TFLOP/s bf16 dense, 3.35 TB/s HBM, NVLink 450 GB/s per direction, one
    400 Gb/s card (50 GB/s) per GPU."""
    return Hardware("H100-80GB", gpus, gpus_per_node, 80e9, 989e12, 3.35e12, Link(450e9, 5e-6), Link(50e9, 10e-6))



def cpu(gpus: int = 1) -> Hardware:
    """This machine's CPU as a "device", for memory predictions checked on CPU runs (its rates are
    nominal, not measured: do not read step times from it). torch.optim steps per tensor on CPU."""
    return Hardware("CPU", gpus, gpus, 64e9, 1e12, 20e9, Link(10e9, 20e-6), Link(10e9, 20e-6),
                    foreach_optimizer=False, attention="native")


PRESETS = {"a100": a100, "h100": h100}
