"""HuggingFace config.json as the model (issue 22 §3): each family's published config (tests/data/hf, ours)
reads into ModelSpec with the published parameter count, plans at full size, names what it does not
reproduce in one note per key, and what it cannot build (DeepSeek-V3's latent attention) in one error line
at plan time. GPU presets: aliases and sources."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from launcher.errors import SpecError, UserError
from launcher.plan import presets
from launcher.plan.ledger import param_counts
from launcher.plan.planner import plan_job
from launcher.plan.spec import resolve_gpu, resolve_model, resolve_model_notes, spec_from_dict
from tests.cli_helpers import launch

pytestmark = pytest.mark.unit

HF = Path(__file__).parents[1] / "data" / "hf"

#: config -> (fields the family implies, total parameters, active parameters) — the published counts
#: (model cards: Qwen3-30B-A3B 30.5 B / 3.3 B activated, Gemma 7B 8.54 B, Llama 3.1 8B 8.03 B, Mixtral 46.7 B /
#: 12.9 B, DeepSeek-MoE 16B 16.4 B / 2.8 B, Qwen2-7B 7.6 B, BLOOM-7b1 7.07 B)
FAMILIES: dict[str, tuple[dict[str, Any], float, float | None]] = {
    "qwen3-30b-a3b": (dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, experts_per_token=8,
                           moe_ffn_hidden=768, rope_theta=1e6, tied_embeddings=False), 30.53e9, 3.35e9),
    "gemma-7b": (dict(layers=28, hidden=3072, heads=16, head_dim=256, ffn_hidden=24576, mlp="geglu",
                      tied_embeddings=True, vocab=256000), 8.54e9, None),
    "llama3.1-8b": (dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn_hidden=14336,
                         mlp="swiglu", rope_theta=5e5, vocab=128256), 8.03e9, None),
    "mixtral-8x7b": (dict(experts=8, experts_per_token=2, moe_ffn_hidden=14336), 46.70e9, 12.88e9),
    "deepseek-moe-16b": (dict(experts=64, experts_per_token=6, moe_ffn_hidden=1408, ffn_hidden=10944,
                              shared_experts=2, first_dense_layers=1), 16.38e9, 2.83e9),
    "qwen2-7b": (dict(layers=28, hidden=3584, kv_heads=4, vocab=152064), 7.62e9, None),
    "bloom-7b1": (dict(layers=30, heads=32, position="alibi", mlp="gelu", tied_embeddings=True, ffn_hidden=16384),
                  7.07e9, None),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_family_config_reads_with_the_published_parameter_count(name):
    fields, total, active = FAMILIES[name]
    m = resolve_model(str(HF / f"{name}.json"))
    assert {k: getattr(m, k) for k in fields} == fields
    c = param_counts(m)
    assert c.total == pytest.approx(total, rel=2e-3)
    if active is not None:
        assert c.active(m.experts_per_token) == pytest.approx(active, rel=2e-3)
    assert m.preset == f"hf:{json.loads((HF / f'{name}.json').read_text())['model_type']} ({name}.json)"


def test_notes_name_each_key_not_reproduced():
    _, notes = resolve_model_notes(str(HF / "llama3.1-8b.json"))
    assert len(notes) == 1 and notes[0].startswith("rope_scaling: 'llama3' is not applied")
    _, notes = resolve_model_notes(str(HF / "deepseek-moe-16b.json"))
    assert [n.split(":")[0] for n in notes] == ["scoring_func", "norm_topk_prob", "router_aux_loss_coef"]
    # keys no family has: one line naming them all
    cfg = {**json.loads((HF / "gemma-7b.json").read_text()), "my_flag": 1, "other": 2}
    from launcher.plan.hf_config import from_hf

    _, notes = from_hf(cfg)
    assert "ignored, not keys launch4d knows: my_flag, other" in notes


def test_latent_attention_is_refused_at_plan_time_naming_the_key(tmp_path):
    with pytest.raises(SpecError, match=r"^model\.kv_lora_rank: 512: DeepSeek's multi-head latent attention"):
        resolve_model(str(HF / "deepseek-v3.json"))
    r = launch("plan", "--hf", HF / "deepseek-v3.json", "--json")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert json.loads(r.stdout)["field"] == "model.kv_lora_rank"


def test_config_path_is_relative_to_the_job_file_and_plans_at_full_size(tmp_path):
    (tmp_path / "hf").mkdir()
    shutil.copy(HF / "qwen3-30b-a3b.json", tmp_path / "hf" / "config.json")
    job = tmp_path / "job.yaml"
    job.write_text("model: hf/config.json\ntrain: {seq_len: 4096, global_batch: 256}\ncluster: {nodes: 2, gpu: H100}\n")
    r = launch("plan", job, "--json", "--top", "0", cwd=Path("/"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["best"]["fits"] and out["best"]["model"]["head_dim"] == 128
    assert out["model"]["params"] == pytest.approx(30.53e9, rel=2e-3)
    assert out["model"]["active_params"] == pytest.approx(3.35e9, rel=2e-3)
    assert any(n.startswith("model: router_aux_loss_coef") for n in out["notes"])
    text = launch("plan", job, "--top", "0").stdout
    assert "(30.53 B parameters, 3.35 B active per token)" in text.splitlines()[0]


@pytest.mark.parametrize("name, nodes", [("gemma-7b", 1), ("llama3.1-8b", 1), ("qwen3-30b-a3b", 2)])
def test_required_families_plan_at_full_size(name, nodes):
    spec = spec_from_dict({"model": str(HF / f"{name}.json"), "train": {"seq_len": 8192, "global_batch": 256},
                           "cluster": {"nodes": nodes, "gpu": "h100"}})
    result = plan_job(spec, top=0)
    assert result.best is not None and result.best.fits
    assert result.best.model == spec.model


def test_inline_huggingface_keys_map_and_a_typo_is_one_error():
    m, notes = resolve_model_notes({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                    "vocab_size": 256, "torch_dtype": "bfloat16", "head_dim": 32, "mlp": "gelu"})
    assert (m.layers, m.hidden, m.heads, m.head_dim, m.mlp, m.preset) == (2, 64, 4, 32, "gelu", "custom") and not notes
    with pytest.raises(SpecError, match=r"^model\.kv_head: unknown key \(did you mean 'kv_heads'\?\)"):
        resolve_model({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256,
                       "kv_head": 2})
    with pytest.raises(SpecError, match=r"^model\.hidden_size: gives hidden a second time"):
        resolve_model({"hidden_size": 64, "hidden": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "vocab_size": 256})


def test_missing_config_names_the_field(tmp_path):
    with pytest.raises(SpecError, match=r"^model: 'nope/config.json': no HuggingFace config at"):
        spec_from_dict({"model": "nope/config.json", "train": {"seq_len": 64, "global_batch": 8}},
                       source=str(tmp_path / "job.yaml"))
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="a HuggingFace config is a JSON object"):
        resolve_model(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("model, field", [
    (dict(hidden=60, heads=4, position="rope"), "model.head_dim"),            # head_dim 15: RoPE needs even
    (dict(first_dense_layers=1), "model.first_dense_layers"),                 # needs experts
    (dict(experts=4, experts_per_token=2, first_dense_layers=2), "model.first_dense_layers"),  # no MoE layer left
])
def test_shapes_the_trainer_cannot_build_name_the_field(model, field):
    base = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256}
    with pytest.raises(SpecError, match=rf"^{re.escape(field)}: "):
        spec_from_dict({"model": {**base, **model}, "train": {"seq_len": 64, "global_batch": 8}})
    # ALiBi takes the odd head_dim RoPE refuses
    spec_from_dict({"model": {**base, "hidden": 60, "position": "alibi"}, "train": {"seq_len": 64, "global_batch": 8}})


@pytest.mark.parametrize("alias, name", [("h100", "h100-sxm"), ("B200", "b200"), ("H200", "h200"), ("GB200", "gb200"),
                                         ("MI300X", "mi300x"), ("a100", "a100-80gb"), ("L40S", "l40s")])
def test_gpu_aliases_resolve_case_insensitively(alias, name):
    assert resolve_gpu(alias).name == name


def test_every_gpu_preset_cites_its_source():
    """Each datacenter part in the table, and a comment naming a datasheet above each entry's group."""
    for part in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h100-nvl", "h200", "b200", "gb200", "l40s",
                 "mi300x", "mi325x"):
        assert part in presets.GPUS
    lines = Path(presets.__file__).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("GPUS"))
    block, last_was_entry = "", False
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        text = line.strip()
        if text.startswith("#"):
            block = (text if last_was_entry else block + " " + text)
            last_was_entry = False
        elif text.startswith('"') and not text.startswith('"cpu"'):
            assert "datasheet" in block, f"no source comment above {text}"
            last_was_entry = True
