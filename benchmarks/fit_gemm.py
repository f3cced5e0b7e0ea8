"""Fit the GEMM time model of launcher/plan/kernels.py to published BF16 matmul timings, per GPU.

The data (benchmarks/published_gemms.csv) is a transcription, entry by entry, of OpenXLA's measured GEMM table
xla/service/gpu/model/default_matmul_perf_table.txtpb (openxla/xla @336bb15c, the "bf16xbf16->bf16" figure of
each entry, FLOP/s as 2·b·m·n·k / time, here in TFLOP/s): the keys sm_90 (H100 SXM), sm_100_B200 (B200) and
gfx942 (MI300X), the only GPUs it holds. Transcribed: every b = 1 entry with m = 256 (and m = 512 where read),
every b = 4 entry with m = 4096, and the b = 4, m = 2048, k = 4096 row: small, skinny and large shapes. gfx942's
first m = n = k = 256 entry appears twice in the table with two figures and is left out.

The model (kernels.Kernels.gemm_seconds): t = t0 + 2·b·m·n·k / (gemm · peak) + 2·b·(m·k + k·n + m·n) / (gemm_bw · HBM),
a fixed launch time, the FLOPs at the GPU's maximum achievable matmul rate (gemm: MAMF, a best-shape measurement
from another source, kernels.py: the large-shape limit, so the model never exceeds it) and the operands and result
(bf16) at an effective bandwidth, a multiple of the datasheet HBM figure (above 1 where operands stay in L2). The
two fitted figures per GPU (gemm_bw, t0) minimise mean |log(model / measured)| (Nelder-Mead). Left free, the compute
rate would fit above MAMF (H100: 0.914 of peak, extrapolating past the table's largest shapes). `--check`: the
shipped constants against the table.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from pathlib import Path

from launcher.plan.kernels import KERNELS, Kernels
from launcher.plan.spec import resolve_gpu

DATA = Path(__file__).with_name("published_gemms.csv")


def load(path: Path = DATA) -> dict[str, list[tuple[int, int, int, int, float]]]:
    """Per GPU preset: (b, m, n, k, measured seconds)."""
    out: dict[str, list[tuple[int, int, int, int, float]]] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            b, m, n, k = (int(r[x]) for x in ("b", "m", "n", "k"))
            out.setdefault(r["gpu"], []).append((b, m, n, k, 2 * b * m * n * k / (float(r["bf16_tflops"]) * 1e12)))
    return out


def errors(kern: Kernels, gpu: str, rows) -> list[float]:
    """Relative time error of the model on each row (positive: the model is slower)."""
    peak = resolve_gpu(gpu).peak_tflops * 1e12
    return [kern.gemm_seconds(m, n, k, peak, b) / t - 1 for b, m, n, k, t in rows]


def _nelder_mead(f, x0: list[float], iters: int = 3000) -> list[float]:
    n = len(x0)
    pts = [list(x0)] + [[x0[j] * (1.3 if i == j else 1.0) for j in range(n)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        c = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        xr = [c[j] + (c[j] - pts[-1][j]) for j in range(n)]
        fr = f(xr)
        if fr < vals[0]:
            xe = [c[j] + 2 * (c[j] - pts[-1][j]) for j in range(n)]
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = [c[j] + 0.5 * (pts[-1][j] - c[j]) for j in range(n)]
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [[pts[0][j] + 0.5 * (p[j] - pts[0][j]) for j in range(n)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[min(range(n + 1), key=lambda i: vals[i])]


def fit(gpu: str, rows) -> Kernels:
    """The GPU's shipped kernels with gemm_bw and gemm_fixed_s refitted on `rows` (gemm, MAMF, kept)."""
    from dataclasses import replace

    base = KERNELS[gpu]

    def loss(x: list[float]) -> float:
        if min(x) <= 0:
            return 1e9
        k = replace(base, gemm_bw=x[0], gemm_fixed_s=x[1] * 1e-6)
        return statistics.mean(abs(math.log1p(e)) for e in errors(k, gpu, rows))

    bw, t0 = _nelder_mead(loss, [1.0, 5.0])
    return replace(base, gemm_bw=round(bw, 2), gemm_fixed_s=round(t0, 2) * 1e-6)


def summary(errs: list[float]) -> str:
    a = [abs(e) for e in errs]
    return f"median {statistics.median(a):5.1%}  worst {max(a):5.1%}  (n={len(a)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only the shipped constants against the table")
    args = ap.parse_args()
    print(f"{'gpu':10} {'gemm':>6} {'gemm_bw':>8} {'t0 us':>6}  |time error| vs the published table")
    for gpu, rows in load().items():
        k = KERNELS[gpu]
        print(f"{gpu:10} {k.gemm:6.3f} {k.gemm_bw:8.2f} {k.gemm_fixed_s * 1e6:6.2f}  shipped: {summary(errors(k, gpu, rows))}")
        if not args.check:
            f = fit(gpu, rows)
            print(f"{'':10} {f.gemm:6.3f} {f.gemm_bw:8.2f} {f.gemm_fixed_s * 1e6:6.2f}  refit:   "
                  f"{summary(errors(f, gpu, rows))}")


if __name__ == "__main__":
    main()
