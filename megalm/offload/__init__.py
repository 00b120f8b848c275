"""Activation offload: a step's saved activations moved to host memory and back, bit-exactly.

- `store.py`   saved-tensor hooks per group, the copies (CUDA side streams and events), byte accounting;
- `pool.py`    the reusable (pinned) host buffers;
- `policy.py`  which micro-batches / blocks to offload, and the memory the schedule leaves on the device;
- `hooks.py`   the two runners' plugs: `PipelineOffload` (OFFLOAD/RELOAD actions in the pipeline schedule,
               PipeOffload) and `LayerOffload` (pp = 1: blocks offloaded in forward, reloaded one ahead).

Hand-written: torch's `save_on_cpu` hook copies every saved tensor synchronously at save time and back at
use, with no schedule, no streams, no pool and no choice of what to offload, which is all that matters here.
`validate_offload` checks `cfg.offload`.
"""

from __future__ import annotations

import logging

from megalm.config import MegalmConfig, choice, schema_default, set_away_from_default
from megalm.config.schema import OffloadConfig
from megalm.errors import ConfigError
from megalm.offload.hooks import LayerOffload, PipelineOffload
from megalm.offload.policy import POLICIES
from megalm.offload.pool import HostPool
from megalm.offload.store import ActivationStore

log = logging.getLogger(__name__)

__all__ = ["ActivationStore", "HostPool", "LayerOffload", "PipelineOffload", "unread_offload_settings",
           "validate_offload"]


def validate_offload(cfg: MegalmConfig) -> None:
    """The rules of `cfg.offload`, alone and with the layout, as one-line ConfigErrors."""
    o, p = cfg.offload, cfg.parallel
    if not o.enabled:
        if unread := set_away_from_default(o, OffloadConfig):
            log.warning(f"offload: {', '.join(unread)} set with offload.enabled=false: not used "
                        "(offload.enabled=true offloads)")
        return
    choice(o.policy, "offload.policy", POLICIES)
    if not 0.0 < o.fraction <= 1.0:
        raise ConfigError(f"offload.fraction={o.fraction} must be in (0, 1]; it is the share of micro-batches "
                          "(pp>1) or transformer blocks (pp=1) offloaded")
    if o.min_tensor_bytes < 0:
        raise ConfigError(f"offload.min_tensor_bytes={o.min_tensor_bytes} must be >= 0")
    if p.pp == 1 and o.policy != "uniform":
        raise ConfigError(f"offload.policy={o.policy} picks pipeline micro-batches; with parallel.pp=1 blocks are "
                          "offloaded by offload.fraction: drop offload.policy or use parallel.pp>1")
    if p.hdp and p.hdp_offload and o.policy != "uniform":
        raise ConfigError(f"offload.policy={o.policy} picks pipeline micro-batches; with parallel.hdp_offload=true "
                          "each long document offloads its own r(s) of the blocks: drop offload.policy")


def unread_offload_settings(cfg: MegalmConfig) -> list[str]:
    """What the run's offload will not do although the config asks it (one log line each, said when the offload is
    attached): the layout decides instead, or compiled blocks keep what the store would recompute."""
    o, p = cfg.offload, cfg.parallel
    if not o.enabled:
        return []
    notes = []
    if o.fraction != schema_default(OffloadConfig, "fraction"):
        if p.hdp and p.hdp_offload:
            notes.append(f"offload.fraction={o.fraction} is not read with parallel.hdp_offload=true: each long "
                         "document offloads its own r(s) of the blocks (docs/hdp.md)")
        elif p.pp > 1 and o.policy == "auto":
            notes.append(f"offload.fraction={o.fraction} is not read by offload.policy=auto: it offloads min(1, 1/k) "
                         "of the micro-batches, k from the cost model; use offload.policy=uniform for a fraction")
    if o.recompute_cheap and cfg.trainer.compile:
        notes.append("offload.recompute_cheap=true does not act in compiled blocks: they save GELU's output inside "
                     "their graph, where the store sees no GELU to recompute, so it is offloaded like the rest "
                     "(trainer.compile=false recomputes it)")
    return notes
