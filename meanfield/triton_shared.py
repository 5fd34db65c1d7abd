"""What the Triton kernels of attention share (:mod:`meanfield.triton_attention`, :mod:`meanfield.triton_small_heads`).

* :data:`INTERPRETED`: whether Triton runs in its interpreter (on CPU tensors, as the tests do);
* ``kahan_add``, ``kahan_sum``: the compensated sums over the key (or query) blocks of a pass, which keep a
  float32 pass over 1e5 keys at the error of one block.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["INTERPRETED", "kahan_add", "kahan_sum"]

#: Triton itself was imported in interpreter mode (TRITON_INTERPRET=1 set before ``import triton``):
#: its language functions then run in Python, and so do the kernels, on CPU tensors
INTERPRETED = type(tl.zeros).__name__ == "InterpretedFunction"


@triton.jit
def kahan_add(total, carry, term):
    """Compensated (Kahan) summation: ``total + term`` with the rounding it lost kept in ``carry``; the
    running sum is ``total - carry``. The sums over key (or query) blocks of a pass are sequential: in
    float32 over the 1e3 blocks of N = 1e5 keys, plain ``+=`` (or a product accumulated into its
    operand) lost 1.9e-4 of the output on an H200 where cuBLAS's float32 product lost 2.7e-6; each
    block's product is now summed apart and added here, so the error stays that of one block."""
    # a carry that overflowed (inf, or NaN after it) is dropped: an overflowed sum then stays infinite
    y = term - tl.where(tl.abs(carry) < float("inf"), carry, 0.0)
    t = total + y
    return t, (t - total) - y


@triton.jit
def kahan_sum(total, carry):
    """The running sum of ``kahan_add``; an overflowed one stays infinite (its carry is then inf or NaN)."""
    return tl.where(tl.abs(carry) < float("inf"), total - carry, total)
