"""Attention code that stays out of compiled graphs, for attention.py to call while dynamo traces a block.

A module of its own because `torch.compiler.disable` imports torch._dynamo (and with it triton, where installed):
attention.py imports this only while compiling, so that importing megalm imports neither.
"""

from __future__ import annotations

import torch

from megalm.model.document_sdpa import per_document_sdpa

# the CPU's per-document SDPA loop, eager under torch.compile (document_sdpa.per_document_sdpa says why)
per_document_sdpa_outside_graphs = torch.compiler.disable(per_document_sdpa)
