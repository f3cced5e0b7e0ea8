"""The EP cost uses the all-to-all bandwidth preflight measured (`--level long`), else half the
all-reduce figure: the same plan costed both ways, and a bandwidth map carrying the figures."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.formats.bwmap import BandwidthMap, NodeReport
from launcher.plan.costs import advertised_bandwidth, estimate
from launcher.plan.ledger import Layout
from launcher.plan.planner import cluster_from
from launcher.plan.spec import TrainSpec, resolve_gpu, resolve_model, spec_from_dict

pytestmark = pytest.mark.unit


def ep_time(bw, ep: int, dp: int) -> float:
    model = resolve_model("mixtral-8x7b")
    lay = Layout(tp=1, cp=1, pp=1, dp=dp, ep=ep, zero=1, recompute="selective", micro_batch=1, grad_accum=1,
                 virtual_stages=1, schedule="none")
    return estimate(model, TrainSpec(seq_len=4096, global_batch=dp), resolve_gpu("h100-sxm"), lay, bw, 8).ep_comm_s


def test_measured_all_to_all_replaces_half_the_all_reduce_figure():
    adv = advertised_bandwidth(resolve_gpu("h100-sxm"))
    intra_guess = ep_time(adv, ep=8, dp=8)
    measured = dataclasses.replace(adv, alltoall_intra_gbs=adv.intra_gbs / 4)      # slower than the guess
    assert ep_time(measured, ep=8, dp=8) == pytest.approx(intra_guess * 2)
    # an EP group spanning nodes uses the inter-node figure, not the intra-node one
    across = dataclasses.replace(adv, alltoall_intra_gbs=1e6, alltoall_inter_gbs=13.51)
    spanning = ep_time(across, ep=16, dp=16)
    assert spanning > ep_time(adv, ep=16, dp=16) and spanning == pytest.approx(
        ep_time(dataclasses.replace(adv, alltoall_inter_gbs=13.51 * 2), ep=16, dp=16) * 2)


def test_a_map_with_all_to_all_reaches_the_planner():
    spec = spec_from_dict({"model": "mixtral-8x7b", "train": {"seq_len": 4096, "global_batch": 64, "steps": 1},
                           "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-sxm"}})
    bw = BandwidthMap(nodes={h: NodeReport(host=h, gpus=8) for h in ("a", "b")}, intra_node_busbw_gbs=480.0,
                      inter_node_busbw_gbs=340.0, alltoall_intra_busbw_gbs=350.0, alltoall_inter_busbw_gbs=13.51)
    c = cluster_from(spec, bw, "bw.json")
    assert (c.bandwidth.alltoall_intra_gbs, c.bandwidth.alltoall_inter_gbs) == (350.0, 13.51)
    assert "all-to-all intra 350.0 GB/s, inter 13.5 GB/s" in c.bandwidth.source
    plain = cluster_from(spec, dataclasses.replace(bw, alltoall_intra_busbw_gbs=None, alltoall_inter_busbw_gbs=None),
                         "bw.json")
    assert plain.bandwidth.alltoall_intra_gbs is None and "all-to-all" not in plain.bandwidth.source


def test_per_nic_rdma_sets_the_network_figure_where_no_nccl_figure_was_measured():
    """`--level long` measures ib_write_bw per NIC (Gb/s); without an inter-node NCCL figure, the slowest
    node's NICs summed and shared over its GPUs become the per-GPU network bandwidth."""
    spec = spec_from_dict({"model": "llama3-8b", "train": {"seq_len": 4096, "global_batch": 64, "steps": 1},
                           "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-sxm"}})
    nics = {f"mlx5_{i}": 392.34 for i in range(8)}                      # 8 x 400 Gb/s, one node healthy
    slow = {**nics, "mlx5_1": 10.5}                                     # the degraded GPUDirect path
    bw = BandwidthMap(nodes={"a": NodeReport(host="a", gpus=8, rdma_gbps=nics),
                             "b": NodeReport(host="b", gpus=8, rdma_gbps=slow)}, intra_node_busbw_gbs=480.0)
    c = cluster_from(spec, bw, "bw.json")
    assert c.bandwidth.net_per_gpu_gbs == pytest.approx((7 * 392.34 + 10.5) / 8 / 8)
    assert "per-NIC GPUDirect RDMA" in c.bandwidth.source
    # a measured NCCL inter-node figure is the end-to-end one and wins
    measured = cluster_from(spec, dataclasses.replace(bw, inter_node_busbw_gbs=340.0), "bw.json")
    assert measured.bandwidth.net_per_gpu_gbs == pytest.approx(340.0 / 8)
    # a node without RDMA figures: not measured, the advertised figure stays
    partial = dataclasses.replace(bw, nodes={**bw.nodes, "b": NodeReport(host="b", gpus=8)})
    assert cluster_from(spec, partial, "bw.json").bandwidth.net_per_gpu_gbs == pytest.approx(
        advertised_bandwidth(spec.gpu).net_per_gpu_gbs)
