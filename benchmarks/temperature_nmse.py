"""How far each Maclaurin estimator is from exact exp attention at the temperature learning
needs (issue: "estimators that hold at the temperature learning needs"; docs/maths.md §14).

After pre-SBN every row of q and k has unit length; ppSBN's temperature τ then scales q, so
the logits q·k/√d are bounded by τ/√d. Exact exp attention at τ is the target. For τ in
{1, 4, 16, 32}, d = 32, N in {256, 1024} this measures the NMSE ‖approx − exact‖²/‖exact‖²
of bidirectional attention (float64, mean over seeds; each seed draws new inputs and new
features) for:

- RMF ``faithful`` (Macformer), ``official`` (SchoenbAt release), ``h01`` (degrees 0, 1
  exact) at D = 128, 256, 1024 sampled features: the backends themselves (rmfa), default
  denominator policy;
- ``h01 orthogonal``: h01 with the projection vectors of each degree drawn as orthogonal
  blocks (rows of a random orthogonal matrix scaled to length √d) instead of Rademacher;
- ``h01 radius law``: h01 whose degree law follows the kernel at the input radius,
  P[n] ∝ a_n R^n for n ≥ 2 with R = τ/√d (the largest |x_q||x_k|), instead of 2^-n;
- ``degree 2 exact``: the deterministic map [1, x, x⊗x/√2] (D' = 1 + d + d²), exact for its
  own kernel 1 + s + s²/2 (always positive) but not for exp;
- ``uniform``: the mean of v, the line to beat.

Inputs: q, k, v ~ N(0, 1), B = 1, H = 4; q and k standardised per (head, channel) and rows
L2-normalised (pre-SBN), then q·τ.

    python -m benchmarks.temperature_nmse              # the committed run
    python -m benchmarks.temperature_nmse --seeds 1 --ns 256 --taus 1,16   # quick check
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path

import torch

from macformer_lit.attention import build_attention
from macformer_lit.attention.kernels import get_kernel
from macformer_lit.attention.reference import kernelized_attention, nmse, uniform_attention

try:
    from benchmarks._common import csv_comment_header, git_state, machine_info, md_header, md_table
except ImportError:  # run as a script
    from _common import csv_comment_header, git_state, machine_info, md_header, md_table

RESULTS = Path(__file__).resolve().parent / "results"
D_HEAD, HEADS = 32, 4
EXP = get_kernel("exp")
MAX_DEGREE = 30


def pre_sbn(x: torch.Tensor) -> torch.Tensor:
    x = (x - x.mean((0, 2), keepdim=True)) / x.std((0, 2), unbiased=False, keepdim=True)
    return x / x.norm(dim=-1, keepdim=True)


def ratio(phi_q, phi_k, v):
    """Σ_j φ_i·φ_j v_j / Σ_j φ_i·φ_j, with rows whose denominator is ≤ 1e-3·n getting the
    mean of v (the rmfa backends' default ``fallback``)."""
    kv = phi_k.transpose(-1, -2) @ torch.cat([v, torch.ones_like(v[..., :1])], -1)
    out = phi_q @ kv
    num, den = out[..., :-1], out[..., -1:]
    bad = den <= 1e-3 * v.shape[-2]
    return torch.where(bad, v.mean(-2, keepdim=True), num / torch.where(bad, 1.0, den))


def _omegas(total: int, orthogonal: bool, g: torch.Generator) -> torch.Tensor:
    """(d, total) projection vectors: Rademacher, or orthogonal blocks of d scaled to √d."""
    if not orthogonal:
        return (2 * torch.randint(0, 2, (D_HEAD, total), generator=g) - 1).double()
    blocks = []
    for _ in range(math.ceil(total / D_HEAD)):
        a = torch.randn(D_HEAD, D_HEAD, generator=g, dtype=torch.float64)
        blocks.append(torch.linalg.qr(a)[0] * math.sqrt(D_HEAD))
    return torch.cat(blocks, 1)[:, :total]


def h01_features(x, degrees, probs, omega):
    """[√a0, √a1·x, sampled products of degree ≥ 2], x already scaled by d^-1/4; ``probs``
    the probability of each sampled degree, ``omega`` (d, Σ degrees)."""
    cols = [
        torch.full_like(x[..., :1], math.sqrt(EXP.coefficient(0))),
        math.sqrt(EXP.coefficient(1)) * x,
    ]
    D = len(degrees)
    col = 0
    proj = x @ omega
    feats = []
    for n, prob in zip(degrees, probs):
        f = proj[..., col : col + n].prod(-1, keepdim=True)
        feats.append(f * math.sqrt(EXP.coefficient(n) / (prob * D)))
        col += n
    return torch.cat(cols + feats, -1)


def sample_h01(D, law, g):
    """D degrees ≥ 2 from ``law`` (a dict degree -> probability)."""
    degrees = list(law)
    probs = torch.tensor([law[n] for n in degrees], dtype=torch.float64)
    idx = torch.multinomial(probs, D, replacement=True, generator=g)
    chosen = [degrees[i] for i in idx.tolist()]
    return chosen, [law[n] for n in chosen]


def geometric_law(p=2.0):
    w = {n: p ** -(n - 2) for n in range(2, MAX_DEGREE + 1)}
    s = sum(w.values())
    return {n: x / s for n, x in w.items()}


def radius_law(radius):
    w = {n: EXP.coefficient(n) * radius**n for n in range(2, MAX_DEGREE + 1)}
    s = sum(w.values())
    return {n: x / s for n, x in w.items() if x / s > 1e-12}


def degree2_features(x):
    outer = (x[..., :, None] * x[..., None, :]).flatten(-2) / math.sqrt(2.0)
    return torch.cat([torch.ones_like(x[..., :1]), x, outer], -1)


def measure(tau, N, D, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, HEADS, N, D_HEAD, generator=g, dtype=torch.float64) for _ in "qkv")
    q, k = pre_sbn(q) * tau, pre_sbn(k)
    exact = kernelized_attention(q, k, v, "exp")
    rows = {"uniform": nmse(uniform_attention(q, k, v), exact)}
    for m in ("faithful", "official", "h01"):
        torch.manual_seed(seed * 1000 + D)
        attn = build_attention("rmfa", head_dim=D_HEAD, num_heads=HEADS, num_features=D, measure=m)
        attn = attn.double().eval()
        with torch.no_grad():
            rows[f"rmf {m}"] = nmse(attn(q, k, v), exact)
    s = D_HEAD**-0.25
    for label, orthogonal, law in (
        ("h01 orthogonal", True, geometric_law()),
        ("h01 radius law", False, radius_law(tau / math.sqrt(D_HEAD))),
    ):
        degrees, probs = sample_h01(D, law, g)
        omega = _omegas(sum(degrees), orthogonal, g)
        rows[label] = nmse(
            ratio(
                h01_features(q * s, degrees, probs, omega),
                h01_features(k * s, degrees, probs, omega),
                v,
            ),
            exact,
        )
    rows["degree 2 exact"] = nmse(ratio(degree2_features(q * s), degree2_features(k * s), v), exact)
    return {key: float(value) for key, value in rows.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--taus", default="1,4,16,32")
    ap.add_argument("--ns", default="256,1024")
    ap.add_argument("--features", default="128,256,1024")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "temperature_nmse"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    taus = [float(t) for t in args.taus.split(",")]
    ns = [int(n) for n in args.ns.split(",")]
    feats = [int(d) for d in args.features.split(",")]
    start, commit = time.time(), git_state()  # the code as it was imported
    table = []  # (N, D, tau, method, nmse)
    for N in ns:
        for D in feats:
            for tau in taus:
                runs = [measure(tau, N, D, seed) for seed in range(args.seeds)]
                for key in runs[0]:
                    table.append((N, D, tau, key, sum(r[key] for r in runs) / len(runs)))
                print(f"N={N} D={D} tau={tau:g} done ({time.time() - start:.0f} s)", flush=True)
    info = machine_info("cpu")
    extra = {
        "macformer_lit commit": commit,
        "threads": str(args.threads),
        "inputs": f"q, k, v ~ N(0, 1), B=1, H={HEADS}, d={D_HEAD}; q, k pre-SBN'd (standardised "
        "per head and channel, rows L2-normalised), then q·τ",
        "exact": "exp kernelized attention at τ, float64",
        "NMSE": f"‖approx − exact‖²/‖exact‖², mean over {args.seeds} seeds",
        "command": "python -m benchmarks.temperature_nmse"
        + ("" if argv is None else " " + " ".join(argv)),
        "wall time": f"{time.time() - start:.0f} s",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        f.write(csv_comment_header(info, extra))
        w = csv.writer(f)
        w.writerow(["N", "D", "tau", "method", "nmse"])
        w.writerows(table)
    methods = list(dict.fromkeys(r[3] for r in table))
    md = [
        md_header("Maclaurin estimators against exact exp attention, by temperature", info, extra)
    ]
    for N in ns:
        for D in feats:
            md.append(
                f"\n## N = {N}, D = {D} sampled features (degree 2 exact: the full outer "
                f"product, D' = {1 + D_HEAD + D_HEAD**2}; the maclaurin backend keeps its "
                f"symmetric half, D' = {1 + D_HEAD + D_HEAD * (D_HEAD + 1) // 2}, "
                "the same kernel)\n"
            )
            rows = []
            for m in methods:
                vals = {r[2]: r[4] for r in table if r[0] == N and r[1] == D and r[3] == m}
                rows.append([m] + [f"{vals[t]:.3g}" for t in taus])
            md.append(md_table(["estimator"] + [f"τ = {t:g}" for t in taus], rows))
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    plot(table, ns, feats, taus, methods, out.with_suffix(".png"))
    print(f"wrote {out}.{{csv,md,png}}")


def plot(table, ns, feats, taus, methods, path):
    from macformer_lit.plotting import colours_for, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(ns), figsize=(6 * len(ns), 4.5), squeeze=False)
    colours = colours_for([m for m in methods if m != "uniform"])
    styles = dict(zip(feats, ["-", "--", ":"]))
    for ax, N in zip(axes[0], ns):
        for m in methods:
            for D in feats if m not in ("uniform", "degree 2 exact") else feats[:1]:
                ys = [next(r[4] for r in table if r[:4] == (N, D, t, m)) for t in taus]
                if m == "uniform":
                    ax.plot(taus, ys, color="black", lw=2.5, label="uniform (line to beat)")
                else:
                    label = m if m == "degree 2 exact" else f"{m}, D={D}"
                    ax.plot(taus, ys, styles[D], color=colours[m], marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("temperature τ (logits ≤ τ/√d)")
        ax.set_ylabel("NMSE against exact exp attention")
        ax.set_title(f"N = {N}, d = {D_HEAD}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
