"""nvidia-smi topo -m parser on the real captures in ../shared/fixtures/topo (read there, never copied)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checks.parsers.base import ParseError
from checks.parsers.topo import parse_topo
from tests.conftest import REPO, absent, shared_file, shared_texts

pytestmark = pytest.mark.unit

TOPO_FILES = [
    "a800-sxm4-8gpu-nv8-8nic-mlx5bond-2numa.txt", "dgx-a100-8gpu-nv12-10nic-mlx5-4numa.txt",
    "dgx1-v100-8gpu-hybrid-cube-mesh-nv1-nv2-4mlx5-oldlegend.txt", "h100-8gpu-topo-mp-pcie-only-12nic-mlx5.txt",
    "h100-sxm-8gpu-12nic-mlx5-1numa.txt", "h200-sxm-8gpu-8nic-mlx5-2numa.txt", "hopper-sxm-8gpu-nv18-no-nic-spaces.txt",
    "pcie-8gpu-all-sys-2numa-no-nic.txt", "polaris-a100-sxm-4gpu-nv4-mlx5-oldformat.txt",
    "rtx6000ada-pcie-2gpu-phb-2nic-spaces.txt", "rtx6000ada-pcie-4gpu-4nic-2numa-spaces.txt",
    "rtxa6000-3gpu-nv4-bridge-pair-ansi.txt", "v100sxm2-pair-nv6-plus-3090-ansi.txt",
]


def topo(name: str):
    return parse_topo(shared_file("topo", name).read_text())


@pytest.mark.parametrize("name", TOPO_FILES)
def test_every_capture_parses_with_a_square_matrix(name):
    t = topo(name)
    names = [g.name for g in t.gpus] + [n.name for n in t.nics]
    assert set(t.links) == set(names)
    for a in names:
        assert t.links[a][a] == "X"
        assert set(t.links[a]) == set(names)


def test_h100_sxm_nv18_single_group_and_pix_nics():
    t = topo("h100-sxm-8gpu-12nic-mlx5-1numa.txt")
    assert len(t.gpus) == 8 and len(t.nics) == 12
    assert t.links["GPU0"]["GPU1"] == "NV18"
    assert t.nvlinks["GPU0"]["GPU7"] == 18
    assert t.nvlink_groups == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # GPU3 is PIX to NIC5, GPU7 to NIC11 (irregular, as printed)
    assert t.nearest_nic["GPU0"] == "mlx5_0"
    assert t.nearest_nic["GPU3"] == "mlx5_5"
    assert t.nearest_nic["GPU7"] == "mlx5_11"
    assert t.gpus[0].cpu_affinity == "0-191" and t.gpus[0].numa_affinity == "0" and t.gpus[0].gpu_numa_id == "N/A"


def test_h200_irregular_gpu_nic_mapping():
    t = topo("h200-sxm-8gpu-8nic-mlx5-2numa.txt")
    assert t.nearest_nic["GPU0"] == "mlx5_4"
    assert t.nearest_nic["GPU7"] == "mlx5_2"
    assert t.gpus[4].cpu_affinity == "64-127,192-255" and t.gpus[4].numa_affinity == "1"


def test_nic_rows_without_trailing_cells_and_bond_names():
    t = topo("a800-sxm4-8gpu-nv8-8nic-mlx5bond-2numa.txt")
    assert [n.device for n in t.nics][:2] == ["mlx5_bond_0", "mlx5_bond_1"]
    assert t.links["NIC7"]["NIC6"] == "PIX"
    assert t.nvlinks["GPU2"]["GPU5"] == 8


def test_old_format_nic_columns_named_by_device():
    t = topo("dgx1-v100-8gpu-hybrid-cube-mesh-nv1-nv2-4mlx5-oldlegend.txt")
    assert [n.name for n in t.nics] == ["mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3"]
    assert t.links["GPU0"]["GPU3"] == "NV2" and t.links["GPU0"]["GPU5"] == "SYS"
    assert t.nvlink_groups == [[0, 1, 2, 3, 4, 5, 6, 7]]  # hybrid cube mesh: connected, not all pairs
    assert "GPU5" not in t.nvlinks["GPU0"]
    assert t.gpus[0].numa_affinity is None  # only CPU Affinity in this driver's header


def test_hand_edited_header_with_joined_affinity_columns():
    t = topo("polaris-a100-sxm-4gpu-nv4-mlx5-oldformat.txt")
    assert len(t.gpus) == 4 and [n.name for n in t.nics] == ["mlx5_0", "mlx5_1"]
    assert t.gpus[3].cpu_affinity == "0-7,32-39" and t.gpus[3].numa_affinity == "0"
    assert t.nearest_nic["GPU1"] == "mlx5_1"


@pytest.mark.parametrize("name,groups", [
    ("rtxa6000-3gpu-nv4-bridge-pair-ansi.txt", [[0, 1]]),
    ("v100sxm2-pair-nv6-plus-3090-ansi.txt", [[1, 2]]),
    ("pcie-8gpu-all-sys-2numa-no-nic.txt", []),
    ("h100-8gpu-topo-mp-pcie-only-12nic-mlx5.txt", []),  # `topo -mp`: no NV# even on an NVLink box
    ("rtx6000ada-pcie-2gpu-phb-2nic-spaces.txt", []),
])
def test_nvlink_groups_on_bridged_and_pcie_boxes(name, groups):
    assert topo(name).nvlink_groups == groups


def test_ansi_escapes_and_space_alignment():
    t = topo("rtxa6000-3gpu-nv4-bridge-pair-ansi.txt")
    assert t.links["GPU0"]["GPU1"] == "NV4" and t.links["GPU2"]["GPU0"] == "NODE"
    s = topo("hopper-sxm-8gpu-nv18-no-nic-spaces.txt")
    assert s.nics == [] and s.gpus[7].cpu_affinity == "48-95,144-191"


def test_truncated_matrix_names_the_line():
    text = shared_file("topo", "h100-sxm-8gpu-12nic-mlx5-1numa.txt").read_text()
    lines = text.splitlines()
    cut = "\n".join(lines[:5] + [lines[5][:20]])
    with pytest.raises(ParseError) as e:
        parse_topo(cut)
    assert e.value.line_no == 6
    assert "truncated" in str(e.value)


def test_garbage_is_a_parse_error_naming_line_1():
    with pytest.raises(ParseError) as e:
        parse_topo("Failed to initialize NVML: Driver/library version mismatch\n")
    assert e.value.line_no == 1


def test_cli_parse_topo_json_keys():
    p = subprocess.run([sys.executable, "-c", "from launcher.cli import main; main()", "preflight", "parse", "topo",
                        str(shared_file("topo", "h100-sxm-8gpu-12nic-mlx5-1numa.txt")), "--json"],
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert isinstance(d["gpus"], list) and len(d["gpus"]) == 8
    assert isinstance(d["nics"], list) and len(d["nics"]) == 12
    assert d["links"]["GPU0"]["GPU1"] == "NV18"
    assert d["nvlink_groups"] == [[0, 1, 2, 3, 4, 5, 6, 7]]


REAL = shared_texts("topo")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_truncated_and_garbled_real_outputs(data):
    if not REAL:
        absent("third-party topo fixtures absent (set LAUNCH4D_FIXTURES)")
    text = data.draw(st.sampled_from(REAL))
    mode = data.draw(st.sampled_from(["truncate", "garble", "delete_line", "swap"]))
    if mode == "truncate":
        text = text[: data.draw(st.integers(0, len(text)))]
    elif mode == "garble":
        i = data.draw(st.integers(0, len(text) - 1))
        text = text[:i] + data.draw(st.text(min_size=1, max_size=8)) + text[i + 1:]
    elif mode == "delete_line":
        lines = text.splitlines()
        del lines[data.draw(st.integers(0, len(lines) - 1))]
        text = "\n".join(lines)
    else:
        lines = text.splitlines()
        i, j = data.draw(st.integers(0, len(lines) - 1)), data.draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
        text = "\n".join(lines)
    try:
        t = parse_topo(text)
    except ParseError as exc:
        assert exc.line_no is not None and exc.line_no >= 1
        return
    for g in t.gpus:  # whatever parsed must be a consistent matrix
        assert t.links[g.name][g.name] == "X"


@pytest.mark.parametrize("name", TOPO_FILES)
def test_every_cut_inside_the_matrix_is_a_parse_error(name):
    """A matrix cut at any row boundary never parses as a smaller node."""
    lines = shared_file("topo", name).read_text().splitlines()
    n_rows = next(i for i, ln in enumerate(lines[1:], 1) if not ln.strip())  # header + device rows
    for k in range(1, n_rows):
        with pytest.raises(ParseError):
            parse_topo("\n".join(lines[:k]) + "\n")
    assert parse_topo("\n".join(lines[:n_rows]) + "\n").gpus  # the full matrix alone still parses


def test_glued_column_names_in_a_pasted_header():
    """SOURCES.md notes a paste with `NIC8NIC9` glued (vllm#13855); made here from a real capture, header only."""
    text = shared_file("topo", "h100-sxm-8gpu-12nic-mlx5-1numa.txt").read_text()
    header, rest = text.split("\n", 1)
    glued = parse_topo(header.replace("NIC8\tNIC9", "NIC8NIC9") + "\n" + rest)
    assert [n.name for n in glued.nics] == [f"NIC{i}" for i in range(12)]
    assert glued.links == parse_topo(text).links
