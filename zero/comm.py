"""The two equal-chunk collectives ZeRO is built on, under their current torch names.

torch 2.13 renamed ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` to
``reduce_scatter_single`` / ``all_gather_single`` (the old names warn on every call);
older releases only have the old names.
"""

from __future__ import annotations

import torch.distributed as dist

reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
