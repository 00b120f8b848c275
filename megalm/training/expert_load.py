"""The step's mixture-of-experts numbers: per-layer expert load, dropped tokens and balancing losses, read once per
step with the loss (no sync of their own), and the aux-loss-free bias update they drive.

Each MoE block accumulates over its micro-batches the assignments each expert kept, the dropped ones and the
unweighted token-sums of the three balancing losses (megalm/model/moe.py). `take` lays them out as one row per MoE
layer of the whole model (zeros for the layers another pipeline stage holds), so that the step's sum over the batch
(over TP first under sequence parallelism, where each TP rank routed its own tokens; then DP x CP, then the pipeline
stages) gives every rank the whole batch's counts of every layer. From them:

- `update_bias` moves each expert's selection bias toward uniform load, b_e += rate · sign(mean_e load - load_e)
  (DeepSeek-V3 §2.1.2), on every rank alike, after an optimizer step that was not skipped;
- `record` gives metrics.jsonl `moe_load` (max / mean load per MoE layer: 1 is uniform), `moe_dropped` (the
  fraction of assignments dropped by the capacity factor) and the balancing losses per token, averaged over the
  layers (`moe_aux_loss`, `moe_seq_aux_loss`, `moe_z_loss`, those switched on).
"""

from __future__ import annotations

import torch
from torch import nn

from megalm.config import ModelConfig, moe_layer_ids
from megalm.model.moe import moe_modules

LOSSES = ("moe_aux_loss", "moe_seq_aux_loss", "moe_z_loss")
COEFFS = ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff")


class ExpertLoad:
    """The MoE rows of a model (none for a dense one)."""

    def __init__(self, model: nn.Module, cfg: ModelConfig):
        self.cfg = cfg.moe
        self.rows = {layer: i for i, layer in enumerate(moe_layer_ids(cfg))}
        self.modules = moe_modules(model)
        self.width = self.cfg.num_experts + 4  # load per expert, dropped, three losses

    def take(self, device: torch.device) -> torch.Tensor:
        """This rank's step counts, flat [rows x width] float64, and the blocks' accumulators cleared."""
        values = torch.zeros(len(self.rows), self.width, dtype=torch.float64, device=device)
        for layer, module in self.modules.items():
            values[self.rows[layer]] = module.stats
            module.stats.zero_()
        return values.flatten()

    @torch.no_grad()
    def update_bias(self, totals: torch.Tensor) -> None:
        """Aux-loss-free balancing from the whole batch's counts (`take`'s layout, summed over the batch)."""
        rate = self.cfg.bias_update_rate
        if not rate or not self.rows:
            return
        load = totals.view(len(self.rows), self.width)[:, : self.cfg.num_experts]
        for layer, module in self.modules.items():
            row = load[self.rows[layer]]
            module.router.expert_bias += rate * torch.sign(row.mean() - row).float()

    def record(self, totals: list[float], loss_tokens: float) -> dict[str, object]:
        """The metrics of the step from the summed counts (read on the host with the loss)."""
        if not self.rows:
            return {}
        E = self.cfg.num_experts
        rows = [totals[i * self.width:(i + 1) * self.width] for i in range(len(self.rows))]
        loads = [max(r[:E]) / max(sum(r[:E]) / E, 1e-12) for r in rows]
        kept, dropped = sum(sum(r[:E]) for r in rows), sum(r[E] for r in rows)
        out: dict[str, object] = {"moe_load": [round(x, 4) for x in loads],
                                  "moe_dropped": dropped / max(kept + dropped, 1)}
        for j, (name, coeff) in enumerate(zip(LOSSES, COEFFS, strict=True)):
            if getattr(self.cfg, coeff):
                out[name] = sum(r[E + 1 + j] for r in rows) / len(rows) / max(loss_tokens, 1)
        return out
