"""The Triton interpreter for the Triton kernel tests, which run on CPU under it and on CUDA compiled.

Without CUDA, TRITON_INTERPRET=1 must be set before triton is first imported (megalm imports it lazily, so
importing megalm does not; torch._dynamo does): tests/conftest.py sets it at the start of a CPU-only session. Where
a module sets it itself it is put back after its tests, or it would turn every other triton kernel of the
process (torch.compile's) into interpreted ones. pytest imports every test module before it runs any, so a
module that needs the interpreter sets it at import (`use_interpreter_without_cuda`) and again for its own
tests (`interpreter_fixture`): another module may have put it back in between.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

ENV_BEFORE = os.environ.get("TRITON_INTERPRET")


def use_interpreter_without_cuda() -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def restore_env() -> None:
    if ENV_BEFORE is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = ENV_BEFORE


def interpreter_fixture(device: str):
    """A module-scoped autouse fixture: the interpreter on for the module's tests when they run on CPU."""

    @pytest.fixture(scope="module", autouse=True)
    def triton_interpret() -> Iterator[None]:
        if device == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"
        yield
        restore_env()

    return triton_interpret
