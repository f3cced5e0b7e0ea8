"""The pipeline schedule's actions replayed over one traced micro-batch: each rank's order of forwards,
backwards and FSDP waits from torch's own schedule classes, and the peak of a step with more micro-batches
than were traced (in flight at once per the order) from the per-action memory deltas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.verify.tracker import CATEGORIES, RankMemTracker


@dataclass(frozen=True)
class Wait:
    """The wait for a stage's pending unshard: FSDP's all-gather copy-out, which torch's runtime runs at
    the start of the stage's next compute action. Its own step in the trace and the replay, so a
    compute action moves memory alike whether or not an unshard is pending (with more than 3 stages
    per rank torch re-gathers stages within the step, and a forward or backward of any micro-batch
    may then be the one that waits)."""

    stage_index: int


def with_waits(order) -> list:
    """`order` with a Wait before each compute action that finds its stage's unshard pending (as torch's
    runtime then waits: _PipelineScheduleRuntime._assert_unsharded). Idempotent."""
    from torch.distributed.pipelining.schedules import UNSHARD

    pending: set[int] = set()
    out: list = []
    for a in order:
        if isinstance(a, Wait):
            pending.discard(a.stage_index)
        elif a.is_compute_op and a.stage_index in pending:
            out.append(Wait(a.stage_index))
            pending.discard(a.stage_index)
        elif a.computation_type == UNSHARD:
            pending.add(a.stage_index)
        out.append(a)
    return out


def action_keys(order, m: int, pp: int, second: bool = False) -> list[tuple]:
    """What decides each action's memory, for an action sequence with its Waits (with_waits): its kind,
    which of the rank's stages (local index), and
    - a compute, send or receive: whether its micro-batch is the first, the last or one in between
      (the first backward makes the accumulated gradients, the last reduces them; under ZeRO 0-2 a
      compute runs on a gathered stage whatever came before, once its Wait is its own step);
    - a RESHARD: whether the stage's last backward came before (it resharded the stage already, so the
      RESHARD frees nothing) or not (it frees the gathered parameters);
    - an UNSHARD, a Wait, a REDUCE_GRAD: nothing more (from sharded; once per gather; once per step).
    `second`: micro-batch 1 is a kind of its own (the split-backward schedules under FSDP: the second input-
    gradient step's post-backward turns the bf16 .grad the first weight step left into the fp32 sum, a later
    one adds into that sum), so a trace needs 4 micro-batches (roles.replay_micro_batches)."""
    from torch.distributed.pipelining.schedules import BACKWARD_WEIGHT, FULL_BACKWARD, RESHARD

    done: set[int] = set()
    out: list[tuple] = []
    for a in order:
        if isinstance(a, Wait):
            out.append(("WAIT", a.stage_index // pp, None))
            continue
        mb, local = a.microbatch_index, a.stage_index // pp
        if a.computation_type == RESHARD:
            out.append((a.computation_type.name, local, a.stage_index in done))
            continue
        which = None if mb is None else 0 if mb == 0 else 2 if mb == m - 1 else 3 if second and mb == 1 else 1
        out.append((a.computation_type.name, local, which))
        if a.computation_type in (FULL_BACKWARD, BACKWARD_WEIGHT) and mb == m - 1:
            done.add(a.stage_index)
    return out


class ActionLog(list):
    """This rank's lowered action list, as the schedule runtime iterates it once per step, marking the
    tracker at each action's start: per action, the figures at its start and the highest ones until
    the next action starts (the action, and whatever the runtime does before the next).

    Each Wait (with_waits) is run here as its own step, by the runtime's own method, before the compute
    that would have run it. Before the first action, a probe gathers, waits for and reshards each
    stage of the rank once (the runtime's own UNSHARD and RESHARD): what a RESHARD within the step
    frees, before the stage's last backward, which a short trace need not contain (torch keeps 3
    stages gathered: with more per rank it evicts them; the probe's steps are marked and only lend
    their effects to the replay)."""

    def __init__(self, actions, tracker: RankMemTracker, sched) -> None:
        from torch.distributed.pipelining.schedules import RESHARD, UNSHARD, _Action

        super().__init__(flat_actions(actions))
        self.tracker = tracker
        self.sched = sched
        self.stages = {st.stage_index: st for st in sched._stages}
        self.probe = [a for i in self.stages for a in (_Action(i, UNSHARD, None), Wait(i), _Action(i, RESHARD, None))]
        self.head: dict = {}                 # from the step's start to its first action
        self.actions: list[dict] = []        # {"action", "start", "peak", "end", "probe"}
        self.tail: dict = {}                 # from the end of the last action to the step's end

    def begin(self) -> None:
        now, _ = self.tracker.mark()
        self.head = {"start": now}

    def end(self) -> None:
        _, window = self.tracker.mark()
        self.tail["peak"] = window

    def __iter__(self):
        for i, a in enumerate([*self.probe, *with_waits(list.__iter__(self))]):
            now, window = self.tracker.mark()
            self._close(now, window)
            self.actions.append({"action": a, "start": now, "probe": i < len(self.probe)})
            if isinstance(a, Wait):
                self.sched._assert_unsharded(self.stages[a.stage_index])
            else:
                yield a
        self._close(*self.tracker.mark())
        self.tail = {"start": self.actions[-1]["end"]} if self.actions else {"start": self.head["start"]}

    def _close(self, now: dict, window: dict) -> None:
        if self.actions:
            self.actions[-1].update(peak=window, end=now)
        else:
            self.head["peak"] = window


def interleaved_orders(pp: int, v: int, m: int) -> dict[int, list]:
    """schedule_orders of interleaved 1F1B."""
    return schedule_orders("interleaved-1f1b", pp, v, m)


def schedule_orders(schedule: str, pp: int, v: int, m: int) -> dict[int, list]:
    """Every pp rank's lowered action list (compute, FSDP unshard/reshard, gradient reduction,
    send/recv) of a multi-stage schedule with `v` stages per rank at `m` micro-batches, by torch's own
    schedule code (the plan's class, built without stages: the order depends on these alone), with
    DualPipe-V's overlapped forward+backward pairs as their two actions (flat_actions)."""
    s = _built_without_stages(schedule, pp, v, m)
    s._prepare_schedule_with_comms(s.pipeline_order)
    return {r: flat_actions(a) for r, a in s.pipeline_order_with_comms.items()}


def compute_orders(schedule: str, pp: int, v: int, m: int) -> dict[int, list]:
    """Every pp rank's compute actions (no bubbles, no communication) of torch's schedule, flat_actions."""
    s = _built_without_stages(schedule, pp, v, m)
    return {r: flat_actions([a for a in acts if a is not None]) for r, acts in s.pipeline_order.items()}


def _built_without_stages(schedule: str, pp: int, v: int, m: int):
    """torch's schedule object for `schedule` with its pipeline_order, built without stages or a process group
    (what __init__ does, less the stages' bookkeeping and its checks of the micro-batch count)."""
    from torch.distributed.pipelining.schedules import (
        ScheduleInterleavedZeroBubble,
        generate_stage_to_rank_mapping,
    )

    from launcher.trainer.pipeline import MULTI

    cls = MULTI[schedule]
    s: Any = object.__new__(cls)         # the attributes its __init__ would set, per class
    s.pp_group_size, s.n_local_stages, s._num_stages, s._n_microbatches = pp, v, pp * v, m
    s.num_stages = pp * v
    s._stages, s._defer_pp_recv = [], False
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    if schedule in ("zero-bubble-v", "dualpipe-v"):
        s.stage_index_to_group_rank = generate_stage_to_rank_mapping(pp, pp * v, style="v")
    s.pipeline_order = {r: s._calculate_single_rank_operations(r) for r in range(pp)}
    if cls is ScheduleInterleavedZeroBubble:
        s.pipeline_order = s._add_bubbles_to_actions(pp * v)
    return s


def flat_actions(order) -> list:
    """An action list with each OVERLAP_F_B as its sub-actions, in order (what torch's runtime performs for it)."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    out: list = []
    for a in order:
        if a.computation_type == OVERLAP_F_B and a.sub_actions:
            out.extend(a.sub_actions)
        else:
            out.append(a)
    return out


def replay_peak(log: ActionLog, order: list, m: int, n: int, per_mb: dict[str, int], pp: int,
                second: bool = False, carried: float = 0.0) -> dict:
    """The figures at the peak of one pipeline rank's step at `m` micro-batches, replayed from the
    actions traced at `n`: each action of `order` (with its Waits) moves the live bytes by what the
    traced action of the same key (action_keys) did and rises above them by what it rose; the receive
    buffers and token ids of the m - n micro-batches not traced live through the whole step
    (step_long_bytes). RuntimeError when the order has an action whose key was not traced, or when two
    traced actions of one key moved memory differently (the key misses what decides it). Returns
    {"figures": at the peak, "closes": bytes by which the replayed step's end differs from the traced
    one's (0 when every allocation of the step is matched by its free), "at": where the peak is}."""
    keys = ("total", *CATEGORIES)
    extra = {k: per_mb.get(k, 0) * (m - n) for k in CATEGORIES}
    extra["total"] = sum(extra.values())

    def add(a: dict, b: dict, sign: int = 1) -> dict:
        return {k: a[k] + sign * b[k] for k in keys}

    by_key: dict[tuple, tuple[dict, dict]] = {}
    for seg, k in zip(log.actions, action_keys([s["action"] for s in log.actions], n, pp, second)):
        delta, rise = add(seg["end"], seg["start"], -1), add(seg["peak"], seg["start"], -1)
        if k in by_key:
            if by_key[k][0] != delta:
                raise RuntimeError(f"replay: traced action {k} moved memory by {by_key[k][0]} once and by {delta} "
                                   f"another time: what decides it is not in its key")
            if by_key[k][1]["total"] > rise["total"]:
                rise = by_key[k][1]
        by_key[k] = (delta, rise)
    first = next(s for s in log.actions if not s["probe"])
    level = add(first["start"], extra)
    best, at = add(log.head["peak"], extra), "before the first action"
    full = with_waits(order)
    i = -1
    for a, k in zip(full, action_keys(full, m, pp, second)):
        if k not in by_key:
            raise RuntimeError(f"replay: action {a} ({k}) of the order at {m} micro-batches was not traced at {n}")
        i += not isinstance(a, Wait)
        delta, rise = by_key[k]
        cand = add(level, rise)
        if cand["total"] > best["total"]:
            best, at = cand, (f"action {i} of {len(order)} ({a})" if not isinstance(a, Wait) else
                              f"action {i + 1} of {len(order)} ({order[i + 1]}) waiting for its unshard")
        level = add(level, delta)
    tail = add(level, add(log.tail["peak"], log.tail["start"], -1))
    if tail["total"] > best["total"]:
        best, at = tail, "after the last action (gradient clipping, optimizer)"
    # `carried`: bytes per micro-batch the step leaves for the next one to free (a split backward's input gradients
    # in the receive buffers' .grad: stage.py clears them at the next step), made by its actions, not up front
    closes = level["total"] - (log.tail["start"]["total"] + extra["total"] + carried * (m - n))
    return {"figures": best, "closes": closes, "at": at}
