"""Turn a loaded config into a ready run directory (shared by `lockstep run` and `lockstep submit`).

Resolves paths to absolute ones (components may start in another working directory, on another
node), checks inputs before anything is launched (files, the config against the model's shape:
pipeline/config/validate.py, and whether the run fits the GPUs' memory),
creates the starting model when none is given, and writes the resolved config every component reads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess

from pipeline.config import RESOLVED_NAME, dump_config
from pipeline.config.schema import RunConfig
from pipeline.errors import UserError, storage_error
from pipeline.launch import rendezvous as rdzv
from pipeline.launch.layout import RunLayout
from pipeline.observability.startup import startup_dir
from pipeline.utils.fs import atomic_write_bytes

log = logging.getLogger("lockstep.launch")


def resolve_paths(cfg: RunConfig) -> RunConfig:
    model = cfg.model
    if model.path:
        model = dataclasses.replace(model, path=os.path.abspath(os.path.expanduser(model.path)))
    data = dataclasses.replace(cfg.data, prompt_data=os.path.abspath(os.path.expanduser(cfg.data.prompt_data)))
    return dataclasses.replace(cfg, run_dir=os.path.abspath(os.path.expanduser(cfg.run_dir)), model=model, data=data)


def check_inputs(cfg: RunConfig) -> None:
    if not os.path.exists(cfg.data.prompt_data):
        raise UserError(f"data.prompt_data {cfg.data.prompt_data!r} not found: point it at a JSONL file of prompts")
    from pipeline.config.memory import model_args
    from pipeline.config.validate import validate

    if cfg.model.path:
        if not os.path.isdir(cfg.model.path):
            raise UserError(f"model.path {cfg.model.path!r} is not a directory: point it at a Hugging Face checkpoint")
        from pipeline.models.hf_io import read_model_args

        validate(cfg, read_model_args(cfg.model.path))
        if not os.path.exists(os.path.join(cfg.model.path, "tokenizer.json")):
            raise UserError(f"model.path {cfg.model.path!r} has no tokenizer.json")
    else:
        validate(cfg, model_args(cfg))  # the model.init preset's shape
    with open(cfg.data.prompt_data) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                import json

                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise UserError(f"{cfg.data.prompt_data}:{lineno}: not valid JSON") from None
                if not isinstance(row, dict) or cfg.data.input_key not in row:
                    raise UserError(
                        f"{cfg.data.prompt_data}:{lineno}: no {cfg.data.input_key!r} field"
                        f" (set data.input_key to the field that holds the prompt)")
                break
        else:
            raise UserError(f"data.prompt_data {cfg.data.prompt_data!r} is empty")


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
    """Whether `auto` devices would pick a GPU here (torch is imported only when a device is `auto`)."""
    if "auto" not in (cfg.train.device, getattr(cfg.engine, "device", "cuda")):
        return False  # only explicit devices: local_placement does not ask
    import torch

    return torch.cuda.is_available()


def _detected_gpu_gib() -> float | None:
    """GPU 0's memory (where engines and trainer rank 0 meet): from nvidia-smi when there is one (no
    torch import in the launcher: ~3 s of every start-up on an H200), else from torch."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                return float(out.stdout.split()[0]) / 1024  # MiB
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / (1 << 30)


def make_initial_model(cfg: RunConfig, layout: RunLayout) -> None:
    """Write a randomly initialised HF checkpoint + tokenizer to run_dir/model_init (once)."""
    if os.path.exists(os.path.join(layout.model_init, "config.json")):
        return
    import torch

    from pipeline.models.config import model_preset
    from pipeline.models.hf_io import save_model
    from pipeline.models.qwen3 import Qwen3ForCausalLM
    from pipeline.models.tokenizer import build_tiny_tokenizer

    tok_dir = layout.model_init + ".tokenizer"
    tok = build_tiny_tokenizer(tok_dir)
    args = model_preset(cfg.model.init, tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id,
                       mtp_layers=cfg.model.mtp_num_layers)
    torch.manual_seed(cfg.model.init_seed)
    model = Qwen3ForCausalLM(args)
    model.init_weights(cfg.model.init_seed)
    save_model(model.state_dict(), args, layout.model_init, tokenizer_dir=tok_dir)
    shutil.rmtree(tok_dir, ignore_errors=True)


def run_token(layout: RunLayout) -> str:
    """The run's shared secret (run_dir/.token, mode 600): engines reject HTTP requests without it."""
    import secrets

    path = layout.token
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16))
    with open(path) as f:
        return f.read().strip()


def prepare_run(cfg: RunConfig, profile=None) -> tuple[RunConfig, RunLayout]:
    """`profile`: the cluster profile when the run goes to Slurm (its GPUs are checked, not this machine's)."""
    cfg = resolve_paths(cfg)
    check_inputs(cfg)
    check_memory(cfg, profile)
    layout = RunLayout(cfg.run_dir)
    try:
        for d in (layout.root, layout.logs, layout.buffer):
            os.makedirs(d, exist_ok=True)
        if not os.access(layout.root, os.W_OK):
            raise UserError(f"run_dir {layout.root!r} is not writable")
        previous = os.path.join(layout.root, RESOLVED_NAME)
        text = dump_config(cfg)
        if os.path.exists(previous):
            with open(previous) as f:
                if f.read() != text:
                    log.warning("run_dir %s held a different config; the new one replaces it (resuming from its "
                                "checkpoints)", layout.root)
        atomic_write_bytes(previous, text.encode())
        if cfg.model.path is None:
            make_initial_model(cfg, layout)
        run_token(layout)
        rdzv.reset_control(layout.root)
        shutil.rmtree(startup_dir(layout.root), ignore_errors=True)  # this start's phases only
    except OSError as e:
        raise storage_error("run directory", getattr(e, "filename", None) or layout.root, e) from e
    return cfg, layout
