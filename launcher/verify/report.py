"""What `launch verify` found, per role, beside the ledger (torch-free: dataclasses and text).

Every figure says where it came from: "traced" (measured by torch's memory tracker on the real
trainer under the fake world), "extended" (traced at fewer micro-batches, layers or in-flight
micro-batches and carried to the plan's, see roles.py), "shares the trace of" (a pipeline rank
whose shard equals traced ones'), "computed" (from the local shard shapes of the built model, when the step
could not be traced) or "not traced".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from launcher.verify.roles import Role

GB = 1e9
CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "comm_buffers")


@dataclass
class RoleResult:
    role: Role
    status: str                                   # traced | computed | failed
    peak_gb: float | None = None                  # traced (or extended) peak at the plan's micro-batch count
    categories_gb: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    state_gb: dict[str, float] = field(default_factory=dict)   # params/grads/optimizer from local shard shapes
    micro_batches_traced: list[int] = field(default_factory=list)
    schedule_note: str = ""
    ledger_gb: dict[str, float] | None = None     # the ledger's figures when it models this role
    ledger_total_gb: float | None = None          # without its allowance
    allowance_gb: float = 0.0                     # what no tracer sees: CUDA context, cuBLAS, NCCL
    capacity_gb: float = 0.0
    limit_gb: float = 0.0                         # what a plan may use: capacity less the headroom
    error: str | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0                      # its worker's user + sys time
    trace_of: list[int] = field(default_factory=list)   # pp ranks whose traces give these figures (shared)

    @property
    def needed_gb(self) -> float | None:
        """Peak plus the allowance for what no tracer sees (CUDA context, cuBLAS workspaces, NCCL)."""
        if self.peak_gb is None:
            return None
        return self.peak_gb + self.allowance_gb

    @property
    def fits(self) -> bool | None:
        if self.status == "failed":
            return False
        if self.needed_gb is None:
            return None
        return self.needed_gb <= (self.limit_gb or self.capacity_gb)

    @property
    def difference_gb(self) -> float | None:
        if self.peak_gb is None or self.ledger_total_gb is None:
            return None
        return self.peak_gb - self.ledger_total_gb

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "role"}
        d["role"] = self.role.to_dict()
        d["needed_gb"] = self.needed_gb
        d["fits"] = self.fits
        d["difference_gb"] = self.difference_gb
        return _round(d)


@dataclass
class VerifyReport:
    plan: str
    world_size: int
    capacity_gb: float
    roles: list[RoleResult]
    build_checks: list[dict]                      # {"rank", "ok", "error"} for ranks built but not stepped
    seconds: float = 0.0
    cpu_seconds: float = 0.0                      # this process and its role workers (user + sys)
    notes: list[str] = field(default_factory=list)

    @property
    def builds(self) -> bool:
        return all(r.status != "failed" for r in self.roles) and all(b["ok"] for b in self.build_checks)

    @property
    def fits(self) -> bool:
        return self.builds and all(r.fits is not False for r in self.roles)

    def to_dict(self) -> dict:
        return _round({"plan": self.plan, "world_size": self.world_size, "capacity_gb": self.capacity_gb,
                       "builds": self.builds, "fits": self.fits, "seconds": self.seconds,
                       "cpu_seconds": self.cpu_seconds,
                       "roles": [r.to_dict() for r in self.roles], "build_checks": self.build_checks,
                       "notes": self.notes})


def _round(x):
    """Six significant digits, not decimal places: a CPU example's whole rank is a few MB (0.0026 GB), and its
    categories must still add up to its peak in the JSON."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v) for v in x]
    return x


def render(rep: VerifyReport) -> str:
    """The human table: per role, traced categories beside the ledger's (GB, or MB for small jobs)."""
    peaks = [r.peak_gb for r in rep.roles if r.peak_gb is not None]
    scale, unit = (1.0, "GB") if not peaks or max(peaks) >= 1 else (1e3, "MB")

    def _f(x: float | None, width: int = 7) -> str:
        return f"{'-':>{width}}" if x is None else f"{x * scale:>{width}.2f}"

    own = sum(1 for r in rep.roles if not r.trace_of)
    out = [f"{rep.plan}: {rep.world_size} ranks, {len(rep.roles)} role(s), {own} traced on this CPU under a fake "
           f"process group ({unit} = 1e{9 if unit == 'GB' else 6} bytes, GPU {rep.capacity_gb:.0f} GB)"]
    for r in rep.roles:
        out.append("")
        head = f"{r.role.name} — rank {r.role.rank}"
        if r.status == "failed":
            out.append(f"{head}: DOES NOT BUILD: {r.error}")
            continue
        verdict = {True: "fits", False: "DOES NOT FIT", None: "unknown"}[r.fits]
        needed = "-" if r.needed_gb is None else f"{r.needed_gb:.2f}"
        out.append(f"{head}: peak {_f(r.peak_gb, 0)} {unit} + runtime {r.allowance_gb:.2f} GB = {needed} GB of "
                   f"{r.limit_gb or r.capacity_gb:.1f} GB usable ({r.capacity_gb:.0f} GB less headroom)  {verdict}  "
                   + (f"[{r.status}, {r.seconds:.1f} s]" if not r.trace_of else
                      f"[{r.status}: shares the trace of {' and '.join(f'pp {q}' for q in r.trace_of)}]"))
        out.append(f"  {'category':<14} {'traced':>8} {'ledger':>8} {'diff':>8}  source")
        for c in CATEGORIES:
            led = None if r.ledger_gb is None else r.ledger_gb.get(c)
            val = r.categories_gb.get(c)
            diff = None if val is None or led is None else val - led
            out.append(f"  {c:<14} {_f(val, 8)} {_f(led, 8)} {_f(diff, 8)}  {r.sources.get(c, 'not traced')}")
        out.append(f"  {'total':<14} {_f(r.peak_gb, 8)} {_f(r.ledger_total_gb, 8)} {_f(r.difference_gb, 8)}"
                   + ("" if r.ledger_gb is not None else "  (the ledger prices the first and last pipeline ranks)"))
        st = r.state_gb
        if st:
            out.append(f"  state from local shard shapes: params {_f(st['params'], 0)}, grads {_f(st['grads'], 0)}, "
                       f"optimizer {_f(st['optimizer'], 0)} {unit}")
        out.append(f"  micro-batches: {r.schedule_note}")
        if r.error:
            out.append(f"  not traced: {r.error}")
    for b in rep.build_checks:
        out.append("")
        out.append(f"rank {b['rank']} (built, not stepped): " + ("builds" if b["ok"] else f"DOES NOT BUILD: {b['error']}"))
    for n in rep.notes:
        out.append(f"note: {n}")
    out.append("")
    out.append(f"{'fits' if rep.fits else ('DOES NOT BUILD' if not rep.builds else 'DOES NOT FIT')} "
               f"({rep.seconds:.1f} s, {rep.cpu_seconds:.1f} s CPU)")
    return "\n".join(out)
