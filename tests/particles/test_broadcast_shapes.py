"""particles.validation.broadcast_shapes against torch.broadcast_shapes, and what it saves: torch's first call
imports torch._refs and sympy (about 1 s of the first attention call in a process)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from particles.validation import broadcast_shapes


def test_the_same_shapes_and_errors_as_torch():
    rng = random.Random(0)
    for _ in range(3000):
        shapes = [tuple(rng.choice([0, 1, 2, 3]) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(0, 4))]
        try:
            want = torch.broadcast_shapes(*shapes)
        except RuntimeError:
            with pytest.raises(RuntimeError, match="Shape mismatch"):
                broadcast_shapes(*shapes)
            continue
        got = broadcast_shapes(*shapes)
        assert isinstance(got, torch.Size) and got == want, shapes
    assert broadcast_shapes(torch.Size([2, 1]), torch.Size([3])) == torch.Size([2, 3])


def test_a_first_attention_call_imports_no_sympy():
    code = ("import sys, torch\n"
            "before = 'sympy' in sys.modules\n"
            "from meanfield import attend\n"
            "x = torch.randn(3000, 3, dtype=torch.float64)\n"
            "x = x / x.norm(dim=1, keepdim=True)\n"
            "attend(x, x, x)\n"
            "attend(x[:100], x[:100], x[:100], log_weights=torch.zeros(100, dtype=torch.float64))\n"
            "print(before, 'sympy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if out[0] == "True":
        pytest.skip("this torch imports sympy with torch itself")
    assert out == ["False", "False"]
