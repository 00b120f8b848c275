"""Mixture-of-experts models under megalm's layouts (megalm/model/moe.py holds the layer, free of collectives).

What composes today, each proven against one process on gloo: data parallelism (ZeRO-1 too), pipeline stages (the
balancing losses of a stage that is not the last reach the gradient through the layer's scaler; the load counts
are summed over the stages with the loss), recomputation and activation offload. The layouts whose token split
would change what one MoE layer sees of a micro-batch (TP, SP, CP, HDP), FSDP, and zero-bubble schedules are
refused with one line until they are built and proven.
"""

from __future__ import annotations

from megalm.config import MegalmConfig
from megalm.errors import ConfigError


def validate_experts(cfg: MegalmConfig) -> None:
    """The layouts an MoE model (`model.moe.num_experts` > 0) may run under today (one-line errors)."""
    if not cfg.model.moe.num_experts:
        return
    p = cfg.parallel
    refused = {"parallel.tp>1": p.tp > 1, "parallel.cp>1": p.cp > 1, "parallel.hdp=true": p.hdp,
               "parallel.fsdp=true": p.fsdp, "parallel.pp_schedule=zb": p.pp > 1 and p.pp_schedule == "zb"}
    for setting, on in refused.items():
        if on:
            raise ConfigError(f"{setting} does not run mixture-of-experts models yet (model.moe.num_experts="
                              f"{cfg.model.moe.num_experts}); use data or pipeline parallelism, or a dense model")
