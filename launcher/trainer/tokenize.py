"""Byte-level tokeniser: a text file -> the trainer's flat token file (`.bin` + `.bin.json` sidecar).

Why bytes: it needs no vocabulary file and no network, every text round-trips exactly, and vocab
256 fits the `tiny` model, so a real corpus can drive `launch run` anywhere.

    python -m launcher.trainer.tokenize input.txt -o data/input.bin [--dtype uint16|uint32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from launcher.errors import UserError

VOCAB = 256
CHUNK = 1 << 24


def tokenize_file(src: str | Path, dst: str | Path, dtype: str = "uint16") -> dict:
    """Write src's bytes as tokens to dst and its sidecar; returns the sidecar. Atomic per file."""
    if dtype not in ("uint16", "uint32"):
        raise UserError(f"--dtype: {dtype!r} is not uint16 or uint32")
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise UserError(f"{src}: no such text file")
    if src.stat().st_size == 0:
        raise UserError(f"{src}: is empty; nothing to tokenise")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    count = 0
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        while chunk := fin.read(CHUNK):
            fout.write(np.frombuffer(chunk, dtype=np.uint8).astype(np.dtype(dtype).newbyteorder("<")).tobytes())
            count += len(chunk)
    os.replace(tmp, dst)
    meta = {"dtype": dtype, "vocab": VOCAB, "tokens": count, "tokenizer": "bytes", "source": str(src)}
    side = Path(str(dst) + ".json")
    side_tmp = side.with_name(side.name + ".tmp")
    side_tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(side_tmp, side)
    return meta


def decode(tokens: np.ndarray) -> str:
    """Inverse of the tokeniser (for samples and tests)."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launcher.trainer.tokenize", description=__doc__.split("\n")[0])
    ap.add_argument("text", help="input text file")
    ap.add_argument("-o", "--output", help="output .bin (default: <text>.bin)")
    ap.add_argument("--dtype", default="uint16", choices=["uint16", "uint32"])
    args = ap.parse_args(argv)
    out = args.output or str(Path(args.text).with_suffix(".bin"))
    try:
        meta = tokenize_file(args.text, out, args.dtype)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{out}: {meta['tokens']} tokens ({meta['dtype']}, vocab {meta['vocab']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
