"""Turn a loaded config into a ready run directory (shared by `lockstep run` and `lockstep submit`).

Resolves paths to absolute ones (components may start in another working directory, on another
node), checks inputs before anything is launched (files, the config against the model's shape:
pipeline/config/validate.py, and whether the run fits the GPUs' memory),
creates the starting model when none is given, and writes the resolved config every component reads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import subprocess
import sys

from pipeline.config import dump_config
from pipeline.config.schema import RunConfig
from pipeline.errors import UserError, storage_error
from pipeline.run import RunDir
from pipeline.utils.fs import atomic_write_bytes

log = logging.getLogger("lockstep.launch")


def resolve_paths(cfg: RunConfig) -> RunConfig:
    empty = [key for key, value in (("data.prompt_data", cfg.data.prompt_data), *((f"eval.datasets.{n}", ds.path)
             for n, ds in cfg.eval.datasets.items())) if not str(value).strip()]
    if empty:
        raise UserError(f"{empty[0]} is empty: point it at a JSONL file")
    model = cfg.model
    if model.path:
        model = dataclasses.replace(model, path=os.path.abspath(os.path.expanduser(model.path)))
    data = dataclasses.replace(cfg.data, prompt_data=os.path.abspath(os.path.expanduser(cfg.data.prompt_data)))
    datasets = {name: dataclasses.replace(ds, path=os.path.abspath(os.path.expanduser(ds.path)))
                for name, ds in cfg.eval.datasets.items()}
    return dataclasses.replace(cfg, run_dir=os.path.abspath(os.path.expanduser(cfg.run_dir)), model=model, data=data,
                               eval=dataclasses.replace(cfg.eval, datasets=datasets))


def check_inputs(cfg: RunConfig) -> None:
    """Everything a user brings, checked before anything starts: the checkpoint directory, its tokenizer
    against the model, and every row of the prompt data (one line per problem)."""
    for key, path, what in (("data.prompt_data", cfg.data.prompt_data, "prompts"),
                            *((f"eval.datasets.{n}", ds.path, "held-out prompts") for n, ds in cfg.eval.datasets.items())):
        if not os.path.isfile(path):
            problem = "is a directory" if os.path.isdir(path) else "not found"
            raise UserError(f"{key} {path!r} {problem}: point it at a JSONL file of {what}")
    from pipeline.rollout.functions import resolve_generate_fn

    resolve_generate_fn(cfg.rollout.generate_fn)  # importable, and a function (one line if not)
    from pipeline.config.memory import model_args
    from pipeline.config.validate import validate

    vocab = None
    if cfg.model.path:
        if not os.path.isdir(cfg.model.path):
            raise UserError(f"model.path {cfg.model.path!r} is not a directory: point it at a Hugging Face checkpoint")
        from pipeline.models.hf_config import read_model_args

        args = read_model_args(cfg.model.path)
        validate(cfg, args)
        check_weights_present(cfg.model.path, args)
        if not os.path.exists(os.path.join(cfg.model.path, "tokenizer.json")):
            raise UserError(f"model.path {cfg.model.path!r} has no tokenizer.json")
        vocab = args.vocab_size
    else:
        validate(cfg, model_args(cfg))  # the model.init preset's shape
    check_data(cfg, vocab)


def check_weights_present(model_dir: str, args) -> None:
    """Safetensors weights there, every shard the index names present with a readable header, the layers
    and embedding shape config.json describes (`args`: its ModelArgs), and (a tied LM head) no saved
    lm_head.weight that differs from the embedding: one line each if not."""
    from pipeline.models.hf_files import (EMBED_NAME, config_mismatch, shape_mismatch, tensor_shapes, tied_head_differs,
                                          tied_head_error, weight_names)

    names = os.listdir(model_dir)
    if any(n.endswith(".safetensors") for n in names) or "model.safetensors.index.json" in names:
        tensors = weight_names(model_dir)
        shapes = tensor_shapes(model_dir, tensors)  # every header read once, for both checks
        embed = shapes.get(EMBED_NAME)
        why = config_mismatch(tensors, list(embed) if embed else None, args.num_hidden_layers, args.vocab_size,
                              args.hidden_size, args.mtp_num_hidden_layers)
        why = why or shape_mismatch(shapes, args)
        if why:
            raise UserError(f"model.path {model_dir!r}: {why}")
        if args.tie_word_embeddings and tied_head_differs(model_dir, tensors):
            raise tied_head_error(f"model.path {model_dir!r}")
        return
    legacy = [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
    fix = (f"it has {legacy[0]}: save it as safetensors (transformers: model.save_pretrained(dir))" if legacy
           else "the directory has config.json but no weight files (an interrupted download?)")
    raise UserError(f"model.path {model_dir!r} has no *.safetensors weights: {fix}")


def check_data(cfg: RunConfig, model_vocab: int | None) -> None:
    """Parse and tokenize every row as the rollout manager (or, for SFT, the trainer) will:
    data.on_bad_row=error stops here in one line; skipped rows are reported once (count per reason,
    first lines), and fewer usable rows than a step takes is a warning."""
    import tempfile

    from pipeline.models.tokenizer import build_tiny_tokenizer, load_tokenizer
    from pipeline.rollout.data import PromptDataset

    if cfg.model.path:
        tok = load_tokenizer(cfg.model.path)
    else:
        with tempfile.TemporaryDirectory() as d:  # model.init's tokenizer (written with the model later)
            tok = build_tiny_tokenizer(d)
    if model_vocab is not None and tok.vocab_size > model_vocab:
        raise UserError(f"model.path {cfg.model.path!r}: the tokenizer has {tok.vocab_size} tokens but the model's"
                        f" embedding only {model_vocab} rows: they do not belong together")
    if cfg.sft:
        from pipeline.rollout.sft_data import SftDataset

        stats = [SftDataset(cfg.data, tok, seed=cfg.rollout.rollout_seed,
                            max_len=cfg.data.max_prompt_len + cfg.rollout.rollout_max_response_len).stats]
        if cfg.rollout.n_samples_per_prompt != 1:
            log.warning("lockstep: algo.loss_type=sft_loss trains each row once per step: rollout.n_samples_per_prompt"
                        " (%d) is ignored", cfg.rollout.n_samples_per_prompt)
    else:
        from pipeline.rollout.rewards import label_for, resolve_reward

        resolve_reward(cfg.rollout.rm_type)  # a name, a module:function or a URL (one line if not)
        stats = [PromptDataset(cfg.data, tok, seed=cfg.rollout.rollout_seed, label_for=label_for(cfg.rollout.rm_type)).stats]
    if cfg.eval.datasets:  # the eval sets as the rollout manager will read them, reward functions included
        from pipeline.rollout.eval_data import load_eval_sets

        stats += [s.stats for s in load_eval_sets(cfg, tok)]
    for st in stats:
        if st.skipped or st.unknown:
            print(f"lockstep: {st.report()}", file=sys.stderr)
        else:
            log.info("lockstep: %s", st.report())
    if stats[0].kept < cfg.rollout.rollout_batch_size:  # the stream of epochs wraps within a step
        log.warning("lockstep: data.prompt_data has %d usable %s, fewer than rollout.rollout_batch_size (%d): each step"
                    " repeats them", stats[0].kept, "rows" if cfg.sft else "prompts", cfg.rollout.rollout_batch_size)


def check_memory(cfg: RunConfig, profile=None) -> None:
    """Refuse a GPU run whose estimated per-GPU peak exceeds the GPU's memory (pipeline/config/memory.py).
    `profile`: the cluster profile of a `lockstep submit` (GPUs there, not here); None for `lockstep run`,
    which looks at the GPUs this process sees."""
    from pipeline.config import memory

    if not cfg.train.check_memory:
        return
    if profile is None:
        placement = memory.local_placement(cfg, gpu_visible=_gpu_visible(cfg))
    else:
        placement = memory.slurm_placement(cfg, gpus=profile.gpu_vendor != "none" and profile.gpus_per_node > 0)
    if not (placement.trainer_gpu or placement.engine_gpu):
        return  # a CPU run
    gib = cfg.train.gpu_memory_gib
    if gib is None:
        gib = profile.gpu_memory_gib if profile is not None else _detected_gpu_gib()
    if gib is None:
        where = f"gpu_memory_gib in env/{profile.name}.yaml" if profile is not None else "a visible GPU"
        log.warning("lockstep: GPU memory check skipped: the GPUs' memory is unknown (set train.gpu_memory_gib,"
                    " or %s)", where)
        return
    est = memory.check(cfg, placement, gib)
    log.info("memory estimate on a %.0f GiB GPU: %s", gib, est.line())


def _gpu_visible(cfg: RunConfig) -> bool:
    """Whether `auto` devices would pick a GPU here, without importing torch (seconds of every start-up):
    a GPU that nvidia-smi lists (and CUDA_VISIBLE_DEVICES does not hide), or a ROCm device node."""
    if "auto" not in (cfg.train.device, getattr(cfg.engine, "device", "cuda")):
        return False  # only explicit devices: local_placement does not ask
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    if shutil.which("nvidia-smi"):
        return bool(_nvidia_gpu_gib())
    return os.path.exists("/dev/kfd")  # ROCm


@functools.cache
def _nvidia_gpu_gib() -> tuple[float, ...]:
    """Each GPU's memory as nvidia-smi lists them (GPU 0 first); () without nvidia-smi or when it fails.
    One call serves both the GPU check and the memory check of a start."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ()
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            return ()
        return tuple(float(line) / 1024 for line in out.stdout.split())  # MiB
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return ()


def _detected_gpu_gib() -> float | None:
    """GPU 0's memory (where engines and trainer rank 0 meet): from nvidia-smi when there is one (no
    torch import in the launcher: ~3 s of every start-up on an H200), else from torch."""
    gpus = _nvidia_gpu_gib()
    if gpus:
        return gpus[0]
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / (1 << 30)


def make_initial_model(cfg: RunConfig, rundir: RunDir) -> None:
    """Write a randomly initialised HF checkpoint + tokenizer to run_dir/model_init (once)."""
    if os.path.exists(os.path.join(rundir.model_init, "config.json")):  # an HF checkpoint directory
        return
    import torch

    from pipeline.models.config import model_preset
    from pipeline.models.hf_io import save_model
    from pipeline.models.qwen3 import Qwen3ForCausalLM
    from pipeline.models.tokenizer import build_tiny_tokenizer

    tok_dir = rundir.model_init_tokenizer
    tok = build_tiny_tokenizer(tok_dir)
    args = model_preset(cfg.model.init, tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id,
                       mtp_layers=cfg.model.mtp_num_layers)
    torch.manual_seed(cfg.model.init_seed)
    model = Qwen3ForCausalLM(args)
    model.init_weights(cfg.model.init_seed)
    save_model(model.state_dict(), args, rundir.model_init, tokenizer_dir=tok_dir)
    shutil.rmtree(tok_dir, ignore_errors=True)


def check_same_model(cfg: RunConfig, rundir: RunDir) -> None:
    """A run_dir that holds weights (model_init, checkpoints) of another model than cfg's is refused: resuming
    would load those into the new model (a size mismatch after start-up), or silently train the old one
    (model_init is written once)."""
    import yaml

    holds = os.path.isdir(rundir.model_init) or (os.path.isdir(rundir.checkpoints) and os.listdir(rundir.checkpoints))
    if not holds:
        return
    try:
        with open(rundir.config) as f:
            old = (yaml.safe_load(f) or {}).get("model") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return  # not a config this tool wrote: nothing to compare
    def named(path, init, seed) -> tuple[tuple, str]:  # (what identifies the weights, how to say it)
        if path:
            return ("path", os.path.realpath(path)), f"model.path {path!r}"
        return ("init", init, seed), f"model.init {init} (init_seed {seed})"

    (before, was), (after, now) = (named(old.get("path"), old.get("init"), old.get("init_seed", 0)),
                                   named(cfg.model.path, cfg.model.init, cfg.model.init_seed))
    if before != after:
        raise UserError(f"run_dir {rundir.root!r} holds the weights of another model ({was}; this run: {now}): give"
                        " a new run_dir, or remove that one to start over")


def prepare_run(cfg: RunConfig, profile=None) -> tuple[RunConfig, RunDir]:
    """`profile`: the cluster profile when the run goes to Slurm (its GPUs are checked, not this machine's)."""
    cfg = resolve_paths(cfg)
    check_inputs(cfg)
    check_memory(cfg, profile)
    rundir = RunDir(cfg.run_dir)
    try:
        for d in (rundir.root, rundir.logs, rundir.buffer):
            os.makedirs(d, exist_ok=True)
        if not os.access(rundir.root, os.W_OK):
            raise UserError(f"run_dir {rundir.root!r} is not writable")
        text = dump_config(cfg)
        if os.path.exists(rundir.config):
            check_same_model(cfg, rundir)
            with open(rundir.config) as f:
                if f.read() != text:
                    log.warning("run_dir %s held a different config; the new one replaces it (resuming from its "
                                "checkpoints)", rundir.root)
        atomic_write_bytes(rundir.config, text.encode())
        if cfg.model.path is None:
            make_initial_model(cfg, rundir)
        rundir.create_token()
        rundir.reset_control()
        shutil.rmtree(rundir.startup_dir, ignore_errors=True)  # this start's phases only
    except OSError as e:
        raise storage_error("run directory", getattr(e, "filename", None) or rundir.root, e) from e
    return cfg, rundir
