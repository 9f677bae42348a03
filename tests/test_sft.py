"""Supervised fine-tuning (algo.loss_type=sft_loss): the loss, the dataset (text and chat rows, bad rows,
epochs), the config, and whole runs (loss falls, the export loads, kill and resume bit-identically)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from pipeline.algo.losses import reduction_scale, sft_loss
from pipeline.config import load_config
from pipeline.config.schema import DataConfig
from pipeline.errors import ConfigError, UserError
from pipeline.models.hf_io import read_state_dict
from pipeline.models.logprobs import token_logprobs
from pipeline.models.tokenizer import build_tiny_tokenizer
from pipeline.observability.metrics import read_metrics
from pipeline.rollout.sft_data import SftDataset
from pipeline.run import RunDir

from conftest import REPO, wait_until
from test_e2e import lockstep, procs_of


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def write_rows(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def dataset(tok, path, max_len=16, **data) -> SftDataset:
    return SftDataset(DataConfig(prompt_data=str(path), **data), tok, seed=7, max_len=max_len)


# ---- the loss -------------------------------------------------------------------------------------------------

def test_sft_loss_is_the_token_mean_nll():
    logp = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    scale = reduction_scale(mask, torch.zeros(4, dtype=torch.long), torch.tensor([3.0]), "token_mean", 3.0, 1.0, 4)
    loss, m = sft_loss(logp, mask, scale)
    assert loss.item() == pytest.approx((1 + 3 + 4) / 3)
    assert m["sft_nll_sum"].item() == pytest.approx(8.0)


def test_masked_tokens_get_exactly_zero_gradient():
    """Logits at masked positions (prompt tokens, user turns) get a gradient of exactly 0, and changing
    their targets changes neither the loss nor any gradient, bit for bit (a NaN there leaks nothing)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 60, generator=g)
    targets = torch.randint(0, 60, (10,), generator=g)
    mask = torch.tensor([0, 0, 0, 1, 1, 0, 0, 1, 1, 1], dtype=torch.float32)
    sample_of = torch.zeros(10, dtype=torch.long)

    def grad(tgt, poison=False):
        x = logits.clone().requires_grad_(True)
        logp = token_logprobs(x, tgt, 1.0)
        if poison:  # a non-finite logprob at a masked position
            logp = torch.where(mask > 0, logp, torch.full_like(logp, float("nan")))
        scale = reduction_scale(mask, sample_of, mask.sum().view(1), "token_mean", float(mask.sum()), 1.0, 10)
        loss, _ = sft_loss(logp, mask, scale)
        loss.backward()
        return loss.detach(), x.grad

    loss, g1 = grad(targets)
    assert torch.all(g1[mask == 0] == 0) and torch.all(g1[mask == 1].abs().sum(-1) > 0)
    other = torch.where(mask > 0, targets, (targets + 17) % 60)
    loss2, g2 = grad(other)
    assert torch.equal(loss, loss2) and torch.equal(g1, g2)
    loss3, g3 = grad(targets, poison=True)
    assert torch.equal(loss, loss3) and torch.equal(g1, g3)


# ---- the dataset ----------------------------------------------------------------------------------------------

def test_text_rows_train_on_the_response_and_end_of_text(tok, tmp_path):
    ds = dataset(tok, write_rows(tmp_path / "d.jsonl", [{"prompt": "3+4=", "response": "7"}]))
    (ex,) = ds.prompts
    assert ex.prompt_ids == tok.encode("3+4=") and ex.response_ids == tok.encode("7") + [tok.eos_token_id]
    assert ex.loss_mask == [1, 1]
    batch = ds.batch_at(0, 3)  # the stream wraps around epochs
    assert len(batch) == 3 and batch.prompt_len.tolist() == [4] * 3 and batch.response_len.tolist() == [2] * 3
    assert batch.loss_mask.tolist() == [1] * 6 and not batch.logprobs.any()


def test_response_key_can_name_another_field(tok, tmp_path):
    rows = [{"prompt": "3+4=", "label": "7"}]
    ds = dataset(tok, write_rows(tmp_path / "d.jsonl", rows), response_key="label")
    assert ds.prompts[0].response_ids == tok.encode("7") + [tok.eos_token_id]


def test_chat_rows_train_on_assistant_turns_only(tok, tmp_path):
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="},
                {"role": "assistant", "content": "3"}, {"role": "user", "content": "2+2="},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "unanswered"}]
    path = write_rows(tmp_path / "c.jsonl", [{"messages": messages},
                                             {"messages": messages[:2], "response": "3"}])
    ds = dataset(tok, path, max_len=200, input_key="messages")
    multi, single = ds.prompts
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert decode(multi.prompt_ids) == "<|im_start|>system\nadd<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    targets = [t for t, m in zip(multi.response_ids, multi.loss_mask) if m]
    masked = [t for t, m in zip(multi.response_ids, multi.loss_mask) if not m]
    assert decode(targets) == "3<|im_end|>\n4<|im_end|>\n"  # both assistant turns, each with its end of turn
    assert decode(masked) == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"  # the user turn between
    assert "unanswered" not in decode(multi.prompt_ids + multi.response_ids)  # nothing after the last answer
    # a chat prompt with a response field: the response is the assistant turn
    assert single.prompt_ids == multi.prompt_ids and decode(single.response_ids) == "3<|im_end|>\n"
    assert single.loss_mask == [1] * len(single.response_ids)


def test_bad_rows_are_skipped_per_reason_or_refused_in_one_line(tok, tmp_path):
    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "1+1="}, {"prompt": "1+1=", "response": ""},
            {"prompt": "1+1=", "response": "2" * 20}, "{not json", {"prompt": "1+1=", "response": 2},
            {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "1+1=", "response": "2"}]
    path = write_rows(tmp_path / "bad.jsonl", rows)
    ds = dataset(tok, path)
    assert len(ds) == 2
    assert ds.stats.skipped == {
        "no 'response' field (nor chat messages with assistant turns)": 1, "empty response": 1,
        "prompt+response longer than data.max_prompt_len + rollout.rollout_max_response_len (16 tokens)": 1,
        "invalid JSON": 1, "'response' is not text": 1, "no 'prompt' field": 1}
    assert "skipped 6" in ds.stats.report() and "line 2" in ds.stats.report()
    with pytest.raises(UserError, match=r"bad.jsonl:2: no 'response' field"):
        dataset(tok, path, on_bad_row="error")
    with pytest.raises(UserError, match="no usable rows"):
        dataset(tok, write_rows(tmp_path / "none.jsonl", [{"prompt": "1+1="}]))
    chat = write_rows(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(UserError, match="chat messages without an assistant turn"):
        dataset(tok, chat, on_bad_row="error")


def test_epochs_cover_every_row_once_in_a_seeded_order(tok, tmp_path):
    path = write_rows(tmp_path / "d.jsonl", [{"prompt": f"{i}+0=", "response": str(i)} for i in range(10)])
    ds = dataset(tok, path)
    rows = ds.batch_at(0, 30).prompt_idx.tolist()
    for e in range(3):
        assert sorted(rows[10 * e: 10 * e + 10]) == list(range(10))
    assert rows[:10] != rows[10:20] and rows[:10] != list(range(10))  # reshuffled every epoch
    assert ds.batch_at(13, 4).prompt_idx.tolist() == rows[13:17]  # a pure function of the cursor
    other = SftDataset(DataConfig(prompt_data=path), tok, seed=8, max_len=16)
    assert other.batch_at(0, 10).prompt_idx.tolist() != rows[:10]
    plain = dataset(tok, path, rollout_shuffle=False)
    assert plain.batch_at(5, 10).prompt_idx.tolist() == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]


# ---- the config -----------------------------------------------------------------------------------------------

def test_sft_config_counts_rows_and_refuses_what_it_would_ignore():
    cfg = load_config("configs/sft-tiny.yaml", [])
    assert cfg.sft and cfg.samples_per_step == cfg.rollout.rollout_batch_size
    assert load_config("configs/sft-tiny.yaml", ["rollout_batch_size=12", "global_batch_size=4"]).optimizer_steps_per_rollout == 3
    with pytest.raises(ConfigError, match=r"rollout_batch_size \(16\) rows per SFT step must be divisible"):
        load_config("configs/sft-tiny.yaml", ["global_batch_size=5"])
    with pytest.raises(ConfigError, match="rollout_temperature"):
        load_config("configs/sft-tiny.yaml", ["rollout.rollout_temperature=0.7"])
    with pytest.raises(ConfigError, match="algo.kl_loss_coef=0"):
        load_config("configs/sft-tiny.yaml", ["algo.kl_loss_coef=0.1"])
    with pytest.raises(ConfigError, match="routing_replay=false"):
        load_config("configs/sft-tiny.yaml", ["determinism.routing_replay=true"])
    with pytest.raises(ConfigError, match="runs no engines to evaluate on"):
        load_config("configs/sft-tiny.yaml", ["eval.interval=5", "eval.datasets.test=data/arith/test.jsonl"])
    # RL's group estimator needs several samples per prompt; SFT has one row per sample
    assert load_config("configs/sft-tiny.yaml", ["rollout.n_samples_per_prompt=1"]).sft


# ---- whole runs -----------------------------------------------------------------------------------------------

def chat_file(path) -> str:
    from pipeline.rollout.tasks import arith_rows

    rows = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["label"]}]}
            for r in arith_rows()]
    return write_rows(path, rows)


def response_nll(model_dir: str, tok, ds: SftDataset) -> float:
    """Mean NLL of the response targets under a Hugging Face model loaded by transformers."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for ex in ds.prompts:
            ids = torch.tensor([ex.prompt_ids + ex.response_ids])
            logp = torch.log_softmax(hf(ids).logits[0, len(ex.prompt_ids) - 1:-1], -1)
            picked = logp[torch.arange(len(ex.response_ids)), torch.tensor(ex.response_ids)]
            total -= float((picked * torch.tensor(ex.loss_mask, dtype=torch.float32)).sum())
            n += sum(ex.loss_mask)
    return total / n


def test_sft_run_on_chat_rows_learns_without_engines(tmp_path, tok):
    """A short SFT run on chat rows: trainer only, train/sft_loss falls, the summary says so, and the
    export loads with transformers and gives the trained responses a lower NLL than the start did."""
    pytest.importorskip("transformers")
    data = chat_file(tmp_path / "chat.jsonl")
    run_dir = tmp_path / "run"
    res = lockstep("run", "configs/sft-tiny.yaml", f"run_dir={run_dir}", f"data.prompt_data={data}",
                   "data.input_key=messages", "rollout.rollout_max_response_len=16", "data.max_prompt_len=32",
                   "num_rollout=25", "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == list(range(25))
    first, last = np.mean([r["train/sft_loss"] for r in records[:3]]), np.mean([r["train/sft_loss"] for r in records[-3:]])
    assert last < 0.6 * first, (first, last)
    r = records[-1]
    assert "rollout/reward_mean" not in r and "train/rollout_logprob_abs_diff" not in r and "train/pg_loss" not in r
    assert r["train/tokens"] > 0 and r["data/epoch"] == pytest.approx(25 * 16 / 55)
    assert "sft loss" in res.stdout and "\nreward " not in res.stdout
    assert sorted(os.listdir(RunDir(run_dir).logs)) == ["trainer_0.log"]  # no engine, no rollout manager
    ds = SftDataset(DataConfig(prompt_data=data, input_key="messages"), tok, seed=0, max_len=48)
    assert response_nll(RunDir(run_dir).hf_export, tok, ds) < 0.7 * response_nll(RunDir(run_dir).model_init, tok, ds)


@pytest.mark.slow
def test_sft_kill_and_resume_mid_epoch_is_bit_identical(tmp_path):
    """A run SIGKILLed inside a checkpoint save (after the step-4 one, mid-epoch: row 64 is the 20th of the second pass over 44) and
    rerun resumes from the data cursor and ends with the same weights and losses as an uninterrupted run."""
    common = ["num_rollout=10", "checkpoint.save_interval=2", "logging.plot=false", "--no-progress"]
    res = lockstep("run", "configs/sft-tiny.yaml", f"run_dir={tmp_path}/a", *common)
    assert res.returncode == 0, res.stderr[-3000:]
    c = RunDir(tmp_path / "c")
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *["run", "configs/sft-tiny.yaml", f"run_dir={c.root}",
                          *common]], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=dict(os.environ, LOCKSTEP_FAULTS="slow_checkpoint=6:60"))
    assert wait_until(lambda: os.path.exists(os.path.join(c.checkpoints, ".step_000006.tmp")), 120)
    state = json.load(open(os.path.join(c.checkpoints, "step_000004", "trainer_state.json")))
    assert state["data"] == {"cursor": 64, "rows": 44}  # data/arith/train.jsonl: 44 sums
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert wait_until(lambda: not procs_of(c.root), 30)
    assert not os.path.exists(c.hf_export)
    res = lockstep("run", "configs/sft-tiny.yaml", f"run_dir={c.root}", *common)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from checkpoint step 4" in open(c.log_file("trainer_0")).read()
    a, got = read_state_dict(RunDir(tmp_path / "a").hf_export), read_state_dict(c.hf_export)
    assert all(torch.equal(a[k], got[k]) for k in a)
    ra, rc = read_metrics(f"{tmp_path}/a"), read_metrics(c.root)
    assert [r["step"] for r in rc] == list(range(10))
    assert [r["train/sft_loss"] for r in ra] == [r["train/sft_loss"] for r in rc]
