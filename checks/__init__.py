"""Preflight: probe nodes (nvidia-smi topo, nccl-tests, health), judge them, write a BandwidthMap.

By stage, probe -> run -> parse -> judge -> assemble:

  probe     probe.py      the node-local commands and their file names; `python -m checks.probe --out DIR`
            levels.py     what each level (quick, standard, long) runs beyond the probes, and its timeouts
  run       hosts.py      host lists: hostlist expressions, files, the Slurm allocation
            pairing.py    nccl-tests options and the schedules of node pairs (plain data; runners use it too)
            runners/      how commands reach hosts: local, ssh (launcher.transport), srun, slurm_job (sbatch), k8s
            orchestrate   phases: every node alone, node pairs in rounds, all healthy nodes
            slurm_pairs   the node-pair phase inside the Slurm preflight job
            results.py    what running produced (NcclRun, PreflightResults; a command's result is launcher.transport's Completed)
            folder.py     that, saved and read back as a folder (load_dir / save_dir, `launch preflight import`);
                          level_runs.py the deeper levels' part of it
  parse     parsers/      pure text -> dataclass parsers, one per tool (ParseError names the line)
            parsed.py     which parser reads which output, each output parsed once (NodeData)
  judge     judges/       one Finding type: pass / warn / fail per GPU, link, NIC or node against
                          per-GPU-model thresholds and the cluster's median, folded to one verdict per check
  assemble  assemble.py   verdicts -> BandwidthMap (launcher/formats/bwmap.py)
  after     report.py     the human report;  drain.py  the commands that take failed nodes out of service
            __main__.py   `python -m checks DIR -o bwmap.json` (the last step of the Slurm preflight job)
            groupprobe/   the plan's own communication groups measured (`launch preflight --plan`)

Imports only launcher.formats, launcher.transport and launcher.errors of launch4d (what it shares with
the planner, diagnose and render lives in formats; the command layer hands in the Kubernetes backend and
the template renderer); paramiko and kubernetes are imported only where a runner needs them.
"""
