"""Calibrate the time model against published step times, cross-validated by source.

Every row of benchmarks/published_runs.csv is a published run: its source (a short key), the URL and
the table or section the number was read from (tables and text only, never a plot), the stack family,
the model (MODELS below), the layout as published and the figure in its unit. Each row runs through the
same `estimate()` the planner uses, with the profile of the software that ran it (launcher.plan.costs
STACKS). What is fitted per stack family is small: the factor on the kernel-level compute time
(launcher/plan/kernels.py, from public GEMM and attention benchmarks) and the elementwise passes; the
collectives, overlap and bubble are the model's, not fitted.

- default: every row against the shipped constants, and the per-family error.
- `--fit`: refit each family on all its rows (what the shipped constants should be).
- `--cv`: leave one source out: for each source, refit every family on the rows of all other sources
  and predict that source's rows. Per stack family and GPU: median and worst |step-time error|; for
  the sweeps (one source, one model, one GPU type, one sequence length, several layouts measured):
  Spearman rank correlation of the per-GPU rates, top-1 (the predicted fastest is the measured fastest)
  and regret (how much slower, measured, the predicted pick is than the measured best). A family with
  no second source is predicted with the kernel-level prior (factor 1, PRIOR_PASSES) and says so.

Sources (keys as in the CSV; transcriptions of the older rows in ../shared/notes/planner.md):
- K22: Korthikanti et al. 2022, Table 5 (A100-80GB, Selene). N21: Narayanan et al. SC21, Table 2 (PTD-P
  vs ZeRO-3, TFLOP/s per GPU counted with full recompute; the middle ZeRO-3 rows and batch sizes are
  this file's transcription, unverified). N340: Nemotron-4 340B report, Table 2. L3: Llama 3 paper,
  Table 4 and §3.3.2 (layout details inferred as the old docstring said: V = 8, micro-batch 1, no AC).
  MLM README: Megatron-LM README's GPT-3 example (1024 A100, ~32 s/iteration).
- TT 2024-12 / TT 2025-06: torchtitan benchmarks (H100 500 W; bf16 eager rows only). TT perf-A100:
  torchtitan docs/performance.md @0413364 (64 A100, FSDP2; its "selective layer" rows are left out: no
  such layout here). FMS: PyTorch blog "Maximizing training throughput using PyTorch FSDP" Table 1
  (costed as FSDP over one node's HSDP shard group: the planner has no HSDP).
- LLMF: mosaicml/llm-foundry scripts/train/benchmarking/README.md @061f2c7 (Composer FSDP FULL_SHARD;
  the H100 80GB BF16, A100 80GB and A100 40GB tables; the FP8 table left out).
- dgxc *: NVIDIA/dgxc-benchmarking READMEs (each README its own source): NeMo Llama 3.1 8B/70B/405B
  (24.09), Nemotron-4 15B/340B (24.11), NeMo GPT-3 175B, Grok-1 314B (MoE), MaxText Llama 3 70B,
  PaxML GPT 5B; BF16 tables only. Their remat policies and meshes are read from each recipe's configure.sh
  (MaxText save_qkv_proj: STACKS["maxtext"]; PaxML SAVE_DOT_ONLY, FSDP inside a node: the rows' notes).
- MaxText A3: google/maxtext MaxText/configs/a3/llama_2_7b/README.md @efb6d9e4 (Llama 2 7B, one 8-GPU VM).
Not found as tables or text (so not here): BF16 H200 or B200 training runs with their layouts (the
Megatron-Bridge tables for B200 are FP8/MXFP8 or MoE shapes this model cannot express), DeepSpeed runs
after 2021, Megatron's H100 weak-scaling table (an image in its README).
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from launcher.plan.costs import STACKS, Stack, advertised_bandwidth, estimate, model_flops_per_token
from launcher.plan.ledger import Layout
from launcher.plan.spec import ModelSpec, TrainSpec, resolve_gpu, resolve_model

DATA = Path(__file__).with_name("published_runs.csv")


def gpt(layers: int, hidden: int, heads: int, vocab: int = 51200) -> ModelSpec:
    """A GPT-3-style block (GELU MLP 4h, LayerNorm). Its learned absolute positions are no position kind the
    spec names: 'alibi' stands for them, the one kind without rotary work in the time model, which prices
    ALiBi nothing else (calibration never reaches the ledger)."""
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=vocab, mlp="gelu", tied_embeddings=True,
                     position="alibi")


def mpt(layers: int, hidden: int, heads: int) -> ModelSpec:
    """MosaicML MPT (llm-foundry yamls): GELU MLP 4h, tied embeddings, vocabulary 50368."""
    return gpt(layers, hidden, heads, vocab=50368)


def _llama3_405b(layers: int) -> ModelSpec:
    return replace(resolve_model("llama3-405b"), layers=layers)


#: The published runs' models: presets, or the shapes the publications give.
MODELS: dict[str, ModelSpec] = {
    **{n: resolve_model(n) for n in ("llama2-7b", "llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b")},
    **{f"llama3-405b-{n}l": _llama3_405b(n) for n in (7, 21, 42)},
    "gpt-22b": gpt(48, 6144, 64), "gpt-530b": gpt(105, 20480, 128), "gpt-1t": gpt(128, 25600, 160),
    "gpt-5b": gpt(24, 4096, 32),
    "nemotron4-340b": ModelSpec(layers=96, hidden=18432, heads=96, kv_heads=8, ffn_hidden=73728, vocab=256000,
                                mlp="gelu", tied_embeddings=False),
    "nemotron4-15b": ModelSpec(layers=32, hidden=6144, heads=48, kv_heads=8, ffn_hidden=24576, vocab=256000,
                               mlp="gelu", tied_embeddings=False),
    "llama2-13b": ModelSpec(layers=40, hidden=5120, heads=40, kv_heads=40, ffn_hidden=13824, vocab=32000,
                            mlp="swiglu", tied_embeddings=False),
    "llama2-34b": ModelSpec(layers=48, hidden=8192, heads=64, kv_heads=8, ffn_hidden=22016, vocab=32000,
                            mlp="swiglu", tied_embeddings=False),
    "llama2-70b": ModelSpec(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=32000,
                            mlp="swiglu", tied_embeddings=False),
    "grok1-314b": ModelSpec(layers=64, hidden=6144, heads=48, kv_heads=8, ffn_hidden=32768, vocab=131072,
                            mlp="swiglu", tied_embeddings=False, experts=8, experts_per_token=2),
    **{f"mpt-{n}": mpt(*shape) for n, shape in {
        "125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
        "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56),
        "70b": (80, 8192, 64)}.items()},
}

FAMILIES = {"megatron": "Megatron-class (Megatron-LM, NeMo, Llama 3)",
            "bundled": "PyTorch FSDP class (torchtitan, FMS, llm-foundry)",
            "deepspeed": "DeepSpeed ZeRO-3", "jax": "JAX/XLA (MaxText, PaxML)"}
#: What the fit chooses per family, and the grids it searches.
FACTORS = [f / 100 for f in range(30, 141, 2)]
PASSES = [float(p) for p in range(0, 201, 10)]
#: A family with no second source is predicted, when its only source is left out, at the kernels' rate
#: with this many elementwise passes (a prior, not a fit).
PRIOR_PASSES = 12.0


@dataclass(frozen=True)
class Case:
    label: str
    source: str
    family: str          # the stack family the row counts under (FAMILIES)
    model_name: str
    gpu: str
    seq: int
    gbs: int
    layout: dict
    published: float
    unit: str            # "s" (step time), "tok/s/GPU", "TF-N21" (TFLOP/s per GPU, Narayanan's count) or
                         # "TF" (model TFLOP/s per GPU, this model's count = PaLM's 6N + 12·L·h·s)
    stack: str = ""      # the profile in launcher.plan.costs.STACKS, when not the family's own
    url: str = ""
    where: str = ""
    note: str = ""
    gpus_per_node: int = 8

    @property
    def model(self) -> ModelSpec:
        return MODELS[self.model_name]

    def profile(self, fitted: dict[str, Stack] | None = None) -> Stack:
        base = (fitted or {}).get(self.family) or STACKS[self.family]
        if self.stack:
            # the family's fitted figures, the stack's habits
            return replace(STACKS[self.stack], efficiency_max=base.efficiency_max,
                           ceiling_by_generation=base.ceiling_by_generation,
                           elementwise_passes=base.elementwise_passes)
        return base


def load_cases(path: Path = DATA) -> list[Case]:
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            layout: dict = {k: int(r[k]) for k in ("tp", "cp", "pp", "v", "dp", "ep", "mb", "zero")}
            layout["recompute"] = r["recompute"]
            layout["dp_shard"] = int(r["dp_shard"]) if r.get("dp_shard") else None
            out.append(Case(label=r["label"], source=r["source"], family=r["family"], model_name=r["model"],
                            gpu=r["gpu"], seq=int(r["seq"]), gbs=int(r["gbs"]), layout=layout,
                            published=float(r["published"]), unit=r["unit"], stack=r["stack"], url=r["url"],
                            where=r["where"], note=r["note"]))
    return out


CASES = load_cases()


def n21_flops(model: ModelSpec, gbs: int, s: int) -> float:
    """Narayanan et al.'s FLOPs per iteration (full recompute counted): 96·B·s·l·h²(1 + s/6h + V/16lh)."""
    h, layer = model.hidden, model.layers
    return 96 * gbs * s * layer * h * h * (1 + s / (6 * h) + model.vocab / (16 * layer * h))


def layout_of(case: Case) -> Layout:
    kw = case.layout
    dp, mb, v = kw["dp"], kw["mb"], kw["v"]
    return Layout(tp=kw["tp"], cp=kw["cp"], pp=kw["pp"], dp=dp, ep=kw["ep"], zero=kw["zero"],
                  recompute=kw["recompute"], micro_batch=mb, grad_accum=max(1, case.gbs // (dp * mb)),
                  schedule="none" if kw["pp"] == 1 else "interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v,
                  dp_shard=kw.get("dp_shard"))


def model_step(case: Case, stack: Stack) -> float:
    """The model's step time (s) for the case's layout under `stack`."""
    gpu = resolve_gpu(case.gpu)
    train = TrainSpec(seq_len=case.seq, global_batch=case.gbs)
    return estimate(case.model, train, gpu, layout_of(case), advertised_bandwidth(gpu), case.gpus_per_node,
                    stack=stack).step_time_s


def in_unit(case: Case, step: float) -> float:
    """A step time (s) in the case's published unit."""
    world = layout_of(case).world
    if case.unit == "s":
        return step
    if case.unit == "tok/s/GPU":
        return case.gbs * case.seq / step / world
    if case.unit == "TF":
        return model_flops_per_token(case.model, case.seq) * case.gbs * case.seq / step / world / 1e12
    return n21_flops(case.model, case.gbs, case.seq) / step / world / 1e12


def published_step(case: Case) -> float:
    """The published figure as a step time (s): every unit is a step time or inversely proportional to one."""
    return case.published if case.unit == "s" else in_unit(case, 1.0) / case.published


def predicted(case: Case, stack: Stack) -> float:
    """The model's figure in the case's unit."""
    return in_unit(case, model_step(case, stack))


def error(case: Case, fitted: dict[str, Stack] | None = None) -> float:
    """Relative step-time error (positive = the model is slower than published)."""
    return model_step(case, case.profile(fitted)) / published_step(case) - 1


def per_gpu_rate(case: Case, step: float) -> float:
    """Tokens per second per GPU at `step` seconds a step (the fair order across world sizes)."""
    return case.gbs * case.seq / step / layout_of(case).world


def sweeps(rows: list[Case] | None = None) -> list[list[Case]]:
    """Rows of one source measuring one model on one GPU type at one sequence length in several layouts:
    the comparisons a planner must get the order of (rows costed as one layout, e.g. FSDP over a node with
    its cross-node replicas left out, are one layout: nothing to order)."""
    groups: dict[tuple, list[Case]] = {}
    for c in rows if rows is not None else CASES:
        groups.setdefault((c.source, c.model_name, c.gpu, c.seq), []).append(c)
    return [g for g in groups.values() if len({(c.gbs, layout_of(c)) for c in g}) > 1]


def sweep_order(group: list[Case], fitted: dict[str, Stack] | None = None) -> tuple[list[str], list[str]]:
    """(labels fastest first as published, as the model predicts), per GPU."""
    measured = sorted(group, key=lambda c: -per_gpu_rate(c, published_step(c)))
    ours = sorted(group, key=lambda c: -per_gpu_rate(c, model_step(c, c.profile(fitted))))
    return [c.label for c in measured], [c.label for c in ours]


# --- fitting --------------------------------------------------------------------------------------

def _loss(rows: list[Case], stack: Stack, family: str) -> float:
    return statistics.mean(abs(math.log1p(error(c, {family: stack}))) for c in rows)


def fit_family(family: str, rows: list[Case]) -> Stack:
    """The family's factor and elementwise passes minimising mean |log(model / published)| over `rows`
    (symmetric in over- and under-estimates): the passes on a grid, the factor by golden section (the
    step falls monotonically with it)."""
    base = replace(STACKS[family], ceiling_by_generation=())
    rows = [c for c in rows if c.family == family]
    if not rows:
        return replace(base, efficiency_max=1.0, elementwise_passes=PRIOR_PASSES)

    def best_factor(passes: float) -> tuple[float, float]:
        lo, hi = math.log(FACTORS[0]), math.log(FACTORS[-1])
        g = (math.sqrt(5) - 1) / 2
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        fa = _loss(rows, replace(base, efficiency_max=math.exp(a), elementwise_passes=passes), family)
        fb = _loss(rows, replace(base, efficiency_max=math.exp(b), elementwise_passes=passes), family)
        for _ in range(18):
            if fa < fb:
                hi, b, fb = b, a, fa
                a = hi - g * (hi - lo)
                fa = _loss(rows, replace(base, efficiency_max=math.exp(a), elementwise_passes=passes), family)
            else:
                lo, a, fa = a, b, fb
                b = lo + g * (hi - lo)
                fb = _loss(rows, replace(base, efficiency_max=math.exp(b), elementwise_passes=passes), family)
        x = (a + b) / 2
        return _loss(rows, replace(base, efficiency_max=math.exp(x), elementwise_passes=passes), family), math.exp(x)

    loss, factor, passes = min((*best_factor(p), p) for p in PASSES)
    return replace(base, efficiency_max=round(factor, 3), elementwise_passes=passes)


def fit(family: str, gpu: str | None = None, rows: list[Case] | None = None) -> Stack:
    """Refit one family on its rows (of one GPU type when given)."""
    rows = [c for c in (rows if rows is not None else CASES) if c.family == family and gpu in (None, c.gpu)]
    return fit_family(family, rows)


def fit_all(rows: list[Case]) -> dict[str, Stack]:
    return {f: fit_family(f, rows) for f in FAMILIES}


# --- cross-validation by source -------------------------------------------------------------------

def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); 1.0 for fewer than two distinct values."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx, sy = math.sqrt(sum((a - mx) ** 2 for a in rx)), math.sqrt(sum((b - my) ** 2 for b in ry))
    return sxy / (sx * sy) if sx and sy else 1.0


@dataclass(frozen=True)
class Held:
    """One row predicted with every family fitted without its source."""
    case: Case
    error: float
    predicted_step: float
    prior: bool          # its family had no other source: the kernel-level prior predicted it


def cross_validate(rows: list[Case] | None = None) -> list[Held]:
    """Leave one source out: every source's rows predicted by fits on all other sources' rows."""
    rows = rows if rows is not None else CASES
    out = []
    for source in sorted({c.source for c in rows}):
        held = [c for c in rows if c.source == source]
        train = [c for c in rows if c.source != source]
        fitted = {f: fit_family(f, train) for f in {c.family for c in held}}
        for c in held:
            step = model_step(c, c.profile(fitted))
            out.append(Held(c, step / published_step(c) - 1, step,
                            prior=not any(t.family == c.family for t in train)))
    return out


@dataclass(frozen=True)
class SweepScore:
    source: str
    model: str
    gpu: str
    n: int
    spearman: float
    top1: bool
    regret: float        # measured slowdown of the predicted pick against the measured best
    spread: float        # measured best / worst per-GPU rate - 1


def sweep_scores(held: list[Held]) -> list[SweepScore]:
    by_case = {id(h.case): h for h in held}
    out = []
    for g in sweeps([h.case for h in held]):
        measured = [per_gpu_rate(c, published_step(c)) for c in g]
        ours = [per_gpu_rate(c, by_case[id(c)].predicted_step) for c in g]
        best = max(range(len(g)), key=lambda i: measured[i])
        pick = max(range(len(g)), key=lambda i: ours[i])
        out.append(SweepScore(g[0].source, g[0].model_name, g[0].gpu, len(g), spearman(measured, ours),
                              best == pick, measured[best] / measured[pick] - 1, max(measured) / min(measured) - 1))
    return out


def cv_table(held: list[Held]) -> list[dict]:
    """Per family and GPU: rows, median and worst |error| (and per family overall)."""
    out = []
    for family in FAMILIES:
        fam = [h for h in held if h.case.family == family]
        for gpu in [None, *sorted({h.case.gpu for h in fam})]:
            hs = [h for h in fam if gpu in (None, h.case.gpu)]
            if not hs:
                continue
            errs = [abs(h.error) for h in hs]
            out.append({"family": family, "gpu": gpu or "all", "n": len(hs), "median": statistics.median(errs),
                        "worst": max(errs), "prior": any(h.prior for h in hs)})
    return out


def cv_error(held: list[Held] | None = None) -> float:
    """The cross-validated median |step-time error| of the bundled stack's family (what launch plan quotes)."""
    held = held if held is not None else cross_validate()
    return statistics.median(abs(h.error) for h in held if h.case.family == "bundled")


# --- report ---------------------------------------------------------------------------------------

def summary(rows: list[Case], fitted: dict[str, Stack] | None = None) -> str:
    errs = [abs(error(c, fitted)) for c in rows]
    if not errs:
        return "no rows"
    return f"median {statistics.median(errs):5.1%}  max {max(errs):5.1%}  (n={len(errs)})"


def print_cv(held: list[Held]) -> None:
    print("leave-one-source-out |step-time error| (each source predicted by fits on all others):")
    print(f"  {'family':10} {'gpu':10} {'rows':>5} {'median':>8} {'worst':>8}")
    for r in cv_table(held):
        prior = "  (one source: kernel-level prior)" if r["prior"] else ""
        print(f"  {r['family']:10} {r['gpu']:10} {r['n']:>5} {r['median']:>8.1%} {r['worst']:>8.1%}{prior}")
    scores = sweep_scores(held)
    print(f"\nsweeps (one source, model, GPU type and sequence length; {len(scores)} in all):")
    print(f"  {'source':22} {'model':16} {'gpu':10} {'n':>3} {'spread':>7} {'spearman':>9} {'top-1':>6} {'regret':>7}")
    for sc in scores:
        print(f"  {sc.source:22} {sc.model:16} {sc.gpu:10} {sc.n:>3} {sc.spread:>7.1%} {sc.spearman:>9.2f} "
              f"{'yes' if sc.top1 else 'no':>6} {sc.regret:>7.1%}")
    for label, sel in (("all sweeps", scores), ("sweeps spread > 10%", [s for s in scores if s.spread > 0.10])):
        if sel:
            print(f"  {label}: {len(sel)}, mean Spearman {statistics.mean(s.spearman for s in sel):.2f}, "
                  f"top-1 {sum(s.top1 for s in sel) / len(sel):.0%}, "
                  f"mean regret {statistics.mean(s.regret for s in sel):.1%}")
    print(f"\nbundled stack's cross-validated median |error| (quoted by launch plan): {cv_error(held):.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="refit each family on all its rows")
    ap.add_argument("--cv", action="store_true", help="leave one source out, per family and GPU, and the sweeps")
    ap.add_argument("--rows", action="store_true", help="print every row against the shipped constants")
    args = ap.parse_args()
    if args.rows:
        print(f"{'case':40} {'source':20} {'published':>10} {'model':>10} {'step err':>9}  unit")
        for c in CASES:
            print(f"{c.label:40} {c.source:20} {c.published:>10.2f} {predicted(c, c.profile()):>10.2f} "
                  f"{error(c):>+9.1%}  {c.unit}")
    print("|step-time error| per stack family, shipped constants (launcher/plan/costs.py STACKS):")
    for family, name in FAMILIES.items():
        st = STACKS[family]
        rows = [c for c in CASES if c.family == family]
        print(f"  {name:50} factor {st.efficiency_max:.2f} passes {st.elementwise_passes:4.0f}  {summary(rows)}")
    if args.fit:
        print("\nrefitted on all rows of each family:")
        for family, name in FAMILIES.items():
            s = fit(family)
            rows = [c for c in CASES if c.family == family]
            print(f"  {name:50} factor {s.efficiency_max:.3f} passes {s.elementwise_passes:4.0f}  "
                  f"{summary(rows, {family: s})}")
    if args.cv:
        print()
        print_cv(cross_validate())


if __name__ == "__main__":
    main()
