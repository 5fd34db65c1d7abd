"""The kernels' ``_add`` (meanfield.triton_shared.kahan_add, read by both kernel modules under that name) without its
compensation, for a test that must tell the two apart
(tests/meanfield/test_triton_small_heads.py). Import it only once TRITON_INTERPRET=1 is set (by
tests/meanfield/test_kernels_triton.py), as the kernels it replaces a helper of."""

import triton
import triton.language as tl  # noqa: F401 - a jit function's module must hold triton.language


@triton.jit
def plain_add(total, carry, term):
    """``total + term``, the carry left as it is: plain summation in the place of Kahan's."""
    return total + term, carry
