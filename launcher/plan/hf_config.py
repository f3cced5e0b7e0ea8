"""HuggingFace `config.json` → the job file's model mapping (ModelSpec's keys), with one note per key
whose meaning the bundled trainer does not reproduce.

Why a table and not transformers: `launch plan` runs on a login node without torch or transformers,
and a config is plain JSON. Each family's keys are read as its modelling code reads them
(transformers' configuration_<family>.py defaults where a key is absent). A key that changes the
*shape* in a way the trainer cannot build (DeepSeek's latent attention, MoE layers every k-th layer) is
refused with one line naming the key, at plan time, never after the allocation; a key that changes
only numerics the planner does not price (RoPE scaling, soft-capping, sliding windows) becomes a note.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher.errors import SpecError, UserError
from launcher.plan.schema import did_you_mean, show

#: model_type → family (the rules below); absent model_type: "generic".
FAMILIES = {
    "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen2_moe": "qwen2",
    "qwen3": "qwen3", "qwen3_moe": "qwen3", "gemma": "gemma", "gemma2": "gemma", "gemma3_text": "gemma",
    "gemma3": "gemma", "deepseek": "deepseek", "deepseek_v2": "deepseek", "deepseek_v3": "deepseek",
    "bloom": "bloom",
}

#: HF key → ModelSpec key (every family's spelling).
RENAMES = {
    "num_hidden_layers": "layers", "n_layer": "layers",
    "hidden_size": "hidden", "n_embed": "hidden",
    "num_attention_heads": "heads", "n_head": "heads",
    "num_key_value_heads": "kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "ffn_hidden",
    "vocab_size": "vocab",
    "tie_word_embeddings": "tied_embeddings",
    "rope_theta": "rope_theta",
    "num_local_experts": "experts", "num_experts": "experts", "n_routed_experts": "experts",
    "num_experts_per_tok": "experts_per_token",
    "moe_intermediate_size": "moe_ffn_hidden",
    "n_shared_experts": "shared_experts",
    "first_k_dense_replace": "first_dense_layers",
}

#: Keys that describe the checkpoint, the tokenizer or inference, or numerics the planner need not know.
IGNORED = frozenset({
    "architectures", "model_type", "torch_dtype", "transformers_version", "_name_or_path", "bos_token_id",
    "eos_token_id", "pad_token_id", "unk_token_id", "use_cache", "initializer_range", "initializer_factor",
    "max_position_embeddings", "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "attention_dropout",
    "hidden_dropout", "pretraining_tp", "output_router_logits", "router_jitter_noise", "tokenizer_class",
    "max_window_layers", "use_sliding_window", "ep_size", "masked_softmax_fusion", "slow_but_exact",
    "attention_softmax_in_fp32", "bias_dropout_fusion", "skip_bias_add", "skip_bias_add_qkv", "seq_length",
    "n_inner", "offset_alibi", "cache_implementation", "dtype", "hidden_act", "hidden_activation",
    "auto_map", "model_name", "use_bfloat16", "id2label", "label2id", "return_dict", "is_decoder",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank",
    "decoder_sparse_step", "mlp_only_layers", "moe_layer_freq", "shared_expert_intermediate_size",
    "attention_bias", "mlp_bias", "sliding_window", "rope_scaling", "quantization_config", "norm_topk_prob",
    "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "text_config", "vision_config",
})

#: Keys the trainer does not reproduce, whatever their value: one note each (what differs).
NOT_BUILT = {
    "attn_logit_softcapping": "attention logits are not soft-capped",
    "final_logit_softcapping": "output logits are not soft-capped",
    "query_pre_attn_scalar": "attention scores are scaled by 1/sqrt(head_dim)",
    "rope_local_base_freq": "every layer uses rope_theta",
    "sliding_window_pattern": "every layer attends to the whole causal prefix",
    "layer_types": "every layer attends to the whole causal prefix",
    "topk_method": "routing is softmax top-k (Mixtral's)",
    "scoring_func": "routing is softmax top-k (Mixtral's)",
    "n_group": "routing is softmax top-k over all experts (no group-limited routing)",
    "topk_group": "routing is softmax top-k over all experts (no group-limited routing)",
    "routed_scaling_factor": "routed experts' outputs are not rescaled",
    "num_nextn_predict_layers": "no multi-token-prediction layers are built",
    "apply_residual_connection_post_layernorm": "residuals are taken before the norm (pre-norm)",
}

#: Our own keys (spec.ModelSpec) that may appear beside HF ones in a job file's `model:`.
OWN_KEYS = ("layers", "hidden", "heads", "vocab", "kv_heads", "head_dim", "ffn_hidden", "mlp", "tied_embeddings",
            "experts", "experts_per_token", "moe_ffn_hidden", "shared_experts", "first_dense_layers", "position",
            "rope_theta", "vocab_multiple", "preset")

#: Families whose embedding and output head are tied when tie_word_embeddings is absent (their config class
#: default: PretrainedConfig's True, kept by Gemma and BLOOM; Llama, Mistral, Qwen, DeepSeek set False).
TIED_BY_DEFAULT = ("gemma", "bloom")

#: Activations of a gated MLP (the act_fn of act(gate(x)) * up(x)).
GATED_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu",
              "gelu_new": "geglu", "gelu_fast": "geglu"}


def is_hf_mapping(data: dict) -> bool:
    """A job file's `model:` written (at least partly) in HuggingFace's keys."""
    return any(k not in OWN_KEYS and (k in RENAMES or k in NOT_BUILT or k in IGNORED) for k in data)


def load_config(path: str | Path, field: str = "model") -> tuple[dict[str, Any], list[str]]:
    """Read a HuggingFace config.json: (ModelSpec mapping, notes). UserError for a file that is not one."""
    from launcher.formats.files import read_text

    p = Path(path)
    try:
        data = json.loads(read_text(p, "HuggingFace config", 1 << 20))
    except json.JSONDecodeError as exc:
        raise UserError(f"{field}: {p}: not a JSON HuggingFace config (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise UserError(f"{field}: {p}: a HuggingFace config is a JSON object, not {type(data).__name__}")
    try:
        mapping, notes = from_hf(data, source=p.name)
    except SpecError as exc:
        raise in_file(exc, p) from None
    return mapping, notes


def in_file(exc: SpecError, path: Path) -> SpecError:
    """The same error, saying which config file the key is in."""
    message = str(exc)[len(exc.path) + 2:] if exc.path else str(exc)
    return SpecError(exc.path, f"{message} (in {path})")


def from_hf(data: dict[str, Any], source: str | None = None, strict: bool = False) -> tuple[dict[str, Any], list[str]]:
    """ModelSpec keys from a HuggingFace config (or a job file's `model:` mixing both vocabularies), and one
    note per key the trainer does not reproduce. SpecError `model.<hf key>` where the shape cannot be built.

    `strict` (a job file's inline mapping): a key neither ours nor HuggingFace's is an error (a typo);
    in a config file it is one note listing them."""
    notes: list[str] = []
    if "num_hidden_layers" not in data and isinstance(data.get("text_config"), dict):
        notes.append(f"text_config: the language model of a {data.get('model_type', 'multimodal')} config "
                     "(its vision tower is not built)")
        data = {"model_type": data.get("model_type"), **data["text_config"]}
    model_type = data.get("model_type")
    family = FAMILIES.get(model_type, "generic") if isinstance(model_type, str) else "generic"
    if model_type is not None and family == "generic":
        notes.append(f"model_type: {show(model_type)} is not a family launch4d knows ({', '.join(sorted(FAMILIES))});"
                     " read with the Llama rules")
    _refuse(data)
    out: dict[str, Any] = {}
    unknown = []
    for key, value in data.items():
        if key in OWN_KEYS:
            continue
        if key in RENAMES:
            ours = RENAMES[key]
            if ours in data or ours in out:
                raise SpecError(f"model.{key}", f"gives {ours} a second time (as {key} and {ours}); keep one")
            out[ours] = value
        elif key in NOT_BUILT:
            if value not in (None, False, 0):
                notes.append(f"{key}: {NOT_BUILT[key]} by the bundled trainer")
        elif key not in IGNORED:
            unknown.append(str(key))
    if unknown:
        if strict:
            bad = unknown[0]
            raise SpecError(f"model.{bad}", f"unknown key{did_you_mean(bad, [*OWN_KEYS, *RENAMES])}; give ModelSpec's "
                                            f"keys ({', '.join(OWN_KEYS[:8])}, ...) or HuggingFace's")
        notes.append(f"ignored, not keys launch4d knows: {', '.join(unknown[:12])}"
                     f"{f' and {len(unknown) - 12} more' if len(unknown) > 12 else ''}")
    out.update({k: data[k] for k in OWN_KEYS if k in data})
    _family_rules(family, data, out, notes)
    if "preset" not in out and (model_type or source):
        out["preset"] = f"hf:{model_type or 'config'}" + (f" ({source})" if source else "")
    return out, notes


def _refuse(data: dict[str, Any]) -> None:
    """Shapes the trainer cannot build: one SpecError naming the key."""
    for key in ("kv_lora_rank", "q_lora_rank"):
        if data.get(key):
            raise SpecError(f"model.{key}", f"{show(data[key])}: DeepSeek's multi-head latent attention (low-rank "
                                            "compressed keys and values) is not built by the bundled trainer")
    sparse = data.get("decoder_sparse_step", 1)
    if sparse not in (None, 0, 1):
        raise SpecError("model.decoder_sparse_step", f"{show(sparse)}: mixture-of-experts every k-th layer is not "
                                                     "built (every layer past first_dense_layers is one)")
    freq = data.get("moe_layer_freq", 1)
    if freq not in (None, 1):
        raise SpecError("model.moe_layer_freq", f"{show(freq)}: mixture-of-experts every k-th layer is not built")
    if data.get("mlp_only_layers"):
        raise SpecError("model.mlp_only_layers", f"{show(data['mlp_only_layers'])}: dense layers among the "
                                                 "experts' are not built (only the first k: first_k_dense_replace)")


def _family_rules(family: str, data: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """What each family's modelling code implies beyond the renamed keys."""
    act = data.get("hidden_activation") or data.get("hidden_act")
    if "mlp" not in out:
        if family == "bloom":
            out["mlp"] = "gelu"
        elif act is not None:
            if act not in GATED_ACTS:
                raise SpecError("model.hidden_act", f"{show(act)}: a gated MLP with this activation is not built "
                                                    f"(choose {', '.join(GATED_ACTS)})")
            out["mlp"] = GATED_ACTS[act]
        else:
            out["mlp"] = "geglu" if family == "gemma" else "swiglu"
    if "tied_embeddings" not in out:
        out["tied_embeddings"] = family in TIED_BY_DEFAULT
    if family == "bloom":
        out.setdefault("position", "alibi")
        notes.append("bloom: LayerNorm with biases and the embedding's LayerNorm are built as RMSNorm without "
                     "biases (parameters within 0.1%)")
    if family == "qwen2":
        notes.append(f"{data.get('model_type')}: the q/k/v projections' biases are not built "
                     "(heads·head_dim + 2·kv_heads·head_dim parameters a layer)")
    if family == "qwen3":
        notes.append(f"{data.get('model_type')}: the per-head RMSNorm of queries and keys is not built "
                     "(2·head_dim parameters a layer)")
    if family == "gemma":
        notes.append(f"{data.get('model_type')}: the embedding's sqrt(hidden) scaling and the norms' (1 + weight) "
                     "are not reproduced (same shapes and FLOPs)")
        if data.get("model_type") in ("gemma2", "gemma3", "gemma3_text"):
            notes.append(f"{data.get('model_type')}: the norms after attention and after the MLP are not built "
                         "(2·hidden parameters a layer)")
    for key, what in (("attention_bias", "attention projections' biases"), ("mlp_bias", "MLP biases")):
        if data.get(key):
            notes.append(f"{key}: the {what} are not built")
    if data.get("sliding_window") and data.get("use_sliding_window", True):
        notes.append(f"sliding_window: {show(data['sliding_window'])}: attention is full causal (no sliding window)")
    if data.get("rope_scaling"):
        kind = data["rope_scaling"].get("rope_type", data["rope_scaling"].get("type")) \
            if isinstance(data["rope_scaling"], dict) else data["rope_scaling"]
        notes.append(f"rope_scaling: {show(kind)} is not applied: plain RoPE at rope_theta (sequences up to "
                     "the pretraining length train as HF's)")
    if data.get("quantization_config"):
        notes.append("quantization_config: the checkpoint's quantization is not used; training is bf16 "
                     "with fp32 masters")
    if data.get("norm_topk_prob") is False and (out.get("experts") or 1) > 1:
        notes.append("norm_topk_prob: false, but the bundled router renormalises the top-k weights to 1")
    if family != "bloom" and (out.get("experts") or 1) > 1 and (data.get("router_aux_loss_coef")
                                                                 or data.get("aux_loss_alpha")):
        notes.append("router_aux_loss_coef: no auxiliary load-balancing loss is added")
    shared = data.get("shared_expert_intermediate_size")
    if shared:
        width = out.get("moe_ffn_hidden") or out.get("ffn_hidden")
        if not isinstance(shared, int) or not isinstance(width, int) or shared % width:
            raise SpecError("model.shared_expert_intermediate_size",
                            f"{show(shared)} is not a multiple of moe_intermediate_size={show(width)}: the shared "
                            "expert is built as shared_experts × moe_ffn_hidden")
        out.setdefault("shared_experts", shared // width)
        notes.append("shared_expert_intermediate_size: the shared expert's sigmoid gate is not built "
                     "(hidden parameters a layer)")
    for key in ("shared_experts", "head_dim", "ffn_hidden", "moe_ffn_hidden", "first_dense_layers"):
        if out.get(key) is None:
            out.pop(key, None)
    if (out.get("experts") or 1) <= 1:          # a dense config that names MoE keys (null or 0)
        for key in ("experts", "experts_per_token", "moe_ffn_hidden", "shared_experts", "first_dense_layers"):
            out.pop(key, None)
