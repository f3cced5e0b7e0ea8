"""Print the time model's factor for compiled blocks (train.compile) and how it comes from the published runs.

torchtitan publishes one layout eager and compiled (benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3:
Llama 3.1 8B, FSDP, selective AC, H100, 8 and 128 GPUs). For each, the model's step time t under torchtitan's stack,
the same without elementwise work t0, and the share of that elementwise time the published speedup r leaves:
(t / r - t0) / (t - t0). launcher.plan.costs.compiled_elementwise is their mean; this prints both and the speedup
the model then gives every row of the pair.

    python benchmarks/compile_factor.py
"""

from __future__ import annotations

import dataclasses

from launcher.plan.costs import COMPILE_PAIRS, STACKS, advertised_bandwidth, compiled_elementwise, estimate
from launcher.plan.model import Layout
from launcher.plan.spec import TrainSpec, resolve_gpu, resolve_model


def main() -> None:
    gpu, model = resolve_gpu("h100-sxm"), resolve_model("llama3-8b")
    stack, bw = STACKS["torchtitan"], advertised_bandwidth(gpu)
    share = compiled_elementwise(gpu)
    print(f"{'run':34} {'eager':>7} {'compiled':>8} {'r':>6} {'t s':>7} {'t0 s':>7} {'elem %':>7} {'share':>6} "
          f"{'model r':>8}")
    for label, dp, eager, compiled in COMPILE_PAIRS:
        lay = Layout(tp=1, cp=1, pp=1, dp=dp, ep=1, zero=3, recompute="selective", micro_batch=2, grad_accum=1,
                     schedule="none", virtual_stages=1)
        train = TrainSpec(seq_len=8192, global_batch=2 * dp)
        t = estimate(model, train, gpu, lay, bw, 8, stack=stack).step_time_s
        t0 = estimate(model, train, gpu, lay, bw, 8, stack=dataclasses.replace(stack, elementwise_passes=0.0)).step_time_s
        tc = estimate(model, train, gpu, dataclasses.replace(lay, compile=True), bw, 8, stack=stack).step_time_s
        r = compiled / eager
        print(f"{label:34} {eager:7.0f} {compiled:8.0f} {r:6.3f} {t:7.3f} {t0:7.3f} {(t - t0) / t:7.1%} "
              f"{(t / r - t0) / (t - t0):6.3f} {t / tc:8.3f}")
    print(f"compiled_elementwise (their mean): {share:.3f} of the eager blocks' elementwise time")


if __name__ == "__main__":
    main()
