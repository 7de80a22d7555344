"""How much ``feature_dtype: bfloat16`` costs the degree-2 Maclaurin backend in accuracy, next
to what bf16 autocast already costs softmax (docs/maths.md §14, fast options).

Inputs as pre-SBN with a temperature leaves them: q rows of norm τ, k rows of norm 1, half
the keys pulled towards their query (so that some weights stand out), v ~ N(0, 1);
B = 2, H = 2, N = 1,000, d = 32. For τ in {1, 4, 16, 64, 128, 256, 512}:

- forward NMSE ‖out − exact‖²/‖exact‖² of the ``maclaurin`` backend with float32 and with
  bfloat16 rows against its own kernel 1 + s + s²/2 in float64, and of torch SDPA under
  bf16 autocast against softmax in float64;
- the same for the gradients dq, dk, dv of ⟨out, w⟩ (w ~ N(0, 1)).

    python -m benchmarks.bf16_rows_error
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from macformer_lit.attention import build_attention
from macformer_lit.attention.kernels import get_kernel
from macformer_lit.attention.reference import (
    keep_mask,
    kernelized_attention,
    nmse,
    weighted_average,
)

from ._common import fmt_sci, git_state, machine_info, md_header, md_table, progress

TAUS = (1, 4, 16, 64, 128, 256, 512)


def inputs(tau: float, seed: int, B=2, H=2, N=1000, d=32):
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(B, H, N, d, generator=g, dtype=torch.float64) for _ in "qkvw")
    q = F.normalize(q, dim=-1) * tau
    k = F.normalize(k, dim=-1)
    k[:, :, : N // 2] = F.normalize(k[:, :, : N // 2] + 0.3 * q[:, :, : N // 2] / tau, dim=-1)
    return q, k, v, w


def run(fn, q0, k0, v0, w, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q0, k0, v0))
    out = fn(q, k, v)
    (out.double() * w).sum().backward()
    return [out.detach()] + [t.grad for t in (q, k, v)]


def own_kernel(q, k, v):
    """Exact attention with exp's series cut at degree 2, 1 + s + s²/2."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return weighted_average(get_kernel("exp").truncated(s, 2), v, keep_mask(q, k, None, False))


def sdpa_bf16(q, k, v):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.scaled_dot_product_attention(q, k, v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--taus", default=",".join(map(str, TAUS)))
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="bf16_rows_error")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    maclaurin = {
        dt: build_attention("maclaurin", head_dim=32, num_heads=2, feature_dtype=dt)
        for dt in ("float32", "bfloat16")
    }
    rows = []
    for tau in (float(t) for t in args.taus.split(",")):
        progress(f"tau {tau:g}")
        q, k, v, w = inputs(tau, seed=0)
        exact = run(own_kernel, q, k, v, w, torch.float64)
        soft = run(kernelized_attention, q, k, v, w, torch.float64)
        got = {
            "float32 rows": run(maclaurin["float32"], q, k, v, w, torch.float32),
            "bfloat16 rows": run(maclaurin["bfloat16"], q, k, v, w, torch.float32),
            "softmax, bf16 autocast": run(sdpa_bf16, q, k, v, w, torch.float32),
        }
        for label, values in got.items():
            ref = soft if label.startswith("softmax") else exact
            errors = [float(nmse(a, b)) for a, b in zip(values, ref)]
            rows.append([f"{tau:g}", label] + [fmt_sci(e) for e in errors])
    info = machine_info("cpu")
    text = md_header(
        "NMSE of bfloat16 feature rows (maclaurin, degree 2) beside bf16 softmax",
        info,
        {
            "commit": git_state(),
            "command": "python -m benchmarks.bf16_rows_error",
            "wall time": f"{time.time() - started:.0f} s",
        },
    )
    text += (
        "\nForward and gradient NMSE against float64: the maclaurin rows against the exact "
        "degree-2 kernel attention, softmax against exact softmax. bfloat16's unit roundoff "
        "u = 2^-8 = 3.9e-3, u² = 1.5e-5.\n\n"
    )
    text += md_table(["τ", "path", "out", "dq", "dk", "dv"], rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
