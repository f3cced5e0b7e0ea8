"""Judges: what the parsers read, turned into pass / warn / fail with the figure, the threshold it was held
to and where that threshold comes from. One verdict type, finding.Finding, and one `worst`.

    finding.py      Finding, worst, merge, fold (per-GPU/link/NIC findings -> one verdict per node and check)
    config.py       JudgeConfig: per-GPU-model thresholds, outlier fractions, margins (a file or flags)
    figures.py      a figure against a threshold (at_least) or its peers (outliers, mode)
    hardware.py     the quick probes per node: GPU count/model/driver, topology, NVLink, ECC, PCIe, clocks,
                    Xids, IB ports, against what most nodes have
    nccl.py         nccl-tests per node and per node pair
    dcgm.py, nvlink.py, nvbandwidth.py, perftest.py, memory.py, xid.py, ibstat.py
                    one tool each: findings per GPU, link or NIC, with what to do about a failure
    deep.py         the standard and long levels' outputs judged and folded, the all-to-all runs
    kinds.py        the judges for one parsed output by KIND (`launch preflight parse`)

Pure functions over parsed data: assembly (checks/assemble.py) calls them on what a preflight gathered.
"""
