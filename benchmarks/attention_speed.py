"""Time and peak memory of every attention backend against sequence length N, as ratios to
softmax (torch SDPA) measured in the same run.

For each N, every method x direction (bidirectional, causal) x pass (forward, forward+backward)
is timed in interleaved rounds: each round runs every case once, in a shuffled order, for each
thread count asked for; a method's ratio in a round is its time over softmax's time (same
direction, pass and thread count) in that round, and the table reports the median over rounds
(docs/pitfalls.md §9: the machine is shared, absolute times swing, interleaved ratios do not).

- forward: ``torch.no_grad()``, modules in eval mode (inference);
- forward+backward: modules in train mode, ``out.backward(g)`` with a fixed random g, the
  gradients of q, k, v included;
- peak memory: on CUDA ``torch.cuda.max_memory_allocated()`` after a reset, minus what was
  allocated before the call; on CPU the peak of the running sum of the allocator's
  allocations and frees recorded by ``torch.profiler`` (``profile_memory=True``) during one call,
  i.e. the peak extra bytes the call allocated (inputs excluded), measured in a separate pass so
  profiling never slows a timed call.

Inputs are pre-SBN'd random q, k (standardised per head and channel, rows L2-normalised, as
ppSBN feeds the core) and Gaussian v, so RMF denominators stay positive and no fallback path
runs. Methods: softmax (SDPA, is_causal=True when causal), kernelized exp (exact, O(N²)
memory, skipped above ``--kernelized-max-n``), RMFA faithful / official / h01, FAVOR+, linear
(elu+1), RMFA inside ppSBN (pre and post), and performer-pytorch's ``FastAttention`` when the
package is installed.

    python -m benchmarks.attention_speed                           # the committed CPU run
    python -m benchmarks.attention_speed --device cuda             # on a GPU
    python -m benchmarks.attention_speed --ns 256,512 --repeats 2  # a quick check
    python -m benchmarks.attention_speed --threads 1,2 --ns 512,2048,4096 \
        --methods rmfa,favor,linear --name attention_speed_threads  # 1 vs 2 threads

On CPU the default is one intra-op thread: on a shared machine a second thread mostly
measures the scheduler (every parallel op waits for both threads; methods made of many small
ops, like RMFA, suffer most). ``--threads 1,2`` interleaves both settings in every round.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from macformer_lit.attention import build_attention
from macformer_lit.attention.native_map import cxx_compiler

try:
    from benchmarks._common import (
        cpu_allocation_peak,
        csv_comment_header,
        machine_info,
        md_header,
        md_table,
        median,
        progress,
        sdpa_path,
    )
except ImportError:  # run as a script: python benchmarks/attention_speed.py
    from _common import (
        cpu_allocation_peak,
        csv_comment_header,
        machine_info,
        md_header,
        md_table,
        median,
        progress,
        sdpa_path,
    )

RESULTS = Path(__file__).resolve().parent / "results"
DIRECTIONS = ("bidirectional", "causal")
PASSES = ("fwd", "fwd+bwd")


@dataclass
class Method:
    name: str
    label: str
    build: Callable[[bool], Callable]  # causal -> fn(q, k, v, causal)
    max_n: int | None = None  # skipped above this N (both directions)
    causal_max_n: int | None = None  # skipped above this N (causal only)
    skip_reason: str = ""
    note: str = ""

    def skip(self, N: int, causal: bool) -> bool:
        limit = self.causal_max_n if causal and self.causal_max_n else self.max_n
        return limit is not None and N > limit


def ours(name: str, **options) -> Callable[[bool], Callable]:
    def make(causal: bool):
        return build_attention(name, **options)

    return make


def performer_methods(head_dim: int, num_features: int, causal_max_n: int) -> list[Method]:
    """performer-pytorch's FAVOR+ (``FastAttention``), if the package imports."""
    try:
        from performer_pytorch import FastAttention
    except Exception:
        return []

    def make(causal: bool):
        # The causal CPU path prints a notice that it falls back to its non-CUDA version.
        with contextlib.redirect_stdout(io.StringIO()):
            fa = FastAttention(dim_heads=head_dim, nb_features=num_features, causal=causal)
        return fa

    note = (
        "performer-pytorch FastAttention(nb_features=D); no masks; causal runs its "
        "non-CUDA chunked prefix-sum path unless fast-transformers' CUDA kernel is installed"
    )
    return [
        Method(
            "performer_pytorch",
            "FAVOR+ (performer-pytorch)",
            make,
            causal_max_n=causal_max_n,
            skip_reason="its non-CUDA causal path keeps a (B, H, N, D, d) prefix-sum tensor "
            "for backward (582 MiB at N = 2048 here) and is ~10x slower than SDPA",
            note=note,
        )
    ]


def maclaurin_methods(common: dict, device: str) -> list[Method]:
    """The degree-2 Maclaurin attention (no ppSBN: the core alone) eager, with the native map,
    and with the fused products in float32 and with bfloat16 inputs (native_fused on a CPU,
    triton_fused on a GPU; docs/maths.md §14). The native kernels need a C++ compiler."""
    spec = {"name": "maclaurin", **common}
    methods = [Method("maclaurin", "degree-2 Maclaurin, eager", ours(**spec))]
    on_gpu = device.startswith("cuda")
    if cxx_compiler() is None and not on_gpu:
        return methods
    fused = {"triton_fused": True} if on_gpu else {"native_map": True, "native_fused": True}
    if not on_gpu:
        label = "degree-2 Maclaurin, native map"
        methods.append(Method("maclaurin_native", label, ours(**spec, native_map=True)))
    methods += [
        Method("maclaurin_fused", "degree-2 Maclaurin, fused float32", ours(**spec, **fused)),
        Method(
            "maclaurin_fused_bf16",
            "degree-2 Maclaurin, fused, bf16 inputs",
            ours(**spec, **fused, feature_dtype="bfloat16"),
        ),
    ]
    return methods


def all_methods(args) -> list[Method]:
    d, H, D = args.head_dim, args.heads, args.num_features
    common = {"head_dim": d, "num_heads": H}
    methods = [
        Method("softmax", "softmax (torch SDPA)", ours("softmax", **common)),
        Method(
            "kernelized",
            "kernelized exp (exact, O(N²))",
            ours("kernelized", kernel="exp", **common),
            args.kernelized_max_n,
            skip_reason="O(N²) memory and time (one (B, H, N, N) fp32 matrix is "
            "{gib:.1f} GiB at this N)",
        ),
        Method(
            "rmfa",
            f"RMFA faithful, D={D}",
            ours("rmfa", num_features=D, measure="faithful", **common),
        ),
        Method(
            "rmfa_official",
            f"RMFA official (SchoenbAt), D={D}",
            ours("rmfa", num_features=D, measure="official", **common),
        ),
        Method(
            "rmfa_h01",
            f"RMFA h01 (variance-reduced), D={D}",
            ours("rmfa", num_features=D, measure="h01", **common),
        ),
        Method("favor", f"FAVOR+ (ours), D={D}", ours("favor", num_features=D, **common)),
        Method("linear", "linear (elu+1)", ours("linear", **common)),
        Method(
            "rmfa_ppsbn",
            f"RMFA faithful + ppSBN (pre and post), D={D}",
            ours("rmfa", num_features=D, pre_sbn=True, post_sbn=True, **common),
        ),
    ]
    methods += performer_methods(d, D, args.performer_causal_max_n)
    methods += maclaurin_methods(common, args.device)
    if args.methods:
        wanted = args.methods.split(",")
        unknown = set(wanted) - {m.name for m in methods}
        if unknown:
            have = [m.name for m in methods]
            raise SystemExit(f"unknown method(s) {sorted(unknown)}; have {have}")
        methods = [m for m in methods if m.name == "softmax" or m.name in wanted]
    return methods


def pre_sbn_inputs(B, H, N, d, seed, device, dtype):
    """Random q, k standardised per (head, channel) and L2-normalised per row; Gaussian v."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, d, generator=g) for _ in range(3))

    def sbn(x):
        x = (x - x.mean((0, 2), keepdim=True)) / x.std((0, 2), unbiased=False, keepdim=True)
        return F.normalize(x, dim=-1)

    return [t.to(device=device, dtype=dtype) for t in (sbn(q), sbn(k), v)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class Case:
    """One method x direction x pass at one N: a zero-argument callable and its setup."""

    def __init__(self, method: Method, module, causal: bool, pas: str, inputs, grad):
        self.method, self.module, self.causal, self.pas = method, module, causal, pas
        q, k, v = inputs
        if pas == "fwd":
            self.q, self.k, self.v = q, k, v
        else:
            self.q, self.k, self.v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        self.grad = grad

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.method.name, DIRECTIONS[self.causal], self.pas)

    def __call__(self) -> None:
        q, k, v = self.q, self.k, self.v
        if hasattr(self.module, "train"):
            self.module.train(self.pas != "fwd")
        if self.pas == "fwd":
            with torch.no_grad():
                self._call(q, k, v)
            return
        for t in (q, k, v):
            t.grad = None
        self._call(q, k, v).backward(self.grad)

    def _call(self, q, k, v):
        if self.method.name == "performer_pytorch":
            return self.module(q, k, v)
        return self.module(q, k, v, causal=self.causal)


def time_call(case: Case, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    case()
    sync(device)
    return time.perf_counter() - t0


def peak_memory(case: Case, device: str) -> int:
    """Peak extra bytes allocated during one call (see the module docstring)."""
    if device.startswith("cuda"):
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        case()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    return cpu_allocation_peak(case)[0]


def run(args) -> dict:
    device, dtype = args.device, getattr(torch, args.dtype)
    B, H, d = args.batch, args.heads, args.head_dim
    threads = [int(t) for t in args.threads.split(",")]
    if device.startswith("cuda"):
        threads = [torch.get_num_threads()]
    threads = [t or torch.get_num_threads() for t in threads]
    ns = [int(n) for n in args.ns.split(",")]
    methods = all_methods(args)
    rng = random.Random(args.seed)
    times: dict = defaultdict(list)  # (N, threads, method, direction, pass) -> [s per round]
    memory: dict = {}
    skipped: dict = {}
    loads: list[float] = []  # 1-minute load average after every round
    start = time.perf_counter()
    for N in ns:
        inputs = pre_sbn_inputs(B, H, N, d, args.seed, device, dtype)
        grad = torch.randn(B, H, N, d, generator=torch.Generator().manual_seed(args.seed + 1))
        grad = grad.to(device=device, dtype=dtype)
        cases = []
        for m in methods:
            modules = {}
            for c in (False, True):
                if m.skip(N, c):
                    reason = m.skip_reason.format(gib=B * H * N * N * 4 / 2**30)
                    skipped[(N, m.name, DIRECTIONS[c])] = f"skipped: {reason}"
                    continue
                torch.manual_seed(args.seed)  # the same feature draw at every N
                modules[c] = m.build(c).to(device=device, dtype=dtype)
            for causal in modules:
                for pas in PASSES:
                    cases.append(Case(m, modules[causal], causal, pas, inputs, grad))
        repeats = args.repeats if N < args.large_n else args.large_repeats
        total = args.warmup + repeats
        for r in range(total):
            for t in threads if r % 2 == 0 else threads[::-1]:
                torch.set_num_threads(t)
                order = cases[:]
                rng.shuffle(order)
                t0 = time.perf_counter()
                for case in order:
                    elapsed = time_call(case, device)
                    if r >= args.warmup:
                        times[(N, t, *case.key)].append(elapsed)
                phase = "warm-up" if r < args.warmup else "timed"
                now = time.perf_counter()
                load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
                loads.append(load)
                progress(
                    f"N={N:>6} threads={t} round {r + 1}/{total} ({phase}): {len(order)} calls "
                    f"in {now - t0:6.1f} s, total {now - start:7.1f} s, load {load:.2f}"
                )
        if not args.no_memory:
            torch.set_num_threads(threads[0])
            for case in cases:
                memory[(N, *case.key)] = peak_memory(case, device)
        for t in threads:
            for case in cases:
                key = (N, t, *case.key)
                ref = (N, t, "softmax", *case.key[1:])
                ratio = median([a / b for a, b in zip(times[key], times[ref], strict=True)])
                mem = memory.get((N, *case.key))
                progress(
                    f"  N={N:>6} threads={t} {case.key[0]:<18} {case.key[1]:<13} {case.key[2]:<7} "
                    f"median {median(times[key]) * 1e3:9.1f} ms  ratio to softmax {ratio:7.3f}"
                    + ("" if mem is None else f"  peak {mem / 2**20:8.1f} MiB")
                )
        del cases, inputs, grad
    return {
        "ns": ns,
        "threads": threads,
        "methods": methods,
        "times": times,
        "memory": memory,
        "skipped": skipped,
        "wall_s": time.perf_counter() - start,
        "loads": loads,
    }


def paired_ratio(times, N, t, a, b, direction, pas) -> float:
    """Median over rounds of time(a) / time(b) measured in the same round."""
    xa, xb = times.get((N, t, a, direction, pas)), times.get((N, t, b, direction, pas))
    if not xa or not xb:
        return float("nan")
    return median([x / y for x, y in zip(xa, xb, strict=True)])


def memory_slope(memory, ns, method, direction, pas, n_min=1024) -> float:
    """Least-squares slope of log(peak bytes) against log(N) for N ≥ n_min (1 = linear)."""
    pts = [
        (math.log(N), math.log(memory[(N, method, direction, pas)]))
        for N in ns
        if N >= n_min and memory.get((N, method, direction, pas), 0) > 0
    ]
    if len(pts) < 2:
        return float("nan")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def fmt(x: float, digits: int = 3) -> str:
    if x != x:
        return "–"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def verdicts(res, device) -> list[str]:
    """The issue's speed targets, checked on the measured numbers (forward+backward)."""
    times, memory, ns = res["times"], res["memory"], res["ns"]
    names = {m.name for m in res["methods"]}
    if "rmfa" not in names:
        return ["- the targets are RMFA's: `rmfa` is not among this run's methods, not checked"]
    lines = []
    for t in res["threads"]:
        tag = f"threads={t}" if not device.startswith("cuda") else device
        r = {
            N: paired_ratio(times, N, t, "rmfa", "softmax", "bidirectional", "fwd+bwd") for N in ns
        }

        def verdict(ok):
            return "**met**" if ok else "**NOT met**"

        for N, bound in ((4096, 0.09), (16384, 0.05)):
            if N in r:
                lines.append(
                    f"- [{tag}] bidirectional RMFA ≤ {bound} × SDPA at N = {N}: "
                    f"{verdict(r[N] <= bound)} (measured {r[N]:.3f})"
                )
        faster = {N: r[N] for N in ns if N >= 512}
        if faster:
            slow = [N for N, x in faster.items() if not x < 1.0]
            lines.append(
                f"- [{tag}] bidirectional RMFA faster than SDPA from N = 512 on: "
                f"{verdict(not slow)} (ratios "
                + ", ".join(f"{N}: {x:.2f}" for N, x in faster.items())
                + (f"; not faster at N = {slow}" if slow else "")
                + ")"
            )
        for other, label in (("favor", "our FAVOR+"), ("performer_pytorch", "performer-pytorch")):
            if other not in names:
                if other == "performer_pytorch":
                    why = "not selected" if performer_methods(8, 8, 0) else "not installed"
                    lines.append(f"- [{tag}] RMFA vs performer-pytorch: {why}, not measured")
                continue
            for direction in DIRECTIONS:
                rr = {N: paired_ratio(times, N, t, "rmfa", other, direction, "fwd+bwd") for N in ns}
                missing = [N for N, x in rr.items() if x != x]
                rr = {N: x for N, x in rr.items() if x == x}
                slow = [N for N, x in rr.items() if x > 1.0]
                lines.append(
                    f"- [{tag}] RMFA no slower than {label} at D = 128, {direction}: "
                    f"{verdict(not slow)} (time RMFA / {label}: "
                    + ", ".join(f"{N}: {x:.2f}" for N, x in rr.items())
                    + (f"; slower at N = {slow}" if slow else "")
                    + (f"; not measured at N = {missing}" if missing else "")
                    + ")"
                )
        if 4096 in ns:
            c = paired_ratio(times, 4096, t, "rmfa", "softmax", "causal", "fwd+bwd")
            lines.append(
                f"- [{tag}] causal RMFA ≤ 0.25 × SDPA(is_causal=True) at N = 4096: "
                f"{verdict(c <= 0.25)} (measured {c:.3f})"
            )
    if memory and sum(N >= 1024 for N in ns) >= 2:
        s = memory_slope(memory, ns, "rmfa", "causal", "fwd+bwd")
        pts = ", ".join(
            f"{N}: {memory[(N, 'rmfa', 'causal', 'fwd+bwd')] / 2**20:.0f} MiB"
            for N in ns
            if (N, "rmfa", "causal", "fwd+bwd") in memory
        )
        lines.append(
            f"- causal RMFA memory linear in N: {'**met**' if s <= 1.1 else '**NOT met**'} "
            f"(log-log slope of peak fwd+bwd memory for N ≥ 1024: {s:.2f}; {pts})"
        )
    return lines


def write_outputs(res, args, info, extra) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or ("attention_speed" if args.device == "cpu" else "attention_speed_cuda")
    times, memory, ns, threads = res["times"], res["memory"], res["ns"], res["threads"]
    methods = res["methods"]
    rows = []
    for N in ns:
        for t in threads:
            for m in methods:
                for direction in DIRECTIONS:
                    for pas in PASSES:
                        key = (N, t, m.name, direction, pas)
                        row = {
                            "device": args.device,
                            "threads": t,
                            "N": N,
                            "method": m.name,
                            "direction": direction,
                            "pass": pas,
                            "B": args.batch,
                            "H": args.heads,
                            "d": args.head_dim,
                            "D": args.num_features,
                            "dtype": args.dtype,
                        }

                        def ratio(name, direction, pas, N=N, t=t):
                            return paired_ratio(times, N, t, name, "softmax", direction, pas)

                        if (N, m.name, direction) in res["skipped"]:
                            row["status"] = res["skipped"][(N, m.name, direction)]
                        elif key in times:
                            xs = times[key]
                            mem = memory.get((N, m.name, direction, pas))
                            mem_ref = memory.get((N, "softmax", direction, pas))
                            row.update(
                                status="ok",
                                rounds=len(xs),
                                median_s=f"{median(xs):.6g}",
                                min_s=f"{min(xs):.6g}",
                                max_s=f"{max(xs):.6g}",
                                ratio_to_softmax=f"{ratio(m.name, direction, pas):.6g}",
                                peak_mem_bytes="" if mem is None else mem,
                                mem_ratio_to_softmax=""
                                if mem is None or not mem_ref
                                else f"{mem / mem_ref:.6g}",
                            )
                        else:
                            continue
                        rows.append(row)
    fields = [
        "device", "threads", "N", "method", "direction", "pass", "B", "H", "d", "D", "dtype",
        "status", "rounds", "median_s", "min_s", "max_s", "ratio_to_softmax",
        "peak_mem_bytes", "mem_ratio_to_softmax",
    ]  # fmt: skip
    with open(out / f"{stem}.csv", "w", newline="") as f:
        f.write(csv_comment_header(info, extra))
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)

    raw = {
        "machine": info,
        "run": extra,
        "times_s": {"|".join(map(str, k)): v for k, v in times.items()},
        "peak_memory_bytes": {"|".join(map(str, k)): v for k, v in memory.items()},
        "skipped": {"|".join(map(str, k)): v for k, v in res["skipped"].items()},
        "load_average_after_each_round": res["loads"],
        "args": vars(args),
    }
    (out / f"{stem}.json").write_text(json.dumps(raw, indent=1))

    md = [md_header("Attention speed and memory", info, extra)]
    md.append("## Targets (forward+backward, B=1, H=8, d=64, D=128, fp32)\n")
    md += verdicts(res, args.device)
    md.append("")
    for pas in ("fwd+bwd", "fwd"):
        for direction in DIRECTIONS:
            for t in threads:
                title = f"## Time ratio to softmax, {direction}, {pas}"
                if not args.device.startswith("cuda"):
                    title += f", threads={t}"
                md.append(title + "\n")
                md.append(
                    "Median over rounds of (method time / softmax time in the same round); "
                    "last row: softmax's median time.\n"
                )
                table = []
                for m in methods:
                    cells = []
                    for N in ns:
                        if (N, m.name, direction) in res["skipped"]:
                            cells.append("skip")
                        else:
                            cells.append(
                                fmt(paired_ratio(times, N, t, m.name, "softmax", direction, pas))
                            )
                    table.append([m.label, *cells])
                table.append(
                    [
                        "softmax time (ms)",
                        *[fmt(median(times[(N, t, "softmax", direction, pas)]) * 1e3) for N in ns],
                    ]
                )
                md.append(md_table(["method \\ N", *map(str, ns)], table) + "\n")
    if memory:
        for pas in ("fwd+bwd", "fwd"):
            for direction in DIRECTIONS:
                md.append(f"## Peak memory (MiB), {direction}, {pas}\n")
                md.append("Extra bytes allocated during one call (inputs excluded).\n")
                table = []
                for m in methods:
                    cells = []
                    for N in ns:
                        x = memory.get((N, m.name, direction, pas))
                        cells.append("skip" if x is None else fmt(x / 2**20))
                    table.append([m.label, *cells])
                md.append(md_table(["method \\ N", *map(str, ns)], table) + "\n")
    notes = [m for m in methods if m.note]
    if notes or res["skipped"]:
        md.append("## Notes\n")
        md += [f"- {m.label}: {m.note}" for m in notes]
        for m in methods:
            if m.max_n:
                gib = args.batch * args.heads * (2 * m.max_n) ** 2 * 4 / 2**30
                md.append(
                    f"- {m.label}: skipped above N = {m.max_n}, O(N²) memory and time "
                    f"(one (B, H, N, N) fp32 matrix is {gib:.0f} GiB at N = {2 * m.max_n})."
                )
            if m.causal_max_n:
                md.append(
                    f"- {m.label}, causal: skipped above N = {m.causal_max_n}: {m.skip_reason}."
                )
        md.append("")
    (out / f"{stem}.md").write_text("\n".join(md))
    plot(res, args, out / f"{stem}.png")


def plot(res, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, memory, ns, threads = res["times"], res["memory"], res["ns"], res["threads"]
    methods = [m for m in res["methods"]]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {m.name: colors[i % len(colors)] for i, m in enumerate(methods)}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(2, 2, figsize=(13, 10))
    for col, direction in enumerate(DIRECTIONS):
        ax = axes[0, col]
        for ti, t in enumerate(threads):
            for m in methods:
                xs = [N for N in ns if (N, t, m.name, direction, "fwd+bwd") in times]
                ys = [
                    paired_ratio(times, N, t, m.name, "softmax", direction, "fwd+bwd") for N in xs
                ]
                if not xs:
                    continue
                label = m.label if ti == 0 else None
                ax.plot(xs, ys, styles[ti % 4], marker="o", ms=3, color=color[m.name], label=label)
        if direction == "bidirectional":
            ax.plot([4096, 16384], [0.09, 0.05], "k*", ms=12, label="targets (RMFA)")
        else:
            ax.plot([4096], [0.25], "k*", ms=12, label="target (causal RMFA)")
        title = f"{direction}, forward+backward"
        if not args.device.startswith("cuda"):
            names = {"-": "solid", "--": "dashed", ":": "dotted", "-.": "dash-dot"}
            title += "  (" + ", ".join(
                f"{names[styles[i]]}: threads={t}" for i, t in enumerate(threads)
            )
            title += ")"
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="N",
            ylabel="time / softmax time (same run)",
            title=title,
        )
        ax.set_xticks(ns, [str(n) for n in ns], rotation=45)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax = axes[1, col]
        for m in methods:
            xs = [N for N in ns if (N, m.name, direction, "fwd+bwd") in memory]
            ys = [memory[(N, m.name, direction, "fwd+bwd")] / 2**20 for N in xs]
            if xs:
                ax.plot(xs, ys, "-o", ms=3, color=color[m.name], label=m.label)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="N",
            ylabel="peak extra memory (MiB)",
            title=f"{direction}, forward+backward, peak memory",
        )
        ax.set_xticks(ns, [str(n) for n in ns], rotation=45)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    h2, l2 = axes[0, 1].get_legend_handles_labels()
    for h, lab in zip(h2, l2):
        if lab not in labels:
            handles.append(h)
            labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(
        f"Attention speed and memory, {args.device}, B={args.batch}, H={args.heads}, "
        f"d={args.head_dim}, D={args.num_features}, {args.dtype}"
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.attention_speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--ns", default="256,512,1024,2048,4096,8192,16384", help="sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--num-features", type=int, default=128, help="D for RMFA and FAVOR+")
    p.add_argument(
        "--threads",
        default="1",
        help="comma-separated CPU intra-op thread counts, interleaved in every round; 0 = "
        "torch's default (default: 1); ignored on CUDA",
    )
    p.add_argument("--methods", default="", help="comma-separated subset (softmax always runs)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds for N < --large-n")
    p.add_argument("--large-repeats", type=int, default=3, help="timed rounds for N ≥ --large-n")
    p.add_argument("--large-n", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones")
    p.add_argument(
        "--kernelized-max-n", type=int, default=4096, help="skip exact kernelized above this N"
    )
    p.add_argument(
        "--performer-causal-max-n",
        type=int,
        default=4096,
        help="skip performer-pytorch's causal path above this N",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS), help="output folder")
    p.add_argument(
        "--render",
        default="",
        metavar="JSON",
        help="re-render the tables and plot from a previous run's raw JSON (no measuring)",
    )
    p.add_argument("--name", default="", help="file stem (default attention_speed[_cuda])")
    return p.parse_args(argv)


def from_json(path: str, argv) -> tuple:
    """Rebuild a run's results from its raw JSON (to re-render tables and plots)."""
    raw = json.loads(Path(path).read_text())
    args = parse_args(argv)
    for key, value in raw.get("args", {}).items():
        if key not in ("render", "out", "name"):
            setattr(args, key, value)

    def keys(d, convert):
        return {tuple(c(x) for c, x in zip(convert, k.split("|"))): v for k, v in d.items()}

    res = {
        "ns": [int(n) for n in args.ns.split(",")],
        "methods": all_methods(args),
        "times": keys(raw["times_s"], (int, int, str, str, str)),
        "memory": keys(raw["peak_memory_bytes"], (int, str, str, str)),
        "skipped": keys(raw["skipped"], (int, str, str)),
        "loads": raw.get("load_average_after_each_round", []),
    }
    res["threads"] = sorted({k[1] for k in res["times"]})
    return args, res, raw["machine"], raw["run"]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.render:
        args, res, info, extra = from_json(args.render, argv)
        write_outputs(res, args, info, extra)
        progress(f"re-rendered {args.render} into {args.out}/")
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but torch.cuda.is_available() is False")
    info = machine_info(args.device)
    paths = sdpa_path(args.device, getattr(torch, args.dtype), args.head_dim)
    extra = {
        "SDPA path (bidirectional)": ", ".join(paths["bidirectional"]),
        "SDPA path (causal, is_causal=True)": ", ".join(paths["causal"]),
        "shape": f"B={args.batch}, H={args.heads}, d={args.head_dim}, D={args.num_features}, "
        f"{args.dtype}",
        "rounds": f"{args.warmup} warm-up + {args.repeats} timed (N < {args.large_n}), "
        f"{args.large_repeats} timed (N ≥ {args.large_n}); order shuffled every round",
        "memory": "torch.cuda.max_memory_allocated after a reset"
        if args.device.startswith("cuda")
        else "torch.profiler (profile_memory=True): peak of the running sum of allocations "
        "during one call, inputs excluded",
        "performer-pytorch": "installed" if performer_methods(8, 8, 0) else "not installed",
        "command": " ".join(["python -m benchmarks.attention_speed", *sys.argv[1:]]),
    }
    progress("\n".join(f"{k}: {v}" for k, v in {**info, **extra}.items()))
    res = run(args)
    extra["wall time"] = f"{res['wall_s']:.0f} s"
    if hasattr(os, "getloadavg"):
        extra["load average at end (1/5/15 min)"] = "{:.2f} / {:.2f} / {:.2f}".format(
            *os.getloadavg()
        )
    write_outputs(res, args, info, extra)
    progress(f"wrote {args.out}/ in {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
