"""FP8 linears (train.precision fp8): torchtitan's float8 recipe, torchao's dynamic rowwise scaling.

Why this shape: torchtitan converts the model's nn.Linear modules to torchao's Float8Linear before it
parallelizes (its Float8LinearConverter, recipe "rowwise", filter_fqns for the head and the router); each
linear's three GEMMs (output, input gradient, weight gradient) then cast their operands to e4m3 with one
power-of-two scale per row along the GEMM's inner dimension, computed from that tensor alone (no amax history),
and call torch._scaled_mm; everything else, collectives included, stays bf16. The same here:
- a linear called as a module (no TP, and a MoE's shared experts) becomes torchao's Float8Linear;
- under TP the attention's and MLP's linears are sequence_parallel.py's ops, which never call the module: their
  GEMMs go through :func:`mm` below, the same recipe written out (the same ops in the same dtypes as torchao's
  Float8Linear, so the same bits: tests/unit/test_float8.py), and the module is only marked (``linear.fp8``).
Which linears convert is capabilities.fp8_converts on the whole model's shapes (train.fp8_linears).

torchao is imported when a plan asks for fp8 (the [train] extra installs it).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from launcher.plan.capabilities import fp8_converts

#: torchao's recipe name (Float8LinearConfig.from_recipe_name), torchtitan's default
RECIPE = "rowwise"
#: the smallest amax a scale is computed from (torchao.float8.float8_utils.EPS)
EPS = 1e-12
#: Whether the backward GEMMs apply the rowwise scales inside torch._scaled_mm (its fast-accumulation kernel) instead of
#: torchao's tensorwise kernel with the output rescaled (mm): None is "on a CPU only". The CPU kernel accumulates in
#: fp32 either way (the same outputs with and without the flag) but its tensorwise path is ~40x slower (45 ms for a
#: 32x64x176 GEMM, 0.1 ms rowwise), so CPU runs take the rowwise one; GPUs run torchtitan's recipe as it is.
#: `launch verify` sets False: its fake CPU tensors stand for the nodes' GPUs.
BACKWARD_FAST_ACCUM: bool | None = None

#: module names that stay bf16 whatever their shape: the output head (torchtitan's filter_fqns lm_head; the loss
#: uses its weight directly anyway), a MoE's router (router.gate) and routed experts (grouped-GEMM fp8 in torchtitan)
KEPT = ("output", "router", ".experts.")


def _torchao():
    """torchao.float8, imported quietly: on a CPU-only torch its CUDA extensions fail to load (warnings only)."""
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8 as ao
    except ImportError as exc:    # pragma: no cover - the [train] extra installs it
        raise ImportError("train.precision fp8 needs torchao (pip install 'launch4d[train]')") from exc
    finally:
        for lg, lv in zip(quiet, levels):
            lg.setLevel(lv)
    return ao


def e4m3() -> torch.dtype:
    """The e4m3 type torchao casts to (float8_e4m3fnuz on MI300, float8_e4m3fn elsewhere)."""
    from torchao.float8.config import e4m3_dtype
    return e4m3_dtype


def selected(name: str, linear: nn.Module, rule: str) -> bool:
    """Whether the linear `name` converts; its shape is the whole model's (a TP-sharded weight is a DTensor, whose
    shape is the global one)."""
    if any(k in f".{name}" for k in KEPT):
        return False
    w = linear.weight
    assert isinstance(w, torch.Tensor)
    return fp8_converts(int(w.shape[0]), int(w.shape[1]), rule)


def fast_backward(device: torch.device) -> bool:
    """BACKWARD_FAST_ACCUM for a run on `device`."""
    return BACKWARD_FAST_ACCUM if BACKWARD_FAST_ACCUM is not None else device.type == "cpu"


def convert(model: nn.Module, rule: str, device: torch.device) -> int:
    """Convert `model`'s selected linears (on the meta device, after TP, before FSDP): a module called as one becomes
    torchao's Float8Linear, a sequence-parallel one (its parent has `sp` set) is marked `fp8`. Returns how many."""
    ao = _torchao()
    from torchao.float8.float8_linear import Float8Linear

    config = ao.Float8LinearConfig.from_recipe_name(RECIPE)
    if fast_backward(device):
        fast = ao.Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    n = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is not nn.Linear or not selected(name, child, rule):
                continue
            if getattr(parent, "sp", None) is not None:
                child.fp8 = True            # type: ignore[assignment]  # sequence_parallel.py's ops read it
            else:
                setattr(parent, child_name, Float8Linear.from_float(child, config=config))
            n += 1
    return n


def converted(model: nn.Module) -> int:
    """How many of `model`'s linears run in fp8 (Float8Linear modules and marked sequence-parallel ones)."""
    return sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear" or getattr(m, "fp8", False))


def fp8_flags(*linears: nn.Module) -> list[bool]:
    """The sequence-parallel ops' per-weight fp8 switches."""
    return [bool(getattr(lin, "fp8", False)) for lin in linears]


# --- the recipe written out (for the sequence-parallel ops) -------------------------------------

def cast(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 data, fp32 scale) of `t` scaled along `dim` (the GEMM's inner one): amax |t| per row, scale =
    max(e4m3) / amax rounded down to a power of two, data = saturate(t · scale). torchao's
    hp_tensor_to_float8_dynamic with AXISWISE granularity and round_scales_to_power_of_2, op for op, except that the
    scaling and the saturation run in place on the one fp32 copy (the same bits; CAST_BYTES)."""
    dtype = e4m3()
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True)
    fmax = torch.finfo(dtype).max
    scale = (fmax / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = t.to(torch.float32, copy=True).mul_(scale).clamp_(min=-fmax, max=fmax)
    return scaled.to(dtype), scale


#: Rows of a backward GEMM's output rescaled at a time (mm: the fp32 outer product of the scales, chunked)
POST_ROWS = 1024


def mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype,
       fast_accum: bool) -> torch.Tensor:
    """a [M, K] (row-major) @ b [K, N] (column-major), scales [M, 1] and [1, N] (what `cast` made, multiplying):
    torch._scaled_mm with the inverse scales. Without fast accumulation (the backward GEMMs) torchao runs the
    tensorwise kernel and multiplies the bf16 output by the fp32 outer product of the inverse scales afterwards
    (addmm_float8_unwrapped): the same here, POST_ROWS rows at a time (the same bits, without the [M, N] fp32)."""
    inv_a, inv_b = a_scale.reciprocal(), b_scale.reciprocal()
    if fast_accum:
        out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=torch.bfloat16, use_fast_accum=True)
    else:
        one = inv_a.new_ones(())
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=False)
        for i in range(0, out.shape[0], POST_ROWS):
            out[i:i + POST_ROWS] *= inv_a[i:i + POST_ROWS] * inv_b
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def linear(x: torch.Tensor, w: torch.Tensor, cast_x: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].t() as Float8Linear's forward: both scaled along K, fast accumulation (`cast_x`: x already
    cast, cast(x, -1), shared by the linears of one input)."""
    xa, sx = cast_x or cast(x, -1)
    wa, sw = cast(w, -1)
    return mm(xa, sx, wa.t(), sw.t(), x.dtype, fast_accum=True)


def input_grad(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """g [M, N] @ w [N, K]: the output gradient scaled along N per row, the weight along N per column."""
    ga, sg = cast(g, -1)
    wa, sw = cast(w, 0)
    return mm(ga, sg, wa.t().contiguous().t(), sw, g.dtype, fast_accum=fast_backward(g.device))


def weight_grad(g: torch.Tensor, x: torch.Tensor,
                cast_x: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """g [M, N].t() @ x [M, K] -> [N, K]: both scaled along the tokens M (`cast_x`: column_major(x), shared)."""
    ga, sg = cast(g, 0)
    xa, sx = cast_x or column_major(x)
    return mm(ga.t().contiguous(), sg.t(), xa, sx, g.dtype, fast_accum=fast_backward(g.device))


def column_major(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] cast along M, laid out column-major (the weight gradient's second operand)."""
    xa, sx = cast(x, 0)
    return xa.t().contiguous().t(), sx
