"""Resident memory of a CPU training loop whose batch length changes every step.

The model of the LRA ListOps paper setting (embedding 64, FFN 128, 2 layers, 2 heads; RMFA
exp + ppSBN, the Macformer setting, by default) trains on random batches of 32 sequences
whose padded length is drawn from 100-2000 tokens at every step, as length-bucketed ListOps
batches are. Every 25 steps it prints the resident size now and its peak so far.

    python -m benchmarks.memory_growth --multiple 1  --steps 300   # padded to the longest
    python -m benchmarks.memory_growth --multiple 64 --steps 300   # rounded up to 64 tokens

With ``--multiple 1`` nearly every step has a new shape and the peak keeps rising (the C
heap fragments; ``macformer_lit/callbacks/memory.py``); rounding to multiples of 64 bounds
the shapes and the peak levels off. Results: ``results/memory_growth.md``.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

from benchmarks._common import cpu_model, git_state
from macformer_lit.data.common import padded_length
from macformer_lit.tasks import LitClassifier

RMFA_PPSBN = dict(
    name="rmfa",
    kernel="exp",
    num_features=128,
    p=2.0,
    measure="faithful",
    denominator="fallback",
    pre_sbn=True,
    post_sbn=True,
    sbn_eps=1e-13,
)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--multiple", type=int, default=64, help="pad lengths to a multiple of this")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--backend", choices=["rmfa_ppsbn", "softmax"], default="rmfa_ppsbn")
    args = ap.parse_args()
    attention = RMFA_PPSBN if args.backend == "rmfa_ppsbn" else {"name": "softmax"}
    torch.manual_seed(0)
    model = LitClassifier(
        vocab_size=16, num_classes=10, max_len=2048, pad_id=0, attention=attention
    ).model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    print(
        f"# {args.backend}, batch {args.batch}, lengths 100-2000 padded to multiples of "
        f"{args.multiple}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
        f"{cpu_model()}, commit {git_state()}"
    )
    start = time.time()
    for step in range(args.steps):
        longest = int(torch.randint(100, 2000, (1,), generator=g))
        n = padded_length(longest, args.multiple)
        lengths = torch.randint(longest // 2, longest + 1, (args.batch,), generator=g)
        mask = torch.arange(n)[None] < lengths[:, None]
        ids = torch.randint(1, 16, (args.batch, n), generator=g).masked_fill(~mask, 0)
        labels = torch.randint(0, 10, (args.batch,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(ids, mask), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 24:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            elapsed = time.time() - start
            print(
                f"step {step + 1} rss={rss_mb():.0f} peak={peak:.0f} MB t={elapsed:.0f}s",
                flush=True,
            )


if __name__ == "__main__":
    main()
