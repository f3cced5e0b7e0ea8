"""The pipeline schedules' action orders, as torch 2.13's pipelining builds them, without torch.

Why a copy: the ledger (what a pipeline rank holds at each action) and the time model (the bubble) read
each rank's order of forwards and backwards, and launcher/plan never imports torch (a login node plans in
a second). Each function below follows its torch counterpart line for line (torch/distributed/pipelining/
schedules.py: ScheduleInterleavedZeroBubble's _calculate_single_rank_operations with _get_warmup_ops and
_get_1f1b_rank_ops, ScheduleZBVZeroBubble's, ScheduleDualPipeV's), and tests/unit/test_schedule_orders.py holds
every copy to torch's own table over a grid of pp, stages per rank and micro-batches.

An action is (local stage k, micro-batch j, kind): kind "F" forward, "B" full backward, "I" the input
gradient and "W" the weight gradient of a split backward (torch's BACKWARD_INPUT / BACKWARD_WEIGHT); k
indexes capabilities.rank_stages(schedule, r, pp, v). DualPipe-V's overlapped forward+backward pairs are
their two actions, as its runtime performs them.
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

from launcher.plan.capabilities import rank_stages

Action = tuple[int, int, str]


@lru_cache(maxsize=4096)
def rank_order(schedule: str, pp: int, v: int, m: int, r: int) -> tuple[Action, ...]:
    """Pipeline rank r's compute actions in the order its runtime runs them."""
    if schedule == "interleaved-zero-bubble":
        stages = _zero_bubble_1p(pp, v, m, r)
    elif schedule == "zero-bubble-v":
        stages = _zbv(pp, m, r)
    elif schedule == "dualpipe-v":
        stages = _dualpipe_v(pp, m, r)
    elif schedule == "interleaved-1f1b":
        stages = _interleaved(pp, v, m, r)
    elif schedule in ("1f1b", "gpipe"):
        stages = _one_stage(schedule, pp, m, r)
    else:
        raise ValueError(f"no action order for schedule {schedule!r}")
    local = {s: k for k, s in enumerate(rank_stages(schedule, r, pp, v))}
    return tuple((local[s], j, kind) for s, j, kind in stages)


def _one_stage(schedule: str, pp: int, m: int, r: int) -> list[tuple[int, int, str]]:
    """GPipe: every forward, then every backward; 1F1B: min(m, pp - r) forwards, then one backward and one
    forward each, then the backwards (Schedule1F1B)."""
    if schedule == "gpipe":
        return [(r, j, "F") for j in range(m)] + [(r, j, "B") for j in range(m)]
    warm = min(m, pp - r)
    out = [(r, j, "F") for j in range(warm)]
    for j in range(m - warm):
        out += [(r, j, "B"), (r, warm + j, "F")]
    return out + [(r, j, "B") for j in range(m - warm, m)]


def _rounds(pp: int, m: int) -> int:
    """Micro-batches per round of torch's interleaved schedules: m // max(1, m // pp)."""
    return m // max(1, m // pp)


def _warmup(r: int, v: int, per_round: int, pp: int, m: int, factor: int) -> int:
    """torch's _get_warmup_ops."""
    return min((v - 1) * per_round + factor * (pp - 1 - r), m * v)


def _interleaved(pp: int, v: int, m: int, r: int) -> list[tuple[int, int, str]]:
    """ScheduleInterleaved1F1B (depth first)."""
    per_round = _rounds(pp, m)
    warm = _warmup(r, v, per_round, pp, m, 2)
    return _one_f_one_b(pp, v, m, r, per_round, warm, zero_bubble=False)


def _zero_bubble_1p(pp: int, v: int, m: int, r: int) -> list[tuple[int, int, str]]:
    """ScheduleInterleavedZeroBubble (the ZB paper's ZB1P): interleaved 1F1B's warm-up of (v-1)·round + (pp-1-r)
    forwards, each backward split into I then, after r of them, one W each (the oldest pending)."""
    per_round = _rounds(pp, m)
    warm = _warmup(r, v, per_round, pp, m, 1)
    return _one_f_one_b(pp, v, m, r, per_round, warm, zero_bubble=True)


def _one_f_one_b(pp: int, v: int, m: int, r: int, per_round: int, warm: int,
                 zero_bubble: bool) -> list[tuple[int, int, str]]:
    """torch's _get_1f1b_rank_ops (num_1f1b_microbatches = r under zero bubble), compute actions only."""
    ops = v * m
    fwd_bwd = ops - warm

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * pp + r

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warm) // per_round) % v) * pp + r

    nxt: dict[str, dict[int, int]] = {"F": defaultdict(int), "B": defaultdict(int), "W": defaultdict(int)}
    out: list[tuple[int, int, str]] = []
    backward_ops: list[int] = []
    weights_done = 0
    back = "I" if zero_bubble else "B"

    def add(stage: int, kind: str) -> None:
        key = "B" if kind in ("B", "I") else kind
        out.append((stage, nxt[key][stage], kind))
        nxt[key][stage] += 1

    def weight() -> None:
        nonlocal weights_done
        add(bwd_stage(backward_ops[weights_done]), "W")
        weights_done += 1

    for op in range(warm + fwd_bwd + (ops - fwd_bwd)):
        if op < warm:
            add(fwd_stage(op), "F")
            continue
        if op < warm + fwd_bwd:
            add(fwd_stage(op), "F")
        add(bwd_stage(op), back)
        backward_ops.append(op)
        if zero_bubble and op - warm >= r:
            weight()
    while zero_bubble and weights_done < len(backward_ops):
        weight()
    return out


def _zbv(pp: int, m: int, r: int) -> list[tuple[int, int, str]]:
    """ScheduleZBVZeroBubble (the ZB paper's ZB-V): chunk 0 is stage r, chunk 1 stage 2·pp-1-r; its order is
    built for max(2·pp-1, m) micro-batches and those past m dropped."""
    n = max(2 * pp - 1, m)
    s0, s1 = r, 2 * pp - 1 - r
    out: list[tuple[int, int, str]] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - r) - 1):
        out.append((s0, f0, "F"))
        f0 += 1
    for _ in range(r):
        out += [(s1, f1, "F"), (s0, f0, "F")]
        f1 += 1
        f0 += 1
    for _ in range(pp - r):
        out += [(s1, f1, "F"), (s1, b1, "I"), (s1, b1, "W")]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append((s0, f0, "F"))
            f0 += 1
        out += [(s0, b0, "I"), (s0, b0, "W"), (s1, f1, "F"), (s1, b1, "I"), (s1, b1, "W")]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(r):
        out += [(s0, b0, "I"), (s1, b1, "I")]
        b0 += 1
        b1 += 1
    for _ in range(pp - r):
        out += [(s0, b0, "I"), (s0, w0, "W")]
        b0 += 1
        w0 += 1
    out += [(s1, j, "W") for j in range(w1, b1)]
    out += [(s0, j, "W") for j in range(w0, b0)]
    return [a for a in out if a[1] < m]


def _dualpipe_v(pp: int, m: int, r: int) -> list[tuple[int, int, str]]:
    """ScheduleDualPipeV (DeepSeek's DualPipeV): its eight steps, each overlapped F/B pair as F then B, each
    I's W queued and run at the next 'W if pending' step."""
    s0, s1 = r, 2 * pp - 1 - r
    count: dict[tuple[int, str], int] = defaultdict(int)
    queue: list[tuple[int, int]] = []
    out: list[tuple[int, int, str]] = []

    def act(stage: int, kind: str) -> None:
        key = (stage, "I" if kind in ("I", "B") else kind)
        j = count[key]
        out.append((stage, j, kind))
        if kind == "B":
            count[(stage, "I")] += 1
            count[(stage, "W")] += 1
            return
        if kind == "I":
            queue.append((stage, j))
        count[key] = j + 1

    def weight() -> None:
        if queue:
            stage, j = queue.pop(0)
            out.append((stage, j, "W"))
            count[(stage, "W")] += 1

    for _ in range((pp - r - 1) * 2):
        act(s0, "F")
    for _ in range(r + 1):
        act(s0, "F")
        act(s1, "F")
    for _ in range(pp - r - 1):
        act(s1, "I")
        weight()
        act(s1, "F")
    for _ in range(m - 2 * pp + r + 1):
        act(s0, "F")
        act(s1, "B")                       # overlapped, but the first of the last rank's (same order)
        act(s1, "F")
        act(s0, "B")
    for _ in range(pp - r - 1):
        act(s1, "B")
        act(s1, "F")
        act(s0, "B")
    zb = False
    steps = r + 1
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            zb = True
        act(s1, "I" if zb else "B")
        if i == steps // 2 and r % 2 == 0:
            zb = True
        act(s0, "I" if zb else "B")
    for _ in range(pp - r - 1):
        weight()
        act(s0, "I" if zb else "B")
    for _ in range(r + 1):
        weight()
    return out


@lru_cache(maxsize=4096)
def bubble_fraction(schedule: str, pp: int, v: int, m: int, stage_layers: tuple[int, ...], forward: float,
                    input_grad: float, weight_grad: float, head: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> float:
    """The pipeline's idle time as a fraction of its busiest rank's compute: every rank runs its own order
    (rank_order) one action at a time, each action as soon as the rank is free and what it needs has run (a
    forward the previous stage's forward of that micro-batch, an input gradient or whole backward the next
    stage's, a weight gradient its own input gradient), p2p taken as free. Per layer an action takes `forward`
    (F), `input_grad` (I), `weight_grad` (W), a whole backward I + W; `head` adds the loss's (F, I, W) to the
    last stage. The papers' formulas are what this gives for their assumptions (B the whole backward here, as
    DeepSeek-V3 writes them, arXiv 2412.19437 Table 2; Qi et al. 2023, arXiv 2401.10241 §3 and §6): 1F1B
    (p-1)(F+B), interleaved 1F1B (p-1)(F+B)/v (Narayanan et al. 2021), ZB-H1 (p-1)(F+B-2W), ZB-V half of that
    once m >= 2p-1, DualPipe (p/2-1)(F&B+B-3W); here for torch's own orders, uneven stages and any F:B:W
    (tests/unit/test_costs_schedules.py)."""
    n = pp * v
    last = n - 1

    def dur(stage: int, kind: str) -> float:
        per = {"F": forward, "I": input_grad, "W": weight_grad, "B": input_grad + weight_grad}[kind]
        t = per * stage_layers[stage]
        if stage == last:
            hf, hi, hw = head
            t += {"F": hf, "I": hi, "W": hw, "B": hi + hw}[kind]
        return t

    orders = []
    for r in range(pp):
        stages = rank_stages(schedule, r, pp, v)
        orders.append([(stages[k], j, kind) for k, j, kind in rank_order(schedule, pp, v, m, r)])
    fwd: dict[tuple[int, int], float] = {}
    back: dict[tuple[int, int], float] = {}
    clock = [0.0] * pp
    busy = [sum(dur(s, kind) for s, _, kind in o) for o in orders]
    pos = [0] * pp
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                s, j, kind = orders[r][pos[r]]
                if kind == "F":
                    ready = fwd.get((s - 1, j)) if s > 0 else 0.0
                elif kind == "W":
                    ready = back.get((s, j))
                else:
                    ready = back.get((s + 1, j)) if s < last else fwd.get((s, j))
                if ready is None:
                    break
                end = max(clock[r], ready) + dur(s, kind)
                clock[r] = end
                if kind == "F":
                    fwd[(s, j)] = end
                elif kind in ("I", "B"):
                    back[(s, j)] = end
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError(f"{schedule} pp {pp} v {v} m {m}: the order does not progress")
    most = max(busy)
    return max(clock) / most - 1 if most else 0.0
