"""The trainer's token file: `<name>.bin` (a flat little-endian array of uint16 or uint32 tokens) and
its sidecar `<name>.bin.json` `{"dtype": "uint16"|"uint32", "vocab": N, "tokens": N}`.

Written by `python -m launcher.trainer.tokenize`, checked by `launch run` before anything starts and
read (memory-mapped) by every trainer rank. The check lives here, torch- and numpy-free, so the CLI
can refuse a bad file without importing the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

from launcher.errors import UserError

#: bytes per token of each dtype a token file may hold
ITEMSIZE = {"uint16": 2, "uint32": 4}


def sidecar_path(path: str | Path) -> Path:
    return Path(str(path) + ".json")


def check_token_file(path: str | Path, model_vocab: int, seq_len: int) -> dict:
    """The sidecar of a token file, after checking it against the file and the model; UserError if wrong."""
    p = Path(path)
    side = sidecar_path(p)
    if not p.is_file():
        raise UserError(f"train.data: token file {p} does not exist (give a .bin written by "
                        "`python -m launcher.trainer.tokenize`, or 'synthetic')")
    try:
        meta = json.loads(side.read_text())
    except OSError:
        raise UserError(f"train.data: {p} has no sidecar {side} "
                        '(expected {"dtype": "uint16"|"uint32", "vocab": N, "tokens": N})') from None
    except json.JSONDecodeError as exc:
        raise UserError(f"train.data: sidecar {side} is not JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(meta, dict):
        raise UserError(f"train.data: sidecar {side} must be a JSON object")
    dtype = meta.get("dtype")
    if dtype not in ITEMSIZE:
        raise UserError(f"train.data: sidecar {side} dtype {dtype!r} is not one of {', '.join(ITEMSIZE)}")
    for key in ("vocab", "tokens"):
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool) or meta[key] < 1:
            raise UserError(f"train.data: sidecar {side} field {key!r} must be a positive integer, "
                            f"got {meta.get(key)!r}")
    if meta["vocab"] > model_vocab:
        raise UserError(f"train.data: {p} was tokenised with vocab {meta['vocab']} but model.vocab is "
                        f"{model_vocab}; use a model with vocab >= {meta['vocab']}")
    itemsize = ITEMSIZE[dtype]
    size = p.stat().st_size
    if size != meta["tokens"] * itemsize:
        raise UserError(f"train.data: {p} is {size} bytes but its sidecar says {meta['tokens']} {dtype} "
                        f"tokens ({meta['tokens'] * itemsize} bytes); the file is truncated or the sidecar stale")
    if meta["tokens"] < seq_len + 1:
        raise UserError(f"train.data: {p} holds {meta['tokens']} tokens, fewer than one sequence "
                        f"(train.seq_len + 1 = {seq_len + 1})")
    return meta
