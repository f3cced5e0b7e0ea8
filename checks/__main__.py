"""`python -m checks DIR [-o bwmap.json]`: judge a folder of gathered outputs (checks/folder.py) into a
BandwidthMap and print the report; what the Slurm preflight job runs last. Exit 1 when a check failed."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import argparse

    from checks.assemble import assemble, failed_checks
    from checks.folder import load_dir
    from checks.report import render

    ap = argparse.ArgumentParser(prog="python -m checks")
    ap.add_argument("dir")
    ap.add_argument("-o", "--output")
    args = ap.parse_args(argv)
    bw = assemble(load_dir(args.dir))
    if args.output:
        bw.save(args.output)
    print(render(bw))
    return 1 if failed_checks(bw) else 0


if __name__ == "__main__":
    sys.exit(main())
