"""Fused GPU kernels for the precision recipes (optional: everything here has a PyTorch reference).

`mx_triton`: one-pass Triton MX quantization (RHT + E8M0 scale + rounding + packing) and the detection of
native MX block-scaled `torch._scaled_mm`. Importing this package (or `mx_triton`) does not import triton;
the kernel is compiled on its first call.
"""

from megalm.precision.kernels.mx_triton import (
    mx_quantize_triton,
    native_mx_scaled_mm_available,
    triton_available,
)

__all__ = ["mx_quantize_triton", "native_mx_scaled_mm_available", "triton_available"]
