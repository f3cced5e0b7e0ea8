"""Preflight: probe nodes (nvidia-smi topo, nccl-tests, health), judge them, write a BandwidthMap.

    parsers/      pure text -> dataclass parsers, one per tool (ParseError names the line)
    probe.py      the node-local commands and their file names; `python -m checks.probe --out DIR`
    hosts.py      host lists: hostlist expressions, files, the Slurm allocation
    runners/      how commands reach hosts: local, ssh (launcher.transport), srun, slurm_job (sbatch), k8s
    pairing.py    nccl-tests options and the schedules of node pairs (plain data; runners use it too)
    orchestrate   phases: every node alone, node pairs in rounds, all healthy nodes
    levels.py     what each level (quick, standard, long) runs beyond the probes, and its timeouts
    parsed.py     which parser reads which output, each output parsed once (NodeData)
    judges.py     pass / warn / fail against per-GPU-model thresholds and the cluster's median:
                  hardware (gpu_count ... ib), intra-node and pair bandwidth; health_judges.py the
                  deeper levels' tools, level_checks.py their CheckResults
    assemble.py   results -> BandwidthMap (launcher/formats/bwmap.py)
    folder.py     the folder layout of gathered outputs (load_dir / save_dir, `launch preflight import`);
                  level_runs.py the deeper levels' part of it
    report.py     the human report
    __main__.py   `python -m checks DIR -o bwmap.json` (the last step of the Slurm preflight job)

Imports only launcher.formats, launcher.transport and launcher.errors of launch4d (what it shares with
the planner, diagnose and render lives in formats; the command layer hands in the Kubernetes backend and
the template renderer); paramiko and kubernetes are imported only where a runner needs them.
"""
