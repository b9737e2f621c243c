"""Cost of each bound in ms/sample and in forward passes of the layer.

    python -m attncert.bounds.bench [--batch 64] [--dtype float32] [--repeats 3]
                                    [--threads N] [--clock wall|process]

Random layer with spectral norms 1 for W^Q, W^K, W^V, W^O, projected inputs (||x_i|| <= 1),
certificate-grade spectral norms (mode="upper"). Torch's default thread count.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..pipeline import rng
from .lofast import lofast_from_terms, lofast_terms, m_spectral, naive_bound, xi, zeta_spectral
from .specformer import specformer_bound
from .weights import AttentionWeights, attention_forward

SIZES = ((65, 128, 4), (65, 384, 8))


def bench_layer(n: int, d: int, h: int, batch: int, dtype: torch.dtype, seed: int = 0):
    """Random residual layer with unit spectral-norm weights and projected inputs."""
    g = rng.generator(seed, "cpu")  # the benchmark runs on the host
    d_h = d // h

    def unit(*shape):
        m = torch.randn(*shape, generator=g, dtype=torch.float64)
        return (m / torch.linalg.matrix_norm(m, 2)[:, None, None]).to(dtype)

    w = AttentionWeights(unit(h, d, d_h), unit(h, d, d_h), unit(h, d, d_h), unit(h, d_h, d))
    x = torch.randn(batch, n, d, generator=g, dtype=torch.float64)
    x = (x / x.norm(dim=-1, keepdim=True).clamp_min(1.0)).to(dtype)
    return w, x


def _time(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def bench_size(
    n: int,
    d: int,
    h: int,
    batch: int,
    dtype: torch.dtype,
    repeats: int,
    eps: float = 0.05,
    clock=time.perf_counter,
) -> list[tuple]:
    """Rows (size, variant, ms/sample, ratio to forward, Lanczos iterations) for one size."""
    w, x = bench_layer(n, d, h, batch, dtype)
    iters = {}

    def zeta_fn():
        iters["zeta"] = zeta_spectral(x, w, True).iterations

    def m_fn():
        iters["m_norm"] = m_spectral(x, w).iterations

    variants = {
        "forward": lambda: attention_forward(x, w, True),
        "zeta": zeta_fn,
        "m_norm": m_fn,
        "xi": lambda: xi(x, w),
        "lofast M": lambda: lofast_from_terms(lofast_terms(x, w, True, "M"), eps),
        "lofast xi": lambda: lofast_from_terms(lofast_terms(x, w, True, "xi"), eps),
        "naive": lambda: naive_bound(x, w, eps, True),
        "specformer": lambda: specformer_bound(x, w, eps, True),
    }
    with torch.no_grad():
        times = {k: _time(f, repeats, clock) / batch * 1e3 for k, f in variants.items()}
    return [((n, d, h), k, ms, ms / times["forward"], iters.get(k)) for k, ms in times.items()]


def run(batch: int = 64, dtype: torch.dtype = torch.float32, repeats: int = 3):
    """All sizes of SIZES."""
    return [row for n, d, h in SIZES for row in bench_size(n, d, h, batch, dtype, repeats)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="default: torch's choice")
    ap.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "process"],
        help="process: CPU time of this process (robust on a shared machine)",
    )
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(
        f"threads={torch.get_num_threads()} batch={args.batch} dtype={args.dtype} "
        f"clock={args.clock} mode=upper"
    )
    print(f"{'(n, d, h)':>14} {'variant':>11} {'ms/sample':>10} {'x forward':>10} {'iters':>6}")
    for n, d, h in SIZES:
        for size, name, ms, ratio, it in bench_size(
            n, d, h, args.batch, dtype, args.repeats, clock=clock
        ):
            it = "" if it is None else it
            print(f"{str(size):>14} {name:>11} {ms:10.3f} {ratio:10.1f} {it:>6}", flush=True)


if __name__ == "__main__":
    main()
