"""ListOps generator: a vectorised re-implementation of LRA's ``listops.py``.

Follows google-research/long-range-arena ``lra_benchmarks/data/listops.py`` (Tay et al.,
ICLR 2021), itself a fork of the ListOps generator of Nangia & Bowman (2018):
https://github.com/google-research/long-range-arena/blob/main/lra_benchmarks/data/listops.py

The distribution is LRA's ``generate_tree(1, max_depth=10, max_args=10)``:

- a node at depth < 10 (the root has depth 1) is an operator with probability 0.25,
  otherwise a uniform digit 0-9; depth 10 forces a digit;
- an operator draws its argument count uniformly from 2..10, then its children, then the
  operator uniformly from MIN, MAX, MED, SM (MED = int(median), SM = sum mod 10);
- length = operators + ``]`` + digits; trees with 500 < length < 2000 are kept.

The string is LRA's ``to_string``: an operator node is the nested pair
``((((op, c0), c1), ...), ']')`` with ``( a b )`` around every pair, so
``[MAX 2 9]`` is written ``( ( ( [MAX 2 ) 9 ) ] )``.

How this differs from LRA's loop without changing the distribution of kept trees:

- Trees are drawn breadth-first, thousands at once, in numpy. The shape alone decides
  the length and the digits and operators are independent of it, so they are drawn only
  for kept trees, and a tree is abandoned as soon as it cannot end below the maximum.
- LRA draws one stream and cuts a Python ``set`` (hash order) into 96k/2k/2k. Here every
  split has its own stream of blocks seeded by ``(seed, split, block)``, consumed in block
  order: the output does not depend on the number of processes, and a smaller request is
  a prefix of a larger one. Duplicates are dropped within and across splits (test keeps
  its trees first, then val, then train), so a cross-split duplicate is the only thing
  that could break the prefix property; none occurs in 100k trees of this length.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import math
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
SPLITS = ("train", "val", "test")
# Test draws first so that its trees win any cross-split duplicate (see module docstring).
GENERATION_ORDER = ("test", "val", "train")

# Atom codes of the string form: digits are their own value.
_OPEN, _CLOSE, _END, _OP0 = 10, 11, 12, 13
_ATOM_TEXT = [str(d).encode() for d in range(10)] + [b"(", b")", END.encode()]
_ATOM_TEXT += [op.encode() for op in OPERATORS]
_ATOM_WIDTH = np.array([len(t) for t in _ATOM_TEXT], dtype=np.int64)
_ATOM_BYTES = np.zeros((len(_ATOM_TEXT), int(_ATOM_WIDTH.max())), dtype=np.uint8)
for _code, _text in enumerate(_ATOM_TEXT):
    _ATOM_BYTES[_code, : len(_text)] = np.frombuffer(_text, dtype=np.uint8)


@dataclass(frozen=True)
class ListOpsParams:
    """LRA's generator flags (``listops.py`` defaults) and ``VALUE_P``."""

    max_depth: int = 10
    max_args: int = 10
    min_length: int = 500
    max_length: int = 2000
    value_p: float = 0.25

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class Block:
    """Kept trees of one block, in draw order."""

    expressions: list[bytes]
    labels: np.ndarray  # (T,) int64
    lengths: np.ndarray  # (T,) int64, operators + ']' + digits


def _group_starts(counts: np.ndarray) -> np.ndarray:
    """First index of each consecutive group of the given sizes."""
    return np.cumsum(counts) - counts


def _within_group(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., c-1 for every group of size c, concatenated."""
    total = int(counts.sum())
    return np.arange(total) - np.repeat(_group_starts(counts), counts)


def _grouped_median(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``int(np.median(group))`` for consecutive groups of digits 0-9."""
    group = np.repeat(np.arange(len(counts)), counts)
    histogram = np.bincount(group * 10 + values, minlength=10 * len(counts))
    below = np.cumsum(histogram.reshape(len(counts), 10), axis=1)  # (G, 10)
    # The r-th smallest (0-based) is the first digit with more than r values at or below it.
    lower = (below > ((counts - 1) // 2)[:, None]).argmax(axis=1)
    upper = (below > (counts // 2)[:, None]).argmax(axis=1)
    # The mean of the middle pair, truncated as int() does (the values are non-negative).
    return (lower + upper) // 2


def _draw_shapes(
    rng: np.random.Generator, attempts: int, p: ListOpsParams
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Draw ``attempts`` tree shapes level by level; return the kept ones.

    Level i lists the nodes at depth i + 1 as ``tree`` (which tree, non-decreasing) and
    ``nargs`` (0 for a digit); the children of level i's operators are consecutive groups
    of level i + 1, in order.
    """
    tree = np.arange(attempts)
    length = np.zeros(attempts, dtype=np.int64)
    alive = np.ones(attempts, dtype=bool)
    trees, nargs_per_level = [], []
    for depth in range(1, p.max_depth + 1):
        n = len(tree)
        # LRA: r = random.random(); a digit if r > VALUE_P, so an operator if r <= VALUE_P.
        is_op = rng.random(n) <= p.value_p if depth < p.max_depth else np.zeros(n, dtype=bool)
        nargs = np.zeros(n, dtype=np.int64)
        nargs[is_op] = rng.integers(2, p.max_args + 1, size=int(is_op.sum()))
        trees.append(tree)
        nargs_per_level.append(nargs)
        length += np.bincount(tree, weights=1 + is_op, minlength=attempts).astype(np.int64)
        pending = np.bincount(tree, weights=nargs, minlength=attempts).astype(np.int64)
        # Every pending child adds at least one token, so such trees can only be rejected.
        alive &= length + pending < p.max_length
        grow = is_op & alive[tree]
        tree = np.repeat(tree[grow], nargs[grow])
        if len(tree) == 0:
            break
    keep = alive & (length > p.min_length) & (length < p.max_length)
    new_id = np.cumsum(keep) - 1
    kept_trees, kept_nargs = [], []
    for tree, nargs in zip(trees, nargs_per_level):
        m = keep[tree]
        if not m.any():
            break
        kept_trees.append(new_id[tree[m]])
        kept_nargs.append(nargs[m])
    return kept_trees, kept_nargs, length[keep]


def _evaluate(
    rng: np.random.Generator, nargs_per_level: list[np.ndarray]
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Draw digits and operators, then compute values and subtree sizes bottom-up.

    Returns per level: the atom code of each node (digit value, or ``_OP0 + operator``),
    its value, and its subtree size in nodes.
    """
    codes = []
    for nargs in nargs_per_level:
        is_op = nargs > 0
        code = np.empty(len(nargs), dtype=np.int64)
        code[~is_op] = rng.integers(0, 10, size=int((~is_op).sum()))
        code[is_op] = _OP0 + rng.integers(0, len(OPERATORS), size=int(is_op.sum()))
        codes.append(code)
    values = [np.empty(0, dtype=np.int64)] * len(codes)
    sizes = [np.empty(0, dtype=np.int64)] * len(codes)
    for level in range(len(codes) - 1, -1, -1):
        code, nargs = codes[level], nargs_per_level[level]
        value, size = code.copy(), np.ones(len(code), dtype=np.int64)
        is_op = nargs > 0
        if is_op.any():
            k = nargs[is_op]
            child_value, child_size = values[level + 1], sizes[level + 1]
            starts = _group_starts(k)
            median = _grouped_median(child_value, k)
            candidates = np.stack(
                [
                    np.minimum.reduceat(child_value, starts),
                    np.maximum.reduceat(child_value, starts),
                    median,
                    np.add.reduceat(child_value, starts) % 10,
                ]
            )
            op = code[is_op] - _OP0
            value[is_op] = candidates[op, np.arange(len(k))]
            size[is_op] += np.add.reduceat(child_size, starts)
        values[level], sizes[level] = value, size
    return codes, values, sizes


def _render(
    trees: list[np.ndarray],
    nargs_per_level: list[np.ndarray],
    codes: list[np.ndarray],
    sizes: list[np.ndarray],
) -> list[bytes]:
    """Write every tree in LRA's string form, without recursion.

    In pre-order an operator with k arguments opens with k + 1 ``(`` and its operator;
    every child is followed by ``)`` and every operator closes with ``] )``. All subtrees
    end on a digit, so after a digit come ``)`` and ``] ) )`` once per operator ending
    there; the root has no parent, so the last ``)`` of each tree is dropped.
    """
    root_size = sizes[0]
    # Pre-order position of every node in the block, top-down.
    pos = [_group_starts(root_size)]
    for level in range(1, len(trees)):
        parent_nargs = nargs_per_level[level - 1]
        is_op = parent_nargs > 0
        k = parent_nargs[is_op]
        child_size = sizes[level]
        before = np.cumsum(child_size) - child_size
        offset = before - np.repeat(before[_group_starts(k)], k)
        pos.append(np.repeat(pos[level - 1][is_op] + 1, k) + offset)
    total = int(root_size.sum())
    code = np.empty(total, dtype=np.int64)
    nargs = np.empty(total, dtype=np.int64)
    op_last_node = []
    for level in range(len(trees)):
        code[pos[level]] = codes[level]
        nargs[pos[level]] = nargs_per_level[level]
        is_op = nargs_per_level[level] > 0
        op_last_node.append(pos[level][is_op] + sizes[level][is_op] - 1)
    # How many operators' subtrees end at each node (non-zero only at digits).
    ends = np.bincount(np.concatenate(op_last_node), minlength=total)

    is_op = nargs > 0
    n_atoms = np.where(is_op, nargs + 2, 2 + 3 * ends)
    first = _group_starts(n_atoms)
    atoms = np.full(int(n_atoms.sum()), _CLOSE, dtype=np.uint8)
    opens = nargs[is_op] + 1
    atoms[np.repeat(first[is_op], opens) + _within_group(opens)] = _OPEN
    atoms[first[is_op] + opens] = code[is_op]
    atoms[first[~is_op]] = code[~is_op]
    e = ends[~is_op]
    atoms[np.repeat(first[~is_op] + 2, e) + 3 * _within_group(e)] = _END

    # Each atom is followed by one space; a tree's text stops before its dropped ")".
    width = _ATOM_WIDTH[atoms] + 1
    start = np.cumsum(width) - width
    buf = np.full(int(width.sum()), ord(" "), dtype=np.uint8)
    buf[start] = _ATOM_BYTES[atoms, 0]
    # Only operators are longer than one byte.
    op_atom = np.flatnonzero(atoms >= _OP0)
    for j in range(1, _ATOM_BYTES.shape[1]):
        has = op_atom[_ATOM_WIDTH[atoms[op_atom]] > j]
        buf[start[has] + j] = _ATOM_BYTES[atoms[has], j]
    tree_first_node = _group_starts(root_size)
    tree_first_atom = first[tree_first_node]
    tree_last_atom = np.append(tree_first_atom[1:], len(atoms)) - 1
    lo, hi = start[tree_first_atom], start[tree_last_atom] - 1
    raw = buf.tobytes()
    return [raw[a:b] for a, b in zip(lo.tolist(), hi.tolist())]


def generate_block(
    seed: int, split: str, block: int, attempts: int, params: ListOpsParams
) -> Block:
    """Kept trees among ``attempts`` draws; a pure function of its arguments."""
    rng = np.random.default_rng([seed, SPLITS.index(split), block])
    trees, nargs, lengths = _draw_shapes(rng, attempts, params)
    if not trees:
        return Block([], np.empty(0, dtype=np.int64), lengths)
    codes, values, sizes = _evaluate(rng, nargs)
    return Block(_render(trees, nargs, codes, sizes), values[0], lengths)


def _blocks_ahead(missing: int, kept: list[int], in_flight: int) -> int:
    """Blocks to keep in flight for ``missing`` more trees, judged by the yield so far.

    The first block runs alone to measure the yield, so a small request (a 200-tree
    validation split is one block) computes no block it does not use.
    """
    if not kept:
        return 1
    per_block = max(1.0, sum(kept) / len(kept))
    return max(1, min(in_flight, math.ceil(missing / per_block)))


def iter_split(
    split: str,
    n: int,
    *,
    seed: int,
    seen: set[bytes] | None = None,
    params: ListOpsParams = ListOpsParams(),
    executor: Executor | None = None,
    in_flight: int = 4,
    attempts_per_block: int = 4096,
) -> Iterator[tuple[bytes, int]]:
    """Yield ``n`` distinct ``(expression, label)`` pairs of one split's stream.

    ``seen`` holds digests of trees already taken (other splits); it is updated in place.
    With an ``executor``, up to ``in_flight`` blocks are computed ahead; blocks are
    consumed in order whatever finishes first, so the output is the same.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0; got {n}")
    seen = set() if seen is None else seen
    block_ids = itertools.count()
    pending: deque[Future[Block]] = deque()
    kept: list[int] = []
    produced = 0
    try:
        while produced < n:
            if executor is None:
                block = generate_block(seed, split, next(block_ids), attempts_per_block, params)
            else:
                while len(pending) < _blocks_ahead(n - produced, kept, in_flight):
                    args = (seed, split, next(block_ids), attempts_per_block, params)
                    pending.append(executor.submit(generate_block, *args))
                block = pending.popleft().result()
            kept.append(len(block.expressions))
            for expression, label in zip(block.expressions, block.labels.tolist()):
                digest = hashlib.blake2b(expression, digest_size=16).digest()
                if digest in seen:
                    continue
                seen.add(digest)
                yield expression, label
                produced += 1
                if produced == n:
                    break
    finally:
        for future in pending:
            future.cancel()


def generate_examples(
    n: int,
    *,
    seed: int = 0,
    split: str = "train",
    params: ListOpsParams = ListOpsParams(),
) -> list[tuple[str, int]]:
    """``n`` distinct ``(expression, label)`` pairs in one process (tests, notebooks)."""
    return [(e.decode(), y) for e, y in iter_split(split, n, seed=seed, params=params)]


def _pool(processes: int) -> Executor | None:
    if processes <= 1:
        return None
    # Workers only run numpy, so fork is safe and, unlike spawn, needs no __main__ guard
    # in the user's script; spawn is the fallback where fork does not exist.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    # Workers ignore a terminal's Ctrl-C: the parent stops them and removes its files.
    from macformer_lit.interrupts import ignore_in_worker

    return ProcessPoolExecutor(
        processes, mp_context=mp.get_context(method), initializer=ignore_in_worker
    )


def write_tsv_files(
    paths: Mapping[str, Path],
    sizes: Mapping[str, int],
    *,
    seed: int,
    params: ListOpsParams = ListOpsParams(),
    processes: int | None = None,
    progress: bool = True,
    attempts_per_block: int = 4096,
) -> None:
    """Write ``sizes[split]`` examples per split to ``paths[split]`` as LRA does.

    LRA's ``write_to_file``: ``csv.writer(delimiter='\\t')`` (so ``\\r\\n`` line ends),
    header ``Source<TAB>Target``.
    """
    if processes is None:
        # The cores this process may use, which can be fewer than the machine has.
        affinity = getattr(os, "sched_getaffinity", None)
        processes = len(affinity(0)) if affinity else os.cpu_count() or 1
    seen: set[bytes] = set()
    executor = _pool(processes)
    total = sum(sizes[s] for s in SPLITS)
    bar = tqdm(total=total, desc="Generating ListOps", unit="tree", disable=not progress)
    try:
        for split in GENERATION_ORDER:
            paths[split].parent.mkdir(parents=True, exist_ok=True)
            with open(paths[split], "w", newline="") as f:
                writer = csv.writer(f, delimiter="\t")
                writer.writerow(["Source", "Target"])
                for expression, label in iter_split(
                    split,
                    sizes[split],
                    seed=seed,
                    seen=seen,
                    params=params,
                    executor=executor,
                    in_flight=2 * processes,
                    attempts_per_block=attempts_per_block,
                ):
                    writer.writerow([expression.decode(), label])
                    bar.update()
    finally:
        bar.close()
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
