"""The degree-2 Maclaurin map's implementations and the feature products' column padding,
timed interleaved in one process on the CPU (docs/maths.md §14, fast options).

Three items, each forward + backward, at one batch piece of the ListOps preset (B entries of
H heads, N positions, head size d; the Maclaurin backend runs its map over the batch in pieces
of about this size on a CPU):

1. The map alone, bfloat16 rows: ``eager`` (d slice products and a concatenation),
   ``compiled`` (the same under torch.compile), ``native`` (attention/native_map.py, rows
   stored row-major) and ``native_keys`` (stored feature-major, as the backend stores φ(k);
   its gradient arrives feature-major as φ(k)ᵀ[v, 1]'s backward leaves it).
2. The two products φ(q)ᵀ[φ(k)ᵀ v1] in bfloat16 with e = d + 1 columns as they are and padded
   with zero columns to a multiple of 16 (a loaded machine's timing of the forward GEMMs
   suggested 1.5-2x for 33 columns against 48; measured idle, forward and backward, the
   padding gained nothing: results/maclaurin_map_6f2dd31.md, so the backend does not pad).
3. The maps and the two products together: the native map's bfloat16 rows and the bfloat16
   GEMMs (what ``macformer_wide_native`` runs) against the fused kernel
   (attention/native_fused.py, ``native_fused: true``) in float32 and with bfloat16 inputs
   (``feature_dtype: bfloat16``: the CPU's bfloat16 dot products where it has them; on a CPU
   with AMX tiles, the tiles and the AVX512-BF16 loops side by side).
4. The attention call of ``macformer_wide_fast`` (degree-2 features in ppSBN, bfloat16 rows,
   under bf16 autocast) with the compiled map, the native map and the fused products,
   beside torch SDPA softmax in fp32 (the ratio's base) and under bf16 autocast.

Every round runs every case once in a shuffled order; the table gives each case's median
time and the median over rounds of its time / the item's base in that round (absolute times
swing on a shared machine, ratios less: docs/pitfalls.md §9).

    python -m benchmarks.maclaurin_map                      # the committed run
    python -m benchmarks.maclaurin_map --rounds 3 --n 500   # a quick check
"""

from __future__ import annotations

import argparse
import random
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from macformer_lit.attention import build_attention
from macformer_lit.attention.maclaurin import compiled_maclaurin_rows, maclaurin_rows
from macformer_lit.attention.native_fused import amx_tiles, native_fused_products
from macformer_lit.attention.native_map import native_maclaurin_rows

try:
    from benchmarks._common import machine_info, md_header, md_table, median, progress
except ImportError:  # run as a script
    from _common import machine_info, md_header, md_table, median, progress

RESULTS = Path(__file__).resolve().parent / "results"
WIDE_FAST = dict(name="maclaurin", kernel="exp", degree=2, pre_sbn=True, post_sbn=True,
                 sbn_eps=1e-13, temperature_max=512.0, temperature_init=64.0,
                 temperature_lr=0.01, feature_dtype="bfloat16")  # fmt: skip


def map_cases(args, gen):
    d = args.d
    scale = build_attention("maclaurin", head_dim=d, num_heads=1)._scale
    x = torch.randn(args.b, args.h, args.n, d, generator=gen).requires_grad_()
    D = scale.numel()
    g_rows = torch.randn(args.b, args.h, args.n, D, generator=gen).bfloat16()
    g_keys = g_rows.transpose(-1, -2).contiguous().transpose(-1, -2)  # as φ(k)'s arrives
    compiled, cxx = compiled_maclaurin_rows(), shutil.which("g++") or shutil.which("c++")

    def run(rows, g):
        return lambda: torch.autograd.grad(rows(), x, g)

    bf16 = torch.bfloat16
    return {
        "eager": run(lambda: maclaurin_rows(x, scale, 2, bf16), g_rows),
        "compiled": run(lambda: compiled(x, scale, 2, bf16), g_rows),
        "native": run(lambda: native_maclaurin_rows(x, scale, bf16, cxx), g_rows),
        "native_keys": run(lambda: native_maclaurin_rows(x, scale, bf16, cxx, True), g_keys),
    }


def product_cases(args, gen):
    D = 1 + args.d + args.d * (args.d + 1) // 2
    shape = (args.b, args.h, D, args.n)
    phi_q = torch.randn(*shape, generator=gen).bfloat16().requires_grad_()
    phi_k = torch.randn(*shape, generator=gen).bfloat16().requires_grad_()
    v1 = torch.randn(args.b, args.h, args.n, args.d + 1, generator=gen).bfloat16()
    v1.requires_grad_()
    g = torch.randn(args.b, args.h, args.n, args.d + 1, generator=gen).bfloat16()

    def run(pad):
        def call():
            low = F.pad(v1, (0, pad)) if pad else v1
            out = phi_q.transpose(-1, -2) @ (phi_k @ low)
            out = out[..., : args.d + 1] if pad else out
            torch.autograd.grad(out, (phi_q, phi_k, v1), g)

        return call

    e = args.d + 1
    return {f"e = {e}": run(0), f"e = {e} padded to {e + -e % 16}": run(-e % 16)}


def fused_cases(args, gen):
    """Maps and products together: q, k, [v, 1] in, [numerator, denominator] out."""
    d = args.d
    scale = build_attention("maclaurin", head_dim=d, num_heads=1)._scale
    cxx = shutil.which("g++") or shutil.which("c++")
    q, k = (torch.randn(args.b, args.h, args.n, d, generator=gen).requires_grad_() for _ in "qk")
    v1 = torch.randn(args.b, args.h, args.n, d + 1, generator=gen).requires_grad_()
    g = torch.randn(args.b, args.h, args.n, d + 1, generator=gen)

    def unfused():
        phi_q = native_maclaurin_rows(q, scale, torch.bfloat16, cxx)
        phi_k = native_maclaurin_rows(k, scale, torch.bfloat16, cxx, True)
        out = phi_q @ (phi_k.transpose(-1, -2) @ v1.bfloat16())
        torch.autograd.grad(out, (q, k, v1), g.bfloat16())

    def fused(bf16, amx=True):
        def call():
            amx_tiles(cxx, amx)
            try:
                out = native_fused_products(q, k, v1, scale, cxx, bf16)
                torch.autograd.grad(out, (q, k, v1), g)
            finally:
                amx_tiles(cxx, True)

        return call

    cases = {
        "native map, bfloat16 products": unfused,
        "fused, float32": fused(False),
        "fused, bfloat16 inputs": fused(True),
    }
    if amx_tiles(cxx):  # the default there: the AVX512-BF16 loops beside it
        cases["fused, bfloat16 inputs on AMX tiles"] = cases.pop("fused, bfloat16 inputs")
        cases["fused, bfloat16 inputs, AVX512-BF16 loops"] = fused(True, amx=False)
    return cases


def attention_cases(args, gen):
    d, H = args.d, args.h
    softmax = build_attention(dict(name="softmax", dropout=0.0), head_dim=d, num_heads=H)
    compiled = build_attention({**WIDE_FAST, "compile_map": True}, head_dim=d, num_heads=H)
    native = build_attention({**WIDE_FAST, "native_map": True}, head_dim=d, num_heads=H)
    native.load_state_dict(compiled.state_dict())
    fused = build_attention({**WIDE_FAST, "native_fused": True}, head_dim=d, num_heads=H)
    fused.load_state_dict(compiled.state_dict())
    q, k, v = (torch.randn(args.b, H, args.n, d, generator=gen).requires_grad_() for _ in "qkv")
    mask = torch.ones(args.b, args.n, dtype=torch.bool)

    def run(attn, bf16):
        def call():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = attn(q, k, v, key_padding_mask=mask)
            torch.autograd.grad(out.float().square().mean(), (q, k, v))

        return call

    return {
        "softmax fp32": run(softmax, False),
        "softmax bf16": run(softmax, True),
        "macformer_wide_fast, compiled map": run(compiled, True),
        "macformer_wide_fast, native map": run(native, True),
        "macformer_wide_fast, fused products": run(fused, True),
    }


def measure(cases: dict, rounds: int, warmup: int) -> dict[str, list[float]]:
    names = list(cases)
    for _ in range(warmup):
        for name in names:
            cases[name]()
    times = defaultdict(list)
    for r in range(rounds):
        random.shuffle(names)
        for name in names:
            t = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t)
        progress(f"  round {r + 1}/{rounds}")
    return times


def table(times: dict[str, list[float]], base: str, order: list[str]) -> list[list[object]]:
    rows = []
    for name in order:
        ts = times[name]
        ratios = [t / b for t, b in zip(ts, times[base])]
        rows.append([name, f"{1e3 * median(ts):.2f}", f"{median(ratios):.3f}"])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--b", type=int, default=4, help="batch entries (default 4)")
    parser.add_argument("--h", type=int, default=2, help="heads (default 2)")
    parser.add_argument("--n", type=int, default=2000, help="positions (default 2000)")
    parser.add_argument("--d", type=int, default=32, help="head size (default 32)")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="maclaurin_map", help="file stem in results/")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    info = machine_info("cpu")
    items = [
        ("The map alone, bfloat16 rows, forward + backward", map_cases, "eager"),
        ("The two products, bfloat16, forward + backward", product_cases, None),
        ("The maps and the products, forward + backward", fused_cases, None),
        ("The attention call, forward + backward", attention_cases, "softmax fp32"),
    ]
    sections = []
    for title, build, base in items:
        progress(title)
        cases = build(args, gen)
        base = base or next(iter(cases))
        times = measure(cases, args.rounds, args.warmup)
        header = ["case", "median ms", f"ratio to {base}"]
        sections.append(f"## {title}\n\n" + md_table(header, table(times, base, list(cases))))
    extra = {
        "threads": str(torch.get_num_threads()),
        "shape": f"B={args.b}, H={args.h}, N={args.n}, d={args.d}",
        "rounds": f"{args.warmup} warm-up + {args.rounds} timed, shuffled order",
        "command": "python -m benchmarks.maclaurin_map"
        + "".join(f" {a}" for a in (argv if argv is not None else __import__("sys").argv[1:])),
    }
    text = md_header("The degree-2 map and the feature products, CPU", info, extra)
    text += "\nMedian times (ms) and the median over rounds of each case's time / the base's.\n\n"
    text += "\n\n".join(sections) + "\n"
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{args.name}.md"
    out.write_text(text)
    print(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
