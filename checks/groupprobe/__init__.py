"""The plan's own communication groups, measured on the nodes it was given (`launch preflight --plan`,
`launch submit --preflight-plan`).

    worker.py   `python -m checks.groupprobe.worker SPEC`: one process per rank under torchrun; runs
                every group's collective at the plan's message size (all groups of one kind at once)
                with torch.distributed (NCCL on GPUs, gloo on CPUs) and, on rank 0, writes the times
    verdict.py  `python -m checks.groupprobe.verdict RESULT --hosts ...`: the job gate's answer, one
                `launch4d-check HOST ok|FAIL why` line per allocated node (what the node check prints)
    launch.py   how the worker is started: this machine, or over SSH on each node

The spec and the results are one file, launcher/formats/groupprobe.py (preflight-plan.json): the
command that knows the plan writes the groups and what the time model assumed; this package knows
only that file.
"""
