"""TokenSource: deterministic global batches whatever the dp split, memmap token files with
validated sidecars, exact resume; and the byte-level tokeniser that writes those files."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from launcher.errors import UserError
from launcher.plan.model import Plan
from launcher.trainer.data import TokenSource
from launcher.trainer.tokenize import decode, tokenize_file
from tests.trainer_helpers import make_plan

pytestmark = pytest.mark.unit


def data_plan(dp: int = 1, micro_batch: int = 2, grad_accum: int = 1, seq_len: int = 16,
              data: str = "synthetic", seed: int = 7, vocab: int = 256, **degrees: Any) -> Plan:
    return make_plan(dp=dp, micro_batch=micro_batch, grad_accum=grad_accum, seq_len=seq_len, data=data,
                     seed=seed, global_batch=micro_batch * grad_accum * dp, model_over={"vocab": vocab},
                     **degrees)


def global_batch(plan: Plan, dp: int, steps: int = 3) -> list[torch.Tensor]:
    sources = [TokenSource(plan, r, dp) for r in range(dp)]
    return [torch.cat([s.next_batch() for s in sources]) for _ in range(steps)]


def test_synthetic_global_batch_identical_for_any_dp_split():
    ref = global_batch(data_plan(dp=1, micro_batch=8), 1)
    for dp, mb, ga in [(2, 4, 1), (4, 1, 2), (8, 1, 1), (2, 2, 2)]:
        got = global_batch(data_plan(dp=dp, micro_batch=mb, grad_accum=ga), dp)
        for a, b in zip(ref, got):
            assert torch.equal(a, b), (dp, mb, ga)


def test_synthetic_shape_dtype_range_and_seed_dependence():
    plan = data_plan(dp=2, micro_batch=3, grad_accum=2, seq_len=32, vocab=100)
    src = TokenSource(plan, 1, 2)
    b = src.next_batch()
    assert b.shape == (6, 33) and b.dtype == torch.long
    assert 0 <= int(b.min()) and int(b.max()) < 100
    assert not torch.equal(b, src.next_batch())  # steps differ
    other = TokenSource(data_plan(dp=2, micro_batch=3, grad_accum=2, seq_len=32, vocab=100, seed=8), 1, 2)
    assert not torch.equal(b, other.next_batch())
    # learnable structure: each row is an arithmetic progression modulo the vocabulary
    d = (b[:, 1:] - b[:, :-1]) % 100
    assert torch.equal(d, d[:, :1].expand_as(d))


def test_resume_continues_exactly():
    plan = data_plan(dp=2, micro_batch=2, grad_accum=2)
    a = TokenSource(plan, 1, 2)
    for _ in range(3):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # survives a plain-dict round trip
    b = TokenSource(plan, 1, 2)
    b.load_state_dict(state)
    assert torch.equal(a.next_batch(), b.next_batch())
    with pytest.raises(UserError, match="seed"):
        TokenSource(data_plan(dp=2, micro_batch=2, grad_accum=2, seed=99), 1, 2).load_state_dict(state)


def test_global_batch_must_match_split():
    plan = data_plan(dp=2, micro_batch=2)
    with pytest.raises(UserError, match="global_batch"):
        TokenSource(plan, 0, 4)


def write_tokens(tmp_path, toks, dtype="uint16", vocab=256, **meta_over):
    path = tmp_path / "toks.bin"
    np.asarray(toks, dtype=dtype if dtype in ("uint16", "uint32") else "uint16").tofile(path)
    meta = {"dtype": dtype, "vocab": vocab, "tokens": len(toks), **meta_over}
    (tmp_path / "toks.bin.json").write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_memmap_windows_in_order_and_wrap(tmp_path, dtype):
    toks = np.arange(1000) % 250
    path = write_tokens(tmp_path, toks, dtype)
    plan = data_plan(dp=2, micro_batch=2, seq_len=10, data=str(path))
    srcs = [TokenSource(plan, r, 2) for r in range(2)]
    n = (1000 - 1) // 10  # 99 windows
    for step in range(30):  # 120 sequences > 99: wraps around
        batch = torch.cat([s.next_batch() for s in srcs])
        for j in range(4):
            k = (step * 4 + j) % n
            assert batch[j].tolist() == toks[k * 10: k * 10 + 11].tolist()


def test_memmap_split_independent_and_resumable(tmp_path):
    path = write_tokens(tmp_path, np.random.default_rng(0).integers(0, 256, 5000))
    ref = global_batch(data_plan(dp=1, micro_batch=4, seq_len=32, data=str(path)), 1, steps=4)
    got = global_batch(data_plan(dp=4, micro_batch=1, seq_len=32, data=str(path)), 4, steps=4)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    plan = data_plan(dp=1, micro_batch=4, seq_len=32, data=str(path))
    a = TokenSource(plan, 0, 1)
    a.next_batch()
    b = TokenSource(plan, 0, 1)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next_batch(), b.next_batch())
    assert a.state_dict()["kind"] == "file" and a.state_dict()["tokens"] == 5000


@pytest.mark.parametrize("over, match", [
    ({"vocab": 300}, "vocab 300 but model.vocab is 256"),
    ({"dtype": "int8"}, "dtype 'int8' is not one of"),
    ({"tokens": 999}, "truncated or the sidecar stale"),
    ({"tokens": "many"}, "'tokens' must be a positive integer"),
])
def test_memmap_sidecar_validation(tmp_path, over, match):
    path = write_tokens(tmp_path, np.arange(1000) % 250, **over)
    with pytest.raises(UserError, match=match):
        TokenSource(data_plan(data=str(path)), 0, 1)


def test_memmap_missing_files_and_short_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        TokenSource(data_plan(data=str(tmp_path / "nope.bin")), 0, 1)
    (tmp_path / "raw.bin").write_bytes(b"\0\0" * 100)
    with pytest.raises(UserError, match="no sidecar"):
        TokenSource(data_plan(data=str(tmp_path / "raw.bin")), 0, 1)
    path = write_tokens(tmp_path, np.arange(10))
    with pytest.raises(UserError, match="fewer than one sequence"):
        TokenSource(data_plan(seq_len=16, data=str(path)), 0, 1)


def test_memmap_token_beyond_model_vocab_is_caught(tmp_path):
    path = write_tokens(tmp_path, np.full(200, 255), vocab=100)  # sidecar lies about vocab
    src = TokenSource(data_plan(seq_len=16, data=str(path), vocab=128), 0, 1)
    with pytest.raises(UserError, match="token id 255 >= model.vocab 128"):
        src.next_batch()


def test_tokeniser_round_trip_and_cli(tmp_path):
    text = "héllo, wörld\n" * 50
    src = tmp_path / "corpus.txt"
    src.write_text(text, encoding="utf-8")
    meta = tokenize_file(src, tmp_path / "out" / "c.bin")
    assert meta["tokens"] == len(text.encode()) and meta["vocab"] == 256
    arr = np.fromfile(tmp_path / "out" / "c.bin", dtype="<u2")
    assert decode(arr) == text
    r = subprocess.run([sys.executable, "-m", "launcher.trainer.tokenize", str(src), "-o", str(tmp_path / "d.bin"),
                        "--dtype", "uint32"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    side = json.loads((tmp_path / "d.bin.json").read_text())
    assert side["dtype"] == "uint32" and side["tokens"] == meta["tokens"]
    # the file it wrote is readable by the trainer's data path
    src_ = TokenSource(data_plan(seq_len=32, data=str(tmp_path / "d.bin")), 0, 1)
    assert decode(src_.next_batch()[0, :5].numpy()) == text.encode()[:5].decode(errors="replace")
    bad = subprocess.run([sys.executable, "-m", "launcher.trainer.tokenize", str(tmp_path / "missing.txt")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error:")
