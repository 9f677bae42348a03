"""What users bring, answered before anything starts (issue 22): messy prompt files, chat-message
prompts, chat templates where transformers 5 saves them, checkpoint directories without weights, and
configs that would train on nothing."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from conftest import make_model_dir
from test_e2e import lockstep
from pipeline.config.schema import DataConfig
from pipeline.errors import UserError
from pipeline.models.tokenizer import build_tiny_tokenizer, load_tokenizer
from pipeline.rollout.data import PromptDataset


def write_rows(path, rows, bom=False):
    text = "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return str(path)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path, tok):
    path = write_rows(tmp_path / "bom.jsonl", [{"prompt": "1+2=", "label": "3"}], bom=True)
    ds = PromptDataset(DataConfig(prompt_data=path), tok, seed=0)
    assert ds.stats.kept == 1 and ds.prompts[0].label == "3"


def test_nested_keys_and_chat_message_prompts(tmp_path, tok):
    rows = [{"q": {"text": "1+2="}, "a": {"v": "3"}},
            {"q": {"text": [{"role": "user", "content": "2+2="}]}, "a": {"v": "4"}}]
    ds = PromptDataset(DataConfig(prompt_data=write_rows(tmp_path / "n.jsonl", rows), input_key="q.text",
                                  label_key="a.v"), tok, seed=0)
    assert [p.label for p in ds.prompts] == ["3", "4"]
    assert ds.prompts[0].text == "1+2="  # plain text stays as written
    assert ds.prompts[1].text == tok.apply_chat_template([{"role": "user", "content": "2+2="}])  # messages: templated


def test_skipped_rows_are_counted_per_reason_with_their_lines(tmp_path, tok):
    rows = [{"prompt": "1+2=", "label": "3"}, "{not json", {"label": "no prompt"}, "[1]", {"prompt": 7},
            {"prompt": "9" * 500}, {"label": "again no prompt"}]
    ds = PromptDataset(DataConfig(prompt_data=write_rows(tmp_path / "bad.jsonl", rows), max_prompt_len=64), tok, seed=0)
    assert ds.stats.kept == 1 and ds.stats.rows == 7
    assert ds.stats.skipped == {"invalid JSON": 1, "no 'prompt' field": 2, "row is not a JSON object": 1,
                                "'prompt' is neither text nor a list of chat messages": 1,
                                "prompt longer than data.max_prompt_len (64 tokens)": 1}
    report = ds.stats.report()
    assert report.startswith("data: 1 of 7 rows of ") and "no 'prompt' field (2: lines 3, 7)" in report


def test_chat_messages_without_a_template_are_a_reason_not_a_silent_skip(tmp_path):
    d = tmp_path / "tok"
    build_tiny_tokenizer(str(d))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    rows = [{"prompt": [{"role": "user", "content": "1+2="}]}, {"prompt": "1+2="}]
    ds = PromptDataset(DataConfig(prompt_data=write_rows(tmp_path / "c.jsonl", rows)), load_tokenizer(str(d)), seed=0)
    assert ds.stats.skipped == {"chat messages, but the tokenizer has no chat template": 1}


def test_chat_template_jinja_is_read_and_written_back(tmp_path):
    """transformers 5 saves the template only to chat_template.jinja."""
    model = make_model_dir(str(tmp_path / "m"), "tiny-dense")
    cfg = json.loads(open(os.path.join(model, "tokenizer_config.json")).read())
    template = cfg.pop("chat_template").replace("<|im_start|>", "<|im_start|> ")
    with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(model, "chat_template.jinja"), "w") as f:
        f.write(template)
    assert load_tokenizer(model).chat_template == template
    res = lockstep("run", "configs/tiny.yaml", f"model.path={model}", f"run_dir={tmp_path}/run", "num_rollout=1",
                   "rollout_batch_size=8", "global_batch_size=128", "data.apply_chat_template=true",
                   "logging.plot=false", "--no-progress")
    assert res.returncode == 0, res.stderr[-2000:]
    assert open(tmp_path / "run" / "hf" / "chat_template.jinja").read() == template


def refused(*overrides):
    res = lockstep("run", "configs/tiny.yaml", *overrides, "--no-progress", timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("lockstep: error:")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_bad_rows_in_error_mode_stop_before_anything_starts(tmp_path):
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "1+2=", "label": "3"}, "{oops"])
    line = refused(f"run_dir={tmp_path}/run", f"data.prompt_data={data}", "data.on_bad_row=error")
    assert line.endswith("d.jsonl:2: invalid JSON (set data.on_bad_row=skip to skip such rows)")
    assert not os.path.exists(tmp_path / "run")  # nothing was started or written


def test_checkpoints_and_configs_that_cannot_train_are_refused_in_one_line(tmp_path):
    model = make_model_dir(str(tmp_path / "m"), "tiny-dense")
    empty = tmp_path / "no-weights"
    shutil.copytree(model, empty)
    for name in os.listdir(empty):
        if name.endswith(".safetensors"):
            os.unlink(empty / name)
    assert "has no *.safetensors weights" in refused(f"model.path={empty}", f"run_dir={tmp_path}/a")
    assert "model.path is empty" in refused("model.path=", f"run_dir={tmp_path}/b")
    assert "n_samples_per_prompt=1 leaves none" in refused("rollout.n_samples_per_prompt=1", "global_batch_size=32",
                                                           f"run_dir={tmp_path}/c")
    # a model of 10 rows (config.json and weights agree) with a tokenizer of more: its ids would index past them
    small = _resaved(model, tmp_path / "small-vocab",
                     lambda state: {k: v[:10].clone() if k in ("model.embed_tokens.weight", "lm_head.weight") else v
                                    for k, v in state.items()})
    cfg = json.loads((tmp_path / "small-vocab" / "config.json").read_text())
    cfg["vocab_size"] = 10
    (tmp_path / "small-vocab" / "config.json").write_text(json.dumps(cfg))
    assert "do not belong together" in refused(f"model.path={small}", f"run_dir={tmp_path}/d")


def test_a_config_json_of_another_model_is_refused_from_the_headers(tmp_path):
    """config.json copied from another size: more layers than the weights hold, or another width or
    vocabulary than the embedding's. The launcher refuses it from the safetensors headers (nothing read),
    in one line, before an engine starts; the loader would have found it only after launch."""
    model = make_model_dir(str(tmp_path / "m"), "tiny-dense")
    base = json.loads(open(os.path.join(model, "config.json")).read())
    for name, edit, expected in [
            ("layers", {"num_hidden_layers": base["num_hidden_layers"] + 2},
             f"config.json says num_hidden_layers: {base['num_hidden_layers'] + 2}, but the weights have no layer"
             f" {base['num_hidden_layers']}, {base['num_hidden_layers'] + 1}"),
            ("width", {"hidden_size": base["hidden_size"] * 2, "head_dim": base.get("head_dim") or
                       base["hidden_size"] // base["num_attention_heads"]},
             f"is {base['vocab_size']} x {base['hidden_size']}, but config.json says vocab_size {base['vocab_size']},"
             f" hidden_size {base['hidden_size'] * 2}")]:
        bad = tmp_path / name
        shutil.copytree(model, bad)
        (bad / "config.json").write_text(json.dumps(dict(base, **edit)))
        err = refused(f"model.path={bad}", f"run_dir={tmp_path}/run_{name}")
        assert expected in err and "another model" in err, err
        assert not os.path.exists(tmp_path / f"run_{name}" / "logs"), "refused before anything started"
    fewer = tmp_path / "fewer"  # fewer layers in config.json than in the weights
    shutil.copytree(model, fewer)
    (fewer / "config.json").write_text(json.dumps(dict(base, num_hidden_layers=base["num_hidden_layers"] - 1)))
    err = refused(f"model.path={fewer}", f"run_dir={tmp_path}/run_fewer")
    assert (f"the weights hold layers 0-{base['num_hidden_layers'] - 1}, but config.json says num_hidden_layers:"
            f" {base['num_hidden_layers'] - 1}") in err, err


def test_mtp_layers_after_the_decoders_are_not_a_mismatch():
    from pipeline.models.hf_files import config_mismatch

    names = dict.fromkeys([f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)], "f")
    assert config_mismatch(names, [100, 8], layers=3, vocab=100, hidden=8, mtp_layers=1) is None  # DeepSeek's nextn
    assert config_mismatch(names, [100, 8], layers=4, vocab=100, hidden=8, mtp_layers=1) is None  # published without it
    assert "hold layers 0-3" in config_mismatch(names, [100, 8], layers=3, vocab=100, hidden=8)
    assert config_mismatch({}, None, layers=3, vocab=100, hidden=8) is None  # names it does not know: the loader's


def test_the_launchers_checks_do_not_import_torch(dense_dir, tmp_path):
    """Every check of a run with a checkpoint (config.json read strictly, weights present, tokenizer,
    every data row, the memory estimate) runs without torch: importing it is seconds of every start-up
    (3-4 s on the H200's host), paid before a single component starts."""
    import subprocess
    import sys

    from conftest import REPO

    code = (
        "import sys\n"
        "from pipeline.config import load_config\n"
        "from pipeline.launch.prepare import check_inputs, check_memory, resolve_paths\n"
        f"cfg = resolve_paths(load_config(None, ['run_dir={tmp_path}/run', 'model.path={dense_dir}']))\n"
        "check_inputs(cfg)\n"
        "check_memory(cfg)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_gpus_are_found_with_one_nvidia_smi_call(tmp_path, monkeypatch):
    """The launcher asks nvidia-smi once for both questions (is there a GPU, how much memory has GPU 0);
    a failing nvidia-smi means no GPU."""
    from pipeline.config import load_config
    from pipeline.launch import prepare

    calls = tmp_path / "calls"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho x >> {calls}\nprintf '143771\\n143771\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    prepare._nvidia_gpu_gib.cache_clear()
    cfg = load_config(None, ["train.device=auto"])
    assert prepare._gpu_visible(cfg) and abs(prepare._detected_gpu_gib() - 143771 / 1024) < 1e-9
    assert calls.read_text().count("x") == 1
    smi.write_text("#!/bin/sh\nexit 9\n")
    prepare._nvidia_gpu_gib.cache_clear()
    assert not prepare._gpu_visible(cfg)
    prepare._nvidia_gpu_gib.cache_clear()


def test_files_that_are_not_utf8_jsonl_are_named_in_one_line(tmp_path, tok):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps({"prompt": "1+2=", "label": "3"}).encode() + b"\n" + '{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(UserError, match=r"line 2 is not UTF-8 text"):
        PromptDataset(DataConfig(prompt_data=str(bad)), tok, seed=0)
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([{"prompt": "1+2=", "label": "3"}, {"prompt": "2+2=", "label": "4"}], indent=1))
    with pytest.raises(UserError, match=r"not a JSON array"):
        PromptDataset(DataConfig(prompt_data=str(array)), tok, seed=0)
    (tmp_path / "adir").mkdir()
    assert "is a directory" in refused(f"data.prompt_data={tmp_path}/adir", f"run_dir={tmp_path}/a")
    assert "data.prompt_data is empty" in refused("data.prompt_data=", f"run_dir={tmp_path}/b")
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_parquet_rows_read_as_their_jsonl_rows(tmp_path, tok):
    """Miles / slime data comes as Parquet: the same rows, the same prompts, labels and metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b), "metadata": {"a": a}} for a in range(4) for b in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "train.parquet"))
    jsonl = PromptDataset(DataConfig(prompt_data=write_rows(tmp_path / "train.jsonl", rows)), tok, seed=0)
    parquet = PromptDataset(DataConfig(prompt_data=str(tmp_path / "train.parquet")), tok, seed=0)
    assert parquet.stats.kept == len(rows) == jsonl.stats.kept
    assert [(p.input_ids, p.label, p.metadata) for p in parquet.prompts] == [(p.input_ids, p.label, p.metadata)
                                                                            for p in jsonl.prompts]
    (tmp_path / "broken.parquet").write_bytes(b"PAR1" + b"\0" * 64)
    with pytest.raises(UserError, match="not a readable Parquet file"):
        PromptDataset(DataConfig(prompt_data=str(tmp_path / "broken.parquet")), tok, seed=0)


def test_rows_without_a_label_are_unusable_when_the_reward_compares_with_it(tmp_path, tok):
    rows = [{"prompt": "1+2=", "label": "3"}, {"prompt": "2+2="}, {"prompt": "3+3=", "label": None}]
    path = write_rows(tmp_path / "d.jsonl", rows)
    ds = PromptDataset(DataConfig(prompt_data=path), tok, seed=0, label_for="exact_match")
    assert [p.label for p in ds.prompts] == ["3"]
    assert ds.stats.skipped == {"no 'label' field (rm_type exact_match compares the response with it)": 2}
    # a user's reward function may not need one: the rows stay
    assert len(PromptDataset(DataConfig(prompt_data=path), tok, seed=0).prompts) == 3
    other = write_rows(tmp_path / "o.jsonl", [{"prompt": "1+2=", "answer": "3"}])
    line = refused(f"data.prompt_data={other}", "eval.interval=0", "eval.datasets={}", f"run_dir={tmp_path}/r")
    assert "set data.label_key to the field that holds the answer" in line
    line = refused("rollout.rm_type=bogus", "eval.interval=0", "eval.datasets={}", f"run_dir={tmp_path}/r2")
    assert line.startswith("lockstep: error: rollout.rm_type 'bogus'")


def _resaved(src, dst, edit):
    """A copy of checkpoint `src` whose tensors went through `edit(state) -> state` (safetensors, one file)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = edit(load_file(os.path.join(dst, "model.safetensors")))
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_broken_weight_files_are_refused_in_one_line_before_anything_starts(tmp_path):
    import torch

    from pipeline.models.hf_config import read_model_args
    from pipeline.models.hf_io import read_state_dict, save_model

    model = make_model_dir(str(tmp_path / "m"), "tiny-dense")
    sharded = str(tmp_path / "sharded")
    save_model(read_state_dict(model), read_model_args(model), sharded, tokenizer_dir=model, max_shard_bytes=40_000)
    shards = sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))
    assert len(shards) > 2
    os.unlink(os.path.join(sharded, shards[1]))
    assert f"names 1 shard(s) that are not there ({shards[1]})" in refused(f"model.path={sharded}", f"run_dir={tmp_path}/a")
    truncated = tmp_path / "truncated"
    shutil.copytree(model, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert "is not a readable safetensors file" in refused(f"model.path={truncated}", f"run_dir={tmp_path}/b")
    # tied in config.json, but a saved lm_head that is not the embedding: transformers would not tie them
    tied = _resaved(model, tmp_path / "tied", lambda s: {**s, "lm_head.weight": torch.randn_like(s["model.embed_tokens.weight"])})
    cfg = json.loads(open(os.path.join(tied, "config.json")).read())
    cfg["tie_word_embeddings"] = True
    with open(os.path.join(tied, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert "lm_head.weight differs from model.embed_tokens.weight" in refused(f"model.path={tied}", f"run_dir={tmp_path}/c")
    for run in "abc":
        assert not os.path.exists(tmp_path / run)


def test_rotary_buffers_older_checkpoints_carry_are_ignored_as_transformers_ignores_them(tmp_path):
    import torch

    from pipeline.models.hf_io import load_model

    model = make_model_dir(str(tmp_path / "m"), "tiny-dense")
    old = _resaved(model, tmp_path / "old", lambda s: {**s, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    loaded, reference = load_model(old)[1].state_dict(), load_model(model)[1].state_dict()
    assert loaded.keys() == reference.keys() and all(torch.equal(loaded[k], reference[k]) for k in reference)


def test_the_tied_head_check_is_one_predicate_on_tensors_and_on_files(tmp_path):
    """Loading (hf_io.check_tied, on tensors) and the launcher (hf_files.tied_head_differs, on the files)
    decide with one predicate, hf_files.head_differs: a saved lm_head equal to the embedding may be tied,
    another one (other values, in bfloat16 too, or another shape) may not."""
    import torch

    from pipeline.models.hf_files import head_differs, tied_head_differs, weight_names
    from pipeline.models.hf_io import check_tied, read_state_dict

    embed = "model.embed_tokens.weight"

    def bf16_one_value_off(s):
        e = s[embed].to(torch.bfloat16)
        head = e.clone()
        head[0, 0] += 1
        return {**s, embed: e, "lm_head.weight": head}

    model = make_model_dir(str(tmp_path / "m"), "tiny-dense")
    edits = {"same": lambda s: {**s, "lm_head.weight": s[embed].clone()},
             "other": lambda s: {**s, "lm_head.weight": torch.randn_like(s[embed])},
             "bf16": bf16_one_value_off,
             "shape": lambda s: {**s, "lm_head.weight": s[embed][:-1].clone()}}
    for name, edit in edits.items():
        d = _resaved(model, tmp_path / name, edit)
        state = read_state_dict(d)
        differs = head_differs(state[embed], state["lm_head.weight"])
        assert tied_head_differs(d, weight_names(d)) == differs == (name != "same"), name
        if differs:
            with pytest.raises(UserError, match="lm_head.weight differs from model.embed_tokens.weight"):
                check_tied(state[embed], state["lm_head.weight"], d)
        else:
            check_tied(state[embed], state["lm_head.weight"], d)
    assert not head_differs(None, torch.ones(2)) and not head_differs(torch.ones(2), None)  # not saved: tied


def test_fewer_prompts_than_a_step_takes_is_one_warning_before_the_run(tmp_path, caplog):
    from pipeline.config import load_config
    from pipeline.launch.prepare import check_data

    small = write_rows(tmp_path / "small.jsonl", [{"prompt": f"{a}+1=", "label": str(a + 1)} for a in range(3)])
    with caplog.at_level("WARNING", logger="lockstep.launch"):
        check_data(load_config("configs/tiny.yaml", ["eval.datasets={}", "eval.interval=0"]), None)
        assert not caplog.records  # train.jsonl has more than rollout_batch_size (32) prompts
        check_data(load_config("configs/tiny.yaml", [f"data.prompt_data={small}", "eval.datasets={}",
                                                     "eval.interval=0"]), None)
    assert [r.getMessage() for r in caplog.records] == [
        "lockstep: data.prompt_data has 3 usable prompts, fewer than rollout.rollout_batch_size (32): each step"
        " repeats them"]


def test_an_engine_that_dies_of_a_user_error_is_not_restarted(tmp_path):
    """A checkpoint the engine cannot load (config.json edited after the launcher's checks: a layer more
    than the weights have) fails the same way every time: the engine exits with USER_ERROR_EXIT and its
    one line, and the supervisor reports that line instead of restarting it engine.max_restarts times."""
    from pipeline.config import load_config
    from pipeline.errors import ComponentFailed
    from pipeline.launch.component import USER_ERROR_EXIT
    from pipeline.launch.local import RESTART_MARK, Supervisor, component_cmd
    from pipeline.launch.prepare import prepare_run

    model = make_model_dir(str(tmp_path / "m"), "tiny-dense")
    _, rundir = prepare_run(load_config("configs/tiny.yaml", [f"model.path={model}", f"run_dir={tmp_path}/run"]))
    config = json.loads(open(os.path.join(model, "config.json")).read())
    config["num_hidden_layers"] += 1
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    sup = Supervisor(rundir)
    engine = sup.start_command("engine_0", component_cmd("engine", "--run-dir", rundir.root, "--index", "0"),
                               restarts=3)
    try:
        engine.popen.wait(timeout=120)
        with pytest.raises(ComponentFailed) as failed:
            sup.check()
    finally:
        sup.stop_all()
    assert failed.value.returncode == USER_ERROR_EXIT and engine.restarts_left == 3
    assert ": UserError: " in str(failed.value) and "weights do not match the architecture" in str(failed.value)
    log = open(engine.log_path).read()
    assert RESTART_MARK not in log and "Traceback" not in log


def test_content_given_as_parts_is_its_text_and_other_parts_are_refused(tmp_path, tok):
    """OpenAI-style content parts: a text-only template would print the list's repr (or drop it)."""
    parts = [{"type": "text", "text": "2+2="}, {"type": "text", "text": "answer:"}]
    rows = [{"prompt": [{"role": "user", "content": parts}], "label": "4"},
            {"prompt": [{"role": "user", "content": ["3+3="]}], "label": "6"},
            {"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}], "label": "1"},
            {"prompt": [{"role": "user", "content": 7}], "label": "1"}]
    ds = PromptDataset(DataConfig(prompt_data=write_rows(tmp_path / "parts.jsonl", rows)), tok, seed=0)
    assert ds.prompts[0].text == tok.apply_chat_template([{"role": "user", "content": "2+2=\nanswer:"}])
    assert ds.prompts[1].text == tok.apply_chat_template([{"role": "user", "content": "3+3="}])
    assert ds.stats.skipped == {"a message has a 'image_url' content part (only text parts are read)": 1,
                                "a message's content is neither text nor a list of parts": 1}


def test_sft_chat_rows_with_content_parts_train_on_their_text(tmp_path, tok):
    from pipeline.rollout.sft_data import SftDataset

    plain = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "2+2="}]},
             {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]
    ds = SftDataset(DataConfig(prompt_data=write_rows(tmp_path / "sft.jsonl", [{"messages": plain}, {"messages": parts}]),
                               input_key="messages"), tok, seed=0, max_len=256)
    a, b = ds.prompts
    assert (a.prompt_ids, a.response_ids, a.loss_mask) == (b.prompt_ids, b.response_ids, b.loss_mask)


def test_characters_the_tiny_tokenizer_lacks_are_counted_not_silent(tmp_path, tok):
    """model.init's character tokenizer knows digits, lower case and a few signs: other text reads as <unk>,
    so the model cannot tell "A" from "B". Kept (it may be intended), but counted and named by line."""
    rows = [{"prompt": "1+2=", "label": "3"}, {"prompt": "What is 1+2?", "label": "3"}, {"prompt": "2+2=", "label": "4"},
            {"prompt": "zwölf+1=", "label": "13"}]
    ds = PromptDataset(DataConfig(prompt_data=write_rows(tmp_path / "unk.jsonl", rows)), tok, seed=0)
    assert tok.unk_token_id is not None and ds.stats.kept == 4
    assert (ds.stats.unknown, ds.stats.unknown_lines) == (2, [2, 4])
    assert "2 of them hold characters the tokenizer does not know, read as its unknown token: lines 2, 4" \
        in ds.stats.report()
    clean = PromptDataset(DataConfig(prompt_data=write_rows(tmp_path / "ok.jsonl", rows[::2])), tok, seed=0)
    assert clean.stats.unknown == 0 and "unknown" not in clean.stats.report()


def _family_args():
    import dataclasses

    from pipeline.models.config import model_preset

    dense = model_preset("tiny-dense", 100, None, 0, 0)
    moe = model_preset("tiny-moe", 100, None, 0, 0)
    yield from (model_preset(n, 100, None, 0, 0) for n in ("tiny-dense", "tiny-moe", "deepseek-v3-tiny",
                                                            "qwen3-4b", "qwen3-moe-small", "deepseek-v3-small"))
    yield dataclasses.replace(dense, family="qwen2", attention_bias=True, tie_word_embeddings=True)
    yield dataclasses.replace(dense, family="llama", mlp_bias=True, attention_bias=True, num_key_value_heads=1)
    yield dataclasses.replace(moe, mlp_only_layers=(0,), decoder_sparse_step=2, num_hidden_layers=3)


@pytest.mark.parametrize("args", list(_family_args()), ids=lambda a: f"{a.family}-{a.hidden_size}-{a.num_experts}")
def test_the_launchers_shape_rules_are_the_models_own_shapes(args):
    """The launcher checks every tensor's shape in the headers against config.json without torch
    (hf_files.expected_shape); each of its rules must give what the model itself builds, in every family,
    or it would refuse a good checkpoint (or pass a bad one)."""
    import torch

    from pipeline.models.hf_files import expected_shape, shape_mismatch
    from pipeline.models.qwen3 import Qwen3ForCausalLM

    with torch.device("meta"):
        state = {k: tuple(v.shape) for k, v in Qwen3ForCausalLM(args).state_dict().items()}
    covered = {k: expected_shape(k, args) for k in state}
    covered = {k: v for k, v in covered.items() if v is not None}
    assert {k: state[k] for k in covered} == covered
    assert len(covered) >= 0.5 * len(state) and "model.layers.0.post_attention_layernorm.weight" in covered
    assert shape_mismatch(state, args) is None
    name = next(k for k in covered if k.endswith("o_proj.weight"))
    wrong = dict(state, **{name: (state[name][0], state[name][1] * 2)})
    assert shape_mismatch(wrong, args).startswith(f"{name} is {state[name][0]} x {state[name][1] * 2} in the weights")


def test_a_config_json_of_another_size_is_refused_from_every_tensors_header(tmp_path):
    """Heads, KV heads or the MLP's width in config.json unlike the weights': refused before anything
    starts, naming the first tensor whose shape differs (the loader would have found it after launch)."""
    model = make_model_dir(str(tmp_path / "m"), "tiny-dense")
    base = json.loads(open(os.path.join(model, "config.json")).read())
    for name, edit, tensor in [("kv", {"num_key_value_heads": base["num_key_value_heads"] * 2}, r"self_attn\.[kv]_proj"),
                               ("mlp", {"intermediate_size": base["intermediate_size"] * 2},
                                r"mlp\.(gate|up|down)_proj")]:
        bad = tmp_path / name
        shutil.copytree(model, bad)
        (bad / "config.json").write_text(json.dumps(dict(base, **edit)))
        err = refused(f"model.path={bad}", f"run_dir={tmp_path}/run_{name}")
        assert re.search(rf"'{re.escape(str(bad))}': model\.layers\.\d+\.{tensor}\.weight is \d+ x \d+ in the weights,"
                         r" but config.json gives \d+ x \d+ \(\d+ tensors differ\)", err), err
        assert not os.path.exists(tmp_path / f"run_{name}" / "logs"), "refused before anything started"


@pytest.mark.parametrize("file, content, fragment", [
    ("config.json", '{"model_type": "qwen3",', "config.json' is not valid JSON (line 1"),
    ("config.json", '["qwen3"]', "config.json' holds a JSON list, not an object"),
    ("config.json", None, "config.json' is a directory"),
    ("tokenizer.json", "", "tokenizer.json' cannot be read as a tokenizer"),
    ("tokenizer_config.json", "{oops", "tokenizer_config.json' is not valid JSON"),
])
def test_damaged_checkpoint_files_are_one_line_each(tmp_path, file, content, fragment):
    model = make_model_dir(str(tmp_path / "m"), "tiny-dense")
    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    os.unlink(bad / file)
    if content is None:
        os.mkdir(bad / file)
    else:
        (bad / file).write_text(content)
    assert fragment in refused(f"model.path={bad}", f"run_dir={tmp_path}/run")


@pytest.mark.parametrize("edit, fragment", [
    ({"num_attention_heads": None}, "config.json has no num_attention_heads"),
    ({"num_hidden_layers": 2.0}, "config.json: num_hidden_layers must be a positive integer (got 2.0)"),
    ({"hidden_size": "64"}, "config.json: hidden_size must be a positive integer (got '64')"),
    ({"num_key_value_heads": 0}, "config.json: num_key_value_heads must be a positive integer (got 0)"),
    ({"model_type": None}, "config.json has no model_type"),
])
def test_config_json_sizes_of_the_wrong_type_are_named(edit, fragment):
    from pipeline.models.hf_config import read_hf_config

    cfg = {"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 192}
    with pytest.raises(UserError) as e:
        read_hf_config({k: v for k, v in dict(cfg, **edit).items() if v is not None or k != "model_type"})
    assert fragment in str(e.value)


def test_a_run_dir_holding_another_models_weights_is_refused(tmp_path):
    """Reusing a run_dir for another model: resuming would load its checkpoints into the new model (a size
    mismatch after start-up) or, for model.init, silently train the old model_init. Refused in one line;
    the same model resumes as before."""
    run = f"run_dir={tmp_path}/run"
    small = ["num_rollout=1", "rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "global_batch_size=4"]
    res = lockstep("run", "configs/tiny.yaml", run, *small, "--no-progress", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    line = refused(run, *small, "model.init=tiny-moe")
    assert "holds the weights of another model (model.init tiny-dense (init_seed 0); this run: model.init tiny-moe" in line
    res = lockstep("run", "configs/tiny.yaml", run, *small, "num_rollout=2", "--no-progress", timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_reward_functions_that_cannot_be_called_so_are_refused_before_the_run(tmp_path, monkeypatch):
    """rollout.rm_type names a function the manager calls as fn(response, label, metadata): one of another
    signature, or a bare URL, is refused when it is resolved (every call would fail and score 0)."""
    from pipeline.rollout.rewards import resolve_reward

    (tmp_path / "rm_sig_mod.py").write_text("def one(response):\n    return 1.0\n"
                                            "def three(response, label, metadata=None):\n    return 1.0\n"
                                            "def kw(response, *, label, metadata):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward("rm_sig_mod:three")("a", "b", {}) == 1.0
    for name in ("rm_sig_mod:one", "rm_sig_mod:kw"):
        with pytest.raises(UserError, match=r"cannot be called as fn\(response, label, metadata\)"):
            resolve_reward(name)
    with pytest.raises(UserError, match="a reward server is written remote:URL"):
        resolve_reward("https://example.invalid/score")
