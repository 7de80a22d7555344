"""Dot-product kernels 𝒦(x) = Σ_N a_N x^N with a_N ≥ 0 (docs/maths.md §4).

Macformer Table 1, corrected: log has a₀ = 1, a_N = 1/N (the paper's ``1/min(1, N)`` is
undefined at N = 0); sqrt has a_N = (2N−3)!! / (2ᴺ N!) (the paper's ``max(1, 2N−3)`` is
wrong from N = 4 on); trigh is sinh + cosh = exp under another name. Coefficients are
closed form. ``register_kernel`` adds a kernel from its coefficient and exact functions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Kernel:
    """A dot-product kernel: Maclaurin coefficients, exact function, domain ``x < domain_max``."""

    name: str
    coefficient: Callable[[int], float]
    exact: Callable[[torch.Tensor], torch.Tensor]
    domain_max: float | None = None

    @property
    def restricted(self) -> bool:
        return self.domain_max is not None

    def truncated(self, x: torch.Tensor, order: int) -> torch.Tensor:
        """Σ_{N ≤ order} a_N x^N, e.g. order 1 gives the first-order baseline a₀ + a₁x."""
        return self.series(order).exact(x)

    def series(self, order: int) -> Kernel:
        """The kernel Σ_{N ≤ order} a_N x^N itself (a dot-product kernel: the same
        coefficients, zero past ``order``), defined for every x: what deterministic
        Maclaurin features of degree ``order`` compute exactly."""
        a = tuple(self.coefficient(n) for n in range(order + 1))
        # partials of module functions, not lambdas: a module holding the kernel pickles.
        return Kernel(
            f"{self.name}[≤{order}]",
            functools.partial(_series_coefficient, a),
            functools.partial(_series_exact, a),
        )


def _series_coefficient(a: tuple[float, ...], n: int) -> float:
    return a[n] if n < len(a) else 0.0


def _series_exact(a: tuple[float, ...], x: torch.Tensor) -> torch.Tensor:
    return sum(c * x**n for n, c in enumerate(a))


def _exp_coefficient(n: int) -> float:
    return math.exp(-math.lgamma(n + 1))


def _log_coefficient(n: int) -> float:
    return 1.0 if n == 0 else 1.0 / n


def _sqrt_coefficient(n: int) -> float:
    if n == 0:
        return 1.0
    # (2N−3)!! = (2N−2)! / (2^{N−1} (N−1)!), so a_N = (2N−2)! / (2^{2N−1} (N−1)! N!).
    return math.exp(
        math.lgamma(2 * n - 1) - (2 * n - 1) * math.log(2) - math.lgamma(n) - math.lgamma(n + 1)
    )


KERNELS: dict[str, Kernel] = {
    "exp": Kernel("exp", _exp_coefficient, torch.exp),
    "inv": Kernel("inv", lambda n: 1.0, lambda x: 1.0 / (1.0 - x), domain_max=1.0),
    "log": Kernel("log", _log_coefficient, lambda x: 1.0 - torch.log1p(-x), domain_max=1.0),
    # sinh x + cosh x = eˣ: the exp kernel under the name the papers report separately.
    "trigh": Kernel("trigh", _exp_coefficient, lambda x: torch.sinh(x) + torch.cosh(x)),
    "sqrt": Kernel("sqrt", _sqrt_coefficient, lambda x: 2.0 - torch.sqrt(1.0 - x), domain_max=1.0),
}


def get_kernel(name: str, *, bounded_inputs: bool = True) -> Kernel:
    """The kernel registered as ``name``. A backend passes ``bounded_inputs``: a kernel
    defined only below ``domain_max`` is refused unless the inputs are known to stay there
    (pre-SBN bounds |q·k|/√d by 1/√d)."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; valid kernels: {', '.join(sorted(KERNELS))}")
    kernel = KERNELS[name]
    if kernel.restricted and not bounded_inputs:
        raise ValueError(
            f"kernel {name!r} is only defined for q·k/√d < {kernel.domain_max}; "
            "enable pre_sbn: true (it bounds |q·k|/√d by 1/√d), or set bounded_inputs: true "
            "if your inputs already satisfy the bound"
        )
    return kernel


def register_kernel(
    name: str,
    coefficient: Callable[[int], float],
    exact: Callable[[torch.Tensor], torch.Tensor],
    *,
    domain_max: float | None = None,
) -> Kernel:
    """Add a kernel usable as ``kernel: name`` by rmfa and kernelized.

    ``coefficient(n)`` must be ≥ 0 for every n (Schoenberg); ``domain_max`` marks a kernel
    defined only for x < domain_max (it then needs pre-SBN, like inv, log and sqrt).
    """
    if name in KERNELS:
        raise ValueError(f"kernel {name!r} is already registered")
    bad = [n for n in range(32) if not coefficient(n) >= 0.0]
    if bad:
        raise ValueError(f"kernel {name!r} has negative or NaN coefficients at degrees {bad}")
    KERNELS[name] = Kernel(name, coefficient, exact, domain_max)
    return KERNELS[name]
