"""The Triton fused bidirectional Maclaurin products (attention/triton_fused.py): their
numbers (triton_interpreted.py) in a process of their own, under Triton's interpreter where
no GPU is; every kernel compiled for CUDA without a GPU; the refusals in one line. Skipped
where the triton package (or its CUDA assembler) is missing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from macformer_lit.attention import build_attention
from macformer_lit.attention import maclaurin as maclaurin_module
from macformer_lit.attention.triton_fused import triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_interpreted(script: str) -> None:
    """The tests of ``script`` (beside this file) in a fresh process: under Triton's
    interpreter where no GPU is, on the GPU where one is; they must all pass."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    here = Path(__file__).parent
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(here / script)],
        cwd=here.parents[1], env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]


needs_triton = pytest.mark.skipif(not triton_available(), reason="no triton package")


def _attention(d, **options):
    return build_attention(dict(name="maclaurin", **options), head_dim=d, num_heads=1)


@needs_triton
def test_the_kernels_numbers_in_their_own_process():
    """triton_interpreted.py in a fresh process: under Triton's interpreter where no GPU is
    (it must be on before triton.language is imported, which this process may have done
    already, e.g. through torch.compile), on the GPU where one is."""
    run_interpreted("triton_interpreted.py")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(degree=1), "triton_fused: true is the degree-2 map's fused kernel"),
        (dict(head_dim=96), "triton_fused: true takes head_dim ≤ 64; got 96"),
    ],
)
def test_refusals_in_one_line(options, message):
    spec = {"name": "maclaurin", "triton_fused": True, **options}
    head_dim = spec.pop("head_dim", 16)
    with pytest.raises(ValueError, match=message):
        build_attention(spec, head_dim=head_dim, num_heads=1)


def test_refused_on_a_gpu_machine_without_the_triton_package(monkeypatch):
    """A machine with a GPU and no triton is told before anything is built; on a CPU-only
    machine the option is inert (no CUDA tensors to take), as native_fused is on a GPU."""
    monkeypatch.setattr(maclaurin_module, "triton_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="triton_fused: true needs the triton package"):
        _attention(16, triton_fused=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _attention(16, triton_fused=True).triton_fused


def _has_ptxas() -> bool:
    """Whether the triton wheel ships its CUDA assembler (looked up without importing
    triton, which would fix the interpreter's setting for this process)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return False
    root = Path(next(iter(spec.submodule_search_locations)))
    return (root / "backends" / "nvidia" / "bin" / "ptxas").exists()


def compile_for_cuda(kernel, signature: dict, consts: dict, arch: int):
    """``kernel`` compiled to a cubin for sm_``arch`` with Triton's own ptxas (no GPU needed):
    ``signature`` the type of every other argument, ``consts`` the constexprs' values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(
        fn=kernel,
        signature={
            name: "constexpr" if name in consts else signature[name] for name in kernel.arg_names
        },
        constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()},
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))


# The argument types of each kernel: pointers, the two lengths, float scalars.
_POINTERS = {"X", "Y", "S", "OUT", "GX"}


@pytest.mark.skipif(not _has_ptxas(), reason="no Triton CUDA assembler")
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_cuda_without_a_gpu(arch, bf16):
    """Every kernel compiles to a cubin for an A100 (sm_80) and an H100 (sm_90) at the largest
    head size (64), with Triton's own ptxas: what the interpreter cannot check (layouts,
    tl.dot's shapes and precisions, registers and shared memory) fails here, not on a lent
    GPU."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernels are the interpreter's")
    from macformer_lit.attention import triton_kernels

    consts = {"BD": 64, "BL": 64, "BF16": bf16, "EXACT_BF16": False}
    for kernel in (
        triton_kernels.state_kernel,
        triton_kernels.apply_kernel,
        triton_kernels.pullback_kernel,
    ):
        signature = {
            name: "*fp32" if name in _POINTERS else "i32" if name in ("L", "d") else "fp32"
            for name in kernel.arg_names
            if name not in consts
        }
        compiled = compile_for_cuda(kernel, signature, consts, arch)
        assert compiled.asm["cubin"], kernel
