"""Every config rule of a run, each package checking its own section.

`megalm.config.validate` owns the model, trainer, optim, data and logging sections; the precision
package checks `precision` (`validate_precision`), the parallel package the layout against the world
size (`validate_parallel`), the offload package `offload` (`validate_offload`). This is the one place
that runs them all, above every package it asks.
"""

from __future__ import annotations

from megalm.config import MegalmConfig, validate
from megalm.offload import validate_offload
from megalm.parallel.parallelism import validate_parallel
from megalm.precision import validate_precision


def validate_run(cfg: MegalmConfig, world_size: int = 1) -> MegalmConfig:
    """Check every rule for a run on `world_size` processes; fill derived defaults (model sizes,
    `parallel.dp`, `parallel.hdp_capacity`). Returns the same (mutated) config."""
    validate(cfg)
    validate_parallel(cfg, world_size)
    validate_precision(cfg)
    validate_offload(cfg)
    return cfg
