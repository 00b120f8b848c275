"""What the trainer, the precision recipes and the checkpoints read of a torch optimizer, for megalm's own optimizers
over the reducer's buckets (BucketAdamW: ZeRO-1 and fp32 main weights; LayerwiseOptimizer: ZeRO-1 by whole
parameters). Not a torch.optim.Optimizer subclass: those keep per-parameter state keyed by the parameters, where these
keep flat buckets, or a rank's own parameters' state only."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def fused_adamw_kernel(implementation: str, device: torch.device) -> bool:
    """Whether torch's fused AdamW kernel steps (`optim.implementation`: fused, or auto on a CPU or CUDA device)
    rather than its foreach kernels."""
    return implementation == "fused" or (implementation == "auto" and device.type in ("cpu", "cuda"))


def matrix_parameter_ids(param_groups: list[dict]) -> set[int]:
    """The ids of the parameters in param groups marked `"muon": True`: the matrices Muon steps, whose state is a
    `momentum_buffer` where AdamW's is two moments."""
    return {id(p) for group in param_groups if group.get("muon") for p in group["params"]}


class TorchOptimizerFace:
    """`param_groups` (dicts with "params" and the settings, so `set_lr` and per-group weight decay work),
    `zero_grad`, `register_step_pre_hook` and `register_step_post_hook` (recipes count steps with them), and the
    param groups of a torch-format state dict, indexed in param-group order."""

    def _set_param_groups(self, params: Iterable[nn.Parameter] | Iterable[dict], defaults: dict) -> None:
        params = list(params)
        if params and not isinstance(params[0], dict):
            params = [{"params": params}]
        self.param_groups: list[dict] = [{**defaults, **group, "params": list(group["params"]),
                                          "betas": tuple(group.get("betas", defaults["betas"]))} for group in params]
        self._pre_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()  # RemovableHandle's weakref
        self._post_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self.matrix_ids = matrix_parameter_ids(self.param_groups)

    def _state_keys(self, p: nn.Parameter) -> tuple[str, ...]:
        """The state tensors of `p` (besides AdamW's step count): Muon's momentum for a matrix, AdamW's two moments
        otherwise."""
        return ("momentum_buffer",) if id(p) in self.matrix_ids else ("exp_avg", "exp_avg_sq")

    def _checked_state(self, index: int, p: nn.Parameter, saved: dict) -> tuple[str, ...]:
        """`p`'s state keys, each checked in `saved` (a state dict's entry of parameter `index`): there, and shaped
        like `p`."""
        keys = self._state_keys(p)
        kind = "Muon" if id(p) in self.matrix_ids else "AdamW"
        for key in keys:
            if key not in saved:
                raise ValueError(f"state of parameter {index} lacks {key} ({kind} keeps it): the state is another "
                                 f"optimizer's")
            if saved[key].shape != p.shape:
                raise ValueError(f"state {key} of parameter {index} has shape {tuple(saved[key].shape)}, "
                                 f"the parameter {tuple(p.shape)}")
        return keys

    def _ordered_params(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients live in the reducer's buckets, overwritten each step: this only drops any `p.grad` left
        behind (e.g. by a backward run outside a reducer step)."""
        for p in self._ordered_params():
            p.grad = None

    def register_step_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """`hook(optimizer, args, kwargs)` before every `step()`, as torch.optim.Optimizer's hook of that name."""
        handle = RemovableHandle(self._pre_hooks)
        self._pre_hooks[handle.id] = hook
        return handle

    def register_step_post_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """`hook(optimizer, args, kwargs)` after every `step()`, as torch.optim.Optimizer's hook of that name."""
        handle = RemovableHandle(self._post_hooks)
        self._post_hooks[handle.id] = hook
        return handle

    def _run_hooks(self, hooks: OrderedDict[int, Callable[..., None]]) -> None:
        for hook in list(hooks.values()):
            hook(self, (), {})

    def _state_dict_groups(self) -> list[dict]:
        """The param groups of `state_dict()`: the settings, and the indices of their parameters."""
        groups, start = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "amsgrad": False, "maximize": False, "params": list(range(start, start + n))})
            start += n
        return groups

    def _load_group_settings(self, groups: list[dict]) -> None:
        """A state dict's param groups, checked against these, and their settings taken."""
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state has {len(groups)} param groups, this optimizer {len(self.param_groups)}")
        for saved, group in zip(groups, self.param_groups, strict=True):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("param group sizes differ between the state and this optimizer")
            for key in ("lr", "betas", "eps", "weight_decay"):
                if key in saved:
                    group[key] = tuple(saved[key]) if key == "betas" else saved[key]
