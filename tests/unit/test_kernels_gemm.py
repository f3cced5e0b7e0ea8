"""The GEMM time model by shape (launcher/plan/kernels.py) against the published table it was fitted to
(benchmarks/published_gemms.csv, a transcription of OpenXLA's measured matmul table), and the block's GEMMs
(costs.block_gemms) against the FLOP count the MFU figures use."""

import importlib.util
import statistics
from pathlib import Path

import pytest

from launcher.plan import costs
from launcher.plan.kernels import KERNELS
from launcher.plan.ledger import Layout
from launcher.plan.spec import resolve_gpu, resolve_model

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _fit_gemm():
    spec = importlib.util.spec_from_file_location("fit_gemm", ROOT / "benchmarks" / "fit_gemm.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("gpu", ["h100-sxm", "b200", "mi300x"])
def test_the_shipped_gemm_figures_reproduce_the_published_table(gpu):
    fit = _fit_gemm()
    rows = fit.load()[gpu]
    errs = [abs(e) for e in fit.errors(KERNELS[gpu], gpu, rows)]
    assert len(rows) >= 30
    assert statistics.median(errs) < 0.08 and max(errs) < 0.5
    # the large shapes (16,384 rows, widths 1,024+) within 10% each: what a training step's GEMMs look like
    big = [e for (b, m, n, k, _), e in zip(rows, fit.errors(KERNELS[gpu], gpu, rows)) if b * m >= 8192 and min(n, k) >= 1024]
    assert big and max(abs(e) for e in big) < 0.10


def test_skinny_gemms_run_below_the_large_shape_rate_and_never_above_mamf():
    h100 = resolve_gpu("h100-sxm")
    k, peak = KERNELS["h100-sxm"], h100.peak_tflops * 1e12

    def rate(m, n, kk):
        return 2 * m * n * kk / k.gemm_seconds(m, n, kk, peak) / peak

    assert rate(16384, 8192, 8192) > 0.75                # close to MAMF (0.803)
    assert rate(16384, 8192, 8192) < k.gemm
    assert rate(16384, 512, 4096) < 0.9 * rate(16384, 8192, 8192)   # a TP 8 split of a narrow projection
    assert rate(256, 4096, 4096) < 0.6 * rate(16384, 4096, 4096)      # few tokens


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "mixtral-8x7b", "gpt3-175b"])
@pytest.mark.parametrize("tp,ep", [(1, 1), (8, 1), (2, 4)])
def test_the_block_gemms_add_up_to_the_counted_matmul_flops(name, tp, ep):
    model = resolve_model(name)
    flops = sum(2 * m * n * k * share for m, n, k, share in costs.block_gemms(model, tp, ep, 8192.0))
    counted = costs.forward_flops_per_sequence(model, 8192)["matmul"] / model.layers / tp
    assert flops == pytest.approx(counted, rel=1e-3)


def test_a_tp_split_costs_more_than_its_share_of_the_flops():
    """Splitting every GEMM 8 ways makes each one skinnier: the rank's GEMM time is more than 1/8."""
    model, gpu = resolve_model("llama3-8b"), resolve_gpu("h100-sxm")
    one = Layout(tp=1, cp=1, pp=1, dp=8, ep=1, zero=1, recompute="none", micro_batch=1, grad_accum=1,
                 schedule="none", virtual_stages=1)
    eight = Layout(tp=8, cp=1, pp=1, dp=1, ep=1, zero=1, recompute="none", micro_batch=1, grad_accum=1,
                   schedule="none", virtual_stages=1)
    t1 = costs.gemm_seconds(model, one, 8192.0, gpu, 1.0, 3.0, False)
    t8 = costs.gemm_seconds(model, eight, 8192.0, gpu, 1.0, 3.0, False)
    assert t8 > t1 / 8 * 1.05
