"""Old vs new implementation of four attention hot paths, timed interleaved in one process.

The old implementations are private copies kept here (not in the package), so the gain stays
reproducible after the package changed:

1. RMF map, causal: ω was copied once per chunk (a batched matmul broadcasting ω over the
   chunks, forward and backward); now one flat matmul over all chunks. Bidirectional calls
   take the same code as before there, so their row is a noise check (ratio ≈ 1).
2. ppSBN statistics: ``torch.var_mean`` over dims (0, 2) (and ``(x·w).sum((0, 2))`` with a
   mask); now two passes of plain sums, positions first, with no graph through μ in the
   variance pass (its gradient there is zero) and none at all for running-only updates.
3. RMF map products (many small ``mul_``): not changed. A level-major layout (max_degree − 1
   products instead of Σ(n − 1)) measured no faster; the ``mul_`` are ~1.5 % of a fwd+bwd.
4. ``fallback`` denominator: ``bool(bad.any())`` every call. On the CPU that costs nothing and
   stays; elsewhere the means are now always built (no host sync). Here we time what the
   always-built form would cost on the CPU (``always``), which is why the CPU keeps the test.

Every case runs fwd+bwd (train mode, ``out.backward(g)`` with a fixed random g, gradients of
q, k, v included) once per round in a shuffled order; after the warm-up rounds, the table
reports each variant's median time and the median over rounds of its time / old's time in
that round (docs/pitfalls.md §9: absolute times swing on this shared machine, ratios do not).
It also reports the largest |new − old| of the output and of the q, k, v gradients.

    python -m benchmarks.attention_hotpaths                   # the committed run
    python -m benchmarks.attention_hotpaths --ns 1024 --ds 32 --repeats 3   # a quick check
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import random
import time
import types
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from macformer_lit.attention import build_attention
from macformer_lit.attention.eager_sbn import all_reduce
from macformer_lit.attention.features import MaclaurinMap
from macformer_lit.attention.ppsbn import PPSBNAttention

try:
    from benchmarks._common import (
        csv_comment_header,
        machine_info,
        md_header,
        md_table,
        median,
        progress,
    )
except ImportError:  # run as a script: python benchmarks/attention_hotpaths.py
    from _common import csv_comment_header, machine_info, md_header, md_table, median, progress

RESULTS = Path(__file__).resolve().parent / "results"


# ---- old implementations (package at commit c3edc98), private reference copies ----


class _OldMap(torch.autograd.Function):
    """MaclaurinMap before: one batched matmul that broadcasts ω over the chunks of a causal
    pass (torch.matmul copies ω once per chunk, forward and backward)."""

    @staticmethod
    def forward(ctx, x, omega, const, blocks):
        s1 = blocks[0][1] if blocks and blocks[0][0] == 1 else 0
        groups = [(n, c) for n, c in blocks if n >= 2]
        c0 = int(const is not None)
        proj = torch.matmul(omega, x.transpose(-1, -2))  # (..., S, L)
        rows = c0 + s1 + sum(c for _, c in groups)
        phi = proj.new_empty(*proj.shape[:-2], rows, proj.shape[-1])
        if c0:
            phi[..., :1, :] = const
        phi[..., c0 : c0 + s1, :] = proj[..., :s1, :]
        row, off = c0 + s1, s1
        for n, c in groups:
            out = phi[..., row : row + c, :]
            torch.mul(proj[..., off : off + c, :], proj[..., off + c : off + 2 * c, :], out=out)
            for j in range(2, n):
                out.mul_(proj[..., off + j * c : off + (j + 1) * c, :])
            row, off = row + c, off + n * c
        ctx.save_for_backward(omega, proj)
        ctx.layout = (c0, s1, groups)
        return phi

    @staticmethod
    def backward(ctx, grad):
        omega, proj = ctx.saved_tensors
        c0, s1, groups = ctx.layout
        dproj = torch.empty_like(proj)
        dproj[..., :s1, :] = grad[..., c0 : c0 + s1, :]
        row, off = c0 + s1, s1
        for n, c in groups:
            g = grad[..., row : row + c, :]
            f = [proj[..., off + j * c : off + (j + 1) * c, :] for j in range(n)]
            df = [dproj[..., off + j * c : off + (j + 1) * c, :] for j in range(n)]
            df[n - 1].copy_(g)
            for j in range(n - 2, -1, -1):
                torch.mul(df[j + 1], f[j + 1], out=df[j])
            prefix = f[0].clone()
            for j in range(1, n):
                df[j].mul_(prefix)
                if j < n - 1:
                    prefix.mul_(f[j])
            row, off = row + c, off + n * c
        return torch.matmul(dproj.transpose(-1, -2), omega), None, None, None


def _old_moments(x, mask, differentiable: bool):
    """PPSBNAttention._moments before: var_mean unmasked, (x·w).sum((0, 2)) masked."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if mask is None and not distributed:
        var, mean = torch.var_mean(x, dim=(0, 2), correction=0)
        return mean[:, None], var[:, None], x.new_tensor(float(x.shape[0] * x.shape[2]))
    if mask is None:
        w, n = None, x.new_tensor(float(x.shape[0] * x.shape[2]))
    else:
        w = mask[:, None, :, None].to(x.dtype)
        n = mask.sum().to(x.dtype)
    n = all_reduce(n, False).clamp_min(1.0)
    total = (x if w is None else x * w).sum((0, 2))
    mean = all_reduce(total, differentiable)[:, None] / n
    centred = (x - mean).square()
    sq = (centred if w is None else centred * w).sum((0, 2))
    return mean, all_reduce(sq, differentiable)[:, None] / n, n


def _normalise_variant(always: bool) -> Callable:
    """FeatureAttention._normalise (fallback part) with the means built lazily after
    ``bool(bad.any())`` (old, and still the CPU path) or always (the sync-free form)."""

    def normalise(self, out, count, den_scale, visible_sums):
        num, den = out[..., :-1], out[..., -1:]
        tiny = torch.finfo(den.dtype).tiny ** 0.5
        threshold = self.denominator_eps * torch.as_tensor(count, dtype=den.dtype)
        if den_scale is not None:
            threshold = threshold * den_scale.reshape(*den_scale.shape[:2], 1, 1)
        threshold = threshold.clamp_min(tiny)
        bad = ~(den > threshold)
        den = torch.where(bad, torch.ones_like(den), den)
        out = num / den
        if always or bool(bad.any()):
            sums = visible_sums()
            mean = sums[..., :-1] / sums[..., -1:].clamp_min(1.0)
            out = torch.where(bad, mean, out)
        return out

    return normalise


def use_old_map(attn):
    """Give an RMFAttention the old map (the layout did not change)."""

    def _map(self, x, log_row_scale, log_const):
        omega = self._omega.to(x.dtype) * log_row_scale.exp()
        const = None if self.const == 0.0 else self.const * log_const.exp()
        return _OldMap.apply(x, omega, const, self.blocks)

    attn._map = types.MethodType(_map, attn)
    return attn


# ---- measurement ----


def pre_sbn_inputs(B, H, N, d, seed):
    """q, k standardised per (head, channel) and L2-normalised per row; Gaussian v."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, d, generator=g) for _ in range(3))

    def sbn(x):
        x = (x - x.mean((0, 2), keepdim=True)) / x.std((0, 2), unbiased=False, keepdim=True)
        return F.normalize(x, dim=-1)

    return sbn(q), sbn(k), v


def fwd_bwd(fn: Callable, inputs, g) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(g)
    return out.detach(), [t.grad for t in leaves]


def max_diff(a, b) -> float:
    out_a, grads_a = a
    out_b, grads_b = b
    return max(float((x - y).abs().max()) for x, y in zip([out_a, *grads_a], [out_b, *grads_b]))


def interleaved(variants: dict[str, Callable], repeats: int, warmup: int) -> dict[str, dict]:
    """Median time per variant and median per-round ratio to the variant ``old``."""
    times = defaultdict(list)
    for r in range(warmup + repeats):
        order = list(variants)
        random.shuffle(order)
        rnd = {}
        for name in order:
            t0 = time.perf_counter()
            variants[name]()
            rnd[name] = time.perf_counter() - t0
        if r >= warmup:
            for name, t in rnd.items():
                times[name].append(t)
    return {
        name: {
            "median_ms": 1e3 * median(ts),
            "ratio": median([t / o for t, o in zip(ts, times["old"])]),
        }
        for name, ts in times.items()
    }


def run_case(section, case, modules: dict, fn_of, inputs, args, rows):
    """Time fwd+bwd of every module variant on ``inputs``; diffs against ``old``."""
    fns = {name: fn_of(m) for name, m in modules.items()}
    g = torch.randn_like(fns["old"](*inputs).detach())
    results = {name: fwd_bwd(fn, inputs, g) for name, fn in fns.items()}
    variants = {name: (lambda fn=fn: fwd_bwd(fn, inputs, g)) for name, fn in fns.items()}
    stats = interleaved(variants, args.repeats, args.warmup)
    for name in modules:
        s = stats[name]
        diff = max_diff(results[name], results["old"])
        rows.append({"section": section, **case, "variant": name, **s, "max_abs_diff": diff})
        progress(
            f"  {section} {case} {name:>7}: {s['median_ms']:8.2f} ms  ratio {s['ratio']:.3f}  "
            f"max|Δ| {diff:.2e}"
        )


def bench_map(args, rows):
    """Item 1: the RMFA core on pre-SBN'd inputs."""
    for d in args.ds:
        for N in args.ns:
            for causal in (False, True):
                torch.manual_seed(args.seed)
                new = build_attention(
                    "rmfa", head_dim=d, num_heads=args.heads, num_features=args.num_features
                ).train()
                modules = {"old": use_old_map(copy.deepcopy(new)), "new": new}
                inputs = pre_sbn_inputs(args.batch, args.heads, N, d, args.seed)
                case = {
                    "direction": "causal" if causal else "bidirectional",
                    "N": N,
                    "d": d,
                    "mask": "none",
                    "blocks": str(new.blocks),
                }

                def fn_of(m, causal=causal):
                    return lambda q, k, v: m(q, k, v, causal=causal)

                run_case("map", case, modules, fn_of, inputs, args, rows)


def bench_map_alone(args, rows):
    """Item 1 alone: the causal key map, φ of k in chunks (B, H, nc, C, d), ω (B, H, 1, S, d)."""
    for d in args.ds:
        for N in args.ns:
            torch.manual_seed(args.seed)
            attn = build_attention(
                "rmfa", head_dim=d, num_heads=args.heads, num_features=args.num_features
            )
            C = attn.chunk_size
            k = pre_sbn_inputs(args.batch, args.heads, N, d, args.seed)[1]
            k = k.reshape(args.batch, args.heads, N // C, C, d)
            scale = torch.rand(args.batch, args.heads, 1, 1, 1) + 0.5
            omega = attn._omega * scale  # (B, H, 1, S, d), as _map builds it
            const = torch.tensor(attn.const)
            case = {"direction": "causal", "N": N, "d": d, "mask": "none"}

            def fn_of(map_cls, omega=omega, const=const, blocks=attn.blocks):
                return lambda x: map_cls.apply(x, omega, const, blocks)

            modules = {"old": _OldMap, "new": MaclaurinMap}
            run_case("map alone", case, modules, fn_of, (k,), args, rows)


def bench_moments(args, rows):
    """Item 2: ppSBN statistics, alone (fwd+bwd of the standardisation) and end-to-end."""
    for d in args.ds:
        for N in args.ns:
            for masked in (False, True):
                torch.manual_seed(args.seed)
                x = torch.randn(args.batch, args.heads, N, d)
                mask = None
                if masked:  # every other sequence a quarter padding
                    mask = torch.ones(args.batch, N, dtype=torch.bool)
                    mask[::2, (3 * N) // 4 :] = False
                pad = "25% pad, half" if masked else "none"
                case = {"direction": "-", "N": N, "d": d, "mask": pad}

                def fn_of(moments, mask=mask):
                    def standardise(t):
                        mean, var, _ = moments(t, mask, differentiable=True)
                        return (t - mean) * torch.rsqrt(var + 1e-13)

                    return standardise

                modules = {"old": _old_moments, "new": PPSBNAttention._moments}
                run_case("moments", case, modules, fn_of, (x,), args, rows)
            for causal in (False, True):
                torch.manual_seed(args.seed)
                new = build_attention(
                    "rmfa",
                    head_dim=d,
                    num_heads=args.heads,
                    num_features=args.num_features,
                    pre_sbn=True,
                    post_sbn=True,
                ).train()
                old = copy.deepcopy(new)
                old._moments = _old_moments
                g = torch.Generator().manual_seed(args.seed)
                inputs = [torch.randn(args.batch, args.heads, N, d, generator=g) for _ in range(3)]
                case = {
                    "direction": "causal" if causal else "bidirectional",
                    "N": N,
                    "d": d,
                    "mask": "none",
                }

                def fn_of(m, causal=causal):
                    # Same running statistics in every call: the update is in place.
                    state = copy.deepcopy(m.state_dict())

                    def call(q, k, v):
                        m.load_state_dict(state)
                        return m(q, k, v, causal=causal)

                    return call

                run_case("ppsbn+rmfa", case, {"old": old, "new": new}, fn_of, inputs, args, rows)


def bench_normalise(args, rows):
    """Item 4: cost on the CPU of always building the fallback means (the sync-free form)."""
    for d in args.ds:
        for N in args.ns:
            for causal in (False, True):
                torch.manual_seed(args.seed)
                new = build_attention(
                    "rmfa", head_dim=d, num_heads=args.heads, num_features=args.num_features
                ).train()
                always = copy.deepcopy(new)
                always._normalise = types.MethodType(_normalise_variant(True), always)
                old = copy.deepcopy(new)
                old._normalise = types.MethodType(_normalise_variant(False), old)
                inputs = pre_sbn_inputs(args.batch, args.heads, N, d, args.seed)
                case = {
                    "direction": "causal" if causal else "bidirectional",
                    "N": N,
                    "d": d,
                    "mask": "none",
                }

                def fn_of(m, causal=causal):
                    return lambda q, k, v: m(q, k, v, causal=causal)

                modules = {"old": old, "always": always, "new": new}
                run_case("normalise", case, modules, fn_of, inputs, args, rows)


def write(rows, info, extra, out: Path, stem: str):
    out.mkdir(parents=True, exist_ok=True)
    keys = ["section", "direction", "N", "d", "mask", "variant", "median_ms", "ratio"]
    keys += ["max_abs_diff", "blocks"]
    with open(out / f"{stem}.csv", "w", newline="") as f:
        f.write(csv_comment_header(info, extra))
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})
    titles = {
        "map": "Item 1: RMFA core (faithful), fwd+bwd; old = ω copied once per chunk, new = one "
        "flat matmul (bidirectional: same code in both, a noise check)",
        "map alone": "Item 1 alone: the causal key map φ(k), k in chunks (B, H, N/64, 64, d), "
        "fwd+bwd",
        "moments": "Item 2: ppSBN statistics alone, x (B, H, N, d) -> (x − μ)/σ, fwd+bwd",
        "ppsbn+rmfa": "Item 2 end-to-end: ppSBN (pre and post, train mode) around RMFA, fwd+bwd "
        "(bidirectional: batch statistics; causal: running ones, updated)",
        "normalise": "Item 4: RMFA fwd+bwd with the fallback means built lazily after "
        "bool(bad.any()) (old = new on the CPU) vs always built (the sync-free form used off "
        "the CPU), pre-SBN'd inputs (no row needs the fallback)",
    }
    md = [md_header("Attention hot paths: old vs new implementation", info, extra)]
    md.append(
        "Times are medians over interleaved rounds (ms); ratio = median over rounds of the "
        "variant's time / old's time in the same round (< 1: faster). max|Δ| = largest "
        "absolute difference of output and q, k, v gradients against old.\n"
    )
    for section, title in titles.items():
        sec = [r for r in rows if r["section"] == section]
        if not sec:
            continue
        md += [f"## {title}", ""]
        header = ["direction", "N", "d", "mask", "variant", "median ms", "ratio", "max abs diff"]
        table = [
            [
                r["direction"],
                r["N"],
                r["d"],
                r["mask"],
                r["variant"],
                f"{r['median_ms']:.2f}",
                f"{r['ratio']:.3f}",
                f"{r['max_abs_diff']:.1e}",
            ]
            for r in sec
        ]
        md += [md_table(header, table), ""]
    (out / f"{stem}.md").write_text("\n".join(md))
    progress(f"wrote {out / stem}.md and .csv")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ns", default="1024,4096", help="sequence lengths")
    p.add_argument("--ds", default="32,64", help="head dims")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--num-features", type=int, default=128)
    p.add_argument("--sections", default="map,map_alone,moments,normalise")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS), help="output folder")
    p.add_argument("--name", default="attention_hotpaths", help="file stem")
    args = p.parse_args(argv)
    args.ns = [int(n) for n in args.ns.split(",")]
    args.ds = [int(d) for d in args.ds.split(",")]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    info = machine_info("cpu")
    extra = {
        "threads": str(args.threads),
        "sizes": f"B={args.batch}, H={args.heads}, D={args.num_features}, N in {args.ns}, "
        f"d in {args.ds}, fp32",
        "rounds": f"{args.warmup} warm-up + {args.repeats} timed, shuffled order",
    }
    rows: list[dict] = []
    benches = {
        "map": bench_map,
        "map_alone": bench_map_alone,
        "moments": bench_moments,
        "normalise": bench_normalise,
    }
    for section in args.sections.split(","):
        progress(f"[{section}]")
        benches[section](args, rows)
    info["load average at end (1/5/15 min)"] = "{:.2f} / {:.2f} / {:.2f}".format(*os.getloadavg())
    write(rows, info, extra, Path(args.out), args.name)


if __name__ == "__main__":
    main()
