"""Preflight: probe nodes (nvidia-smi topo, nccl-tests, health), judge them, write a BandwidthMap.

    parsers/      pure text -> dataclass parsers, one per tool (ParseError names the line)
    probe.py      the node-local commands and their file names; `python -m checks.probe --out DIR`
    hosts.py      host lists: hostlist expressions, files, the Slurm allocation
    runners/      how commands reach hosts: local, ssh (launcher.transport), srun, slurm_job (sbatch), k8s
    orchestrate   phases: every node alone, node pairs in rounds, all healthy nodes
    judges.py     pass / warn / fail against per-GPU-model thresholds and the cluster's median
    assemble.py   results -> BandwidthMap (bwmap.py); load_dir/save_dir for the import layout
    report.py     the human report

Never imports `launcher` (dependencies run launcher -> checks); paramiko, kubernetes and jinja2
are imported only where a backend needs them.
"""
