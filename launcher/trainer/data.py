"""Training tokens for one data-parallel rank: synthetic from a seed, or a memory-mapped token file.

Why this shape: every optimizer step consumes `global_batch` sequences of `seq_len + 1` tokens
(inputs plus the shifted labels). Row j of step t is a pure function of (seed or file, t, j), so the
global batch is the same whatever the dp split, and each dp rank takes its contiguous slice of
rows. That makes loss parity across layouts and exact resume (the state is just the step counter)
fall out for free. TP/CP/PP ranks of one dp rank receive the same rows; they split them later.

Token file format (written by `python -m launcher.trainer.tokenize`): a flat little-endian array
of uint16 or uint32 tokens in `<name>.bin`, and a sidecar `<name>.bin.json`
`{"dtype": "uint16", "vocab": 256, "tokens": N}`. Sequence k of the file is tokens
[k·seq_len, k·seq_len + seq_len + 1) (consecutive windows sharing one boundary token), read in
order and wrapping around at the end of the file (an epoch).

Synthetic rows are learnable on purpose (an arithmetic progression modulo the vocabulary with a
random start and stride), so a demo's loss visibly falls; the seed alone decides them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from launcher.errors import UserError
from launcher.formats.tokens import check_token_file
from launcher.plan.model import Plan

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
MAX_SYNTHETIC_STRIDE = 16


def read_token_file(path: str | Path, model_vocab: int, seq_len: int) -> tuple[np.memmap, dict]:
    """Open a token file read-only after checking its sidecar against the model (launcher.formats.tokens)."""
    meta = check_token_file(path, model_vocab, seq_len)
    return np.memmap(Path(path), dtype=DTYPES[meta["dtype"]], mode="r"), meta


def _mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps), so nearby (seed, step, row) do not correlate."""
    x = 0x9E3779B97F4A7C15
    for v in parts:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


def synthetic_row(seed: int, step: int, row: int, seq_len: int, vocab: int) -> torch.Tensor:
    """Row `row` of global step `step`: (start + stride·i) mod vocab, start/stride drawn from the seed."""
    g = torch.Generator().manual_seed(_mix(seed, step, row))
    start = int(torch.randint(0, vocab, (1,), generator=g))
    stride = int(torch.randint(1, min(MAX_SYNTHETIC_STRIDE, max(vocab - 1, 1)) + 1, (1,), generator=g))
    return (start + stride * torch.arange(seq_len + 1, dtype=torch.long)) % vocab


class TokenSource:
    """This dp rank's share of each step's global batch, in step order, resumable.

    `plan` is the launcher.plan.model.Plan the trainer runs.
    """

    def __init__(self, plan: Plan, dp_rank: int, dp_size: int):
        train = plan.train
        self.seq_len = train.seq_len
        self.global_batch = train.global_batch
        self.seed = train.seed
        self.vocab = plan.model.vocab
        self.data = train.data
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside dp_size {dp_size}")
        self.rows = plan.micro_batch * plan.grad_accum
        if self.rows * dp_size != self.global_batch:
            raise UserError(f"train.global_batch: {self.global_batch} sequences per step, but micro_batch "
                            f"{plan.micro_batch} × grad_accum {plan.grad_accum} × dp {dp_size} = "
                            f"{self.rows * dp_size}")
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.first_row = dp_rank * self.rows
        self.step = 0  # global batches consumed so far
        self.tokens: np.memmap | None = None
        self.meta: dict = {}
        if self.data != "synthetic":
            self.tokens, self.meta = read_token_file(self.data, self.vocab, self.seq_len)
            self.num_sequences = (len(self.tokens) - 1) // self.seq_len

    @property
    def kind(self) -> str:
        return "synthetic" if self.tokens is None else "file"

    def batch_at(self, step: int) -> torch.Tensor:
        """This rank's rows of global step `step` (0-based), shape [rows, seq_len + 1], int64."""
        rows = range(self.first_row, self.first_row + self.rows)
        if self.tokens is None:
            return torch.stack([synthetic_row(self.seed, step, j, self.seq_len, self.vocab) for j in rows])
        out = np.empty((self.rows, self.seq_len + 1), dtype=np.int64)
        for i, j in enumerate(rows):
            k = (step * self.global_batch + j) % self.num_sequences
            out[i] = self.tokens[k * self.seq_len: k * self.seq_len + self.seq_len + 1]
        batch = torch.from_numpy(out)
        top = int(batch.max())
        if top >= self.vocab:
            raise UserError(f"train.data: {self.data} holds token id {top} >= model.vocab {self.vocab} "
                            f"(near sequence {(step * self.global_batch + self.first_row) % self.num_sequences})")
        return batch

    def next_batch(self) -> torch.Tensor:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        state = {"kind": self.kind, "step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                 "global_batch": self.global_batch}
        if self.tokens is not None:
            state.update(path=self.data, tokens=int(self.meta["tokens"]))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue where the checkpointed run stopped; refuse a state from different data."""
        mine = self.state_dict()
        for key in ("kind", "seed", "seq_len", "global_batch", "tokens"):
            if key in state and key in mine and state[key] != mine[key]:
                raise UserError(f"resume: checkpoint data {key}={state[key]!r} but this run has {mine[key]!r}; "
                                "resume with the same train.data, seed, seq_len and global_batch")
        self.step = int(state["step"])
