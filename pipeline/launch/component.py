"""Entry points of the processes a run is made of; the local launcher and Slurm's srun both call these.

  python -m pipeline.launch.component engine  --run-dir D --index I   (built-in engine, or SGLang's supervised)
  python -m pipeline.launch.component rollout --run-dir D [--rank R --num-producers P]
  python -m pipeline.launch.component trainer --run-dir D      (torchrun-style env: RANK, WORLD_SIZE, ...;
                                                                algo.loss_type=sft_loss: the SFT trainer)
Each reads the resolved config the launcher wrote into D, and finds the others (and the run's token)
through D (pipeline.run.RunDir). One that dies of a UserError (a checkpoint that does not match its
config.json, ...) writes its one line and exits with USER_ERROR_EXIT, as the CLI does: the same
process started again would die of it again, so supervisors do not restart it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from pipeline import faults
from pipeline.errors import UserError
from pipeline.run import RunDir, bind_address, free_port
from pipeline.run.heartbeat import Heartbeat
from pipeline.utils.proc import exit_without_finalizing

USER_ERROR_EXIT = 2  # the exit status of a component that died of a UserError (the CLI's too)


def engine_argv(cfg, run_dir: str, index: int) -> list[str]:
    """Arguments of the built-in engine server for engine `index` of this run (run in this process,
    so the token on it is on no process's command line)."""
    rundir = RunDir(run_dir)
    e = cfg.engine
    context = cfg.data.max_prompt_len + cfg.rollout.rollout_max_response_len
    argv = [
        "--model-path", rundir.model_dir(cfg),
        "--host", os.environ.get("LOCKSTEP_ENGINE_HOST") or bind_address(default=e.host),
        "--port", "0",
        "--max-running-requests", str(e.max_running_requests),
        "--context-length", str(context),
        "--dtype", cfg.model.dtype,
        "--device", e.device,
        "--num-threads", str(e.num_threads),
        "--ready-file", rundir.engine_file(index),
        "--startup-file", rundir.startup_file(f"engine_{index}"),
    ]
    token = rundir.token()
    if token:
        argv += ["--api-key", token]
    if cfg.determinism.true_on_policy:
        argv.append("--true-on-policy")
    argv += ["--kernel-backend", cfg.determinism.kernel_backend, "--sampling-backend", e.sampling_backend]
    if e.overlap_schedule:
        argv.append("--enable-overlap-schedule")
    if e.prefix_cache_tokens:
        argv += ["--prefix-cache-tokens", str(e.prefix_cache_tokens)]
    argv += ["--mtp-num-layers", str(cfg.model.mtp_num_layers)]
    if e.speculative_algorithm:
        argv += ["--speculative-algorithm", e.speculative_algorithm, "--speculative-num-steps", str(e.speculative_num_steps)]
    if e.quantization:
        argv += ["--quantization", e.quantization]
    if e.disable_cuda_graph:
        argv.append("--disable-cuda-graph")
    if not e.moe_grouped_experts:
        argv.append("--no-moe-grouped-experts")
    if e.cuda_graph_max_bs:
        argv += ["--cuda-graph-max-bs", str(e.cuda_graph_max_bs)]
    return argv


def trainer_env_from_slurm(run_dir: str) -> None:
    """Under srun: torchrun-style variables from SLURM_*; rank 0 publishes the rendezvous address."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    rundir = RunDir(run_dir)
    rank = int(os.environ["SLURM_PROCID"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=os.environ["SLURM_NTASKS"],
                      LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
                      LOCAL_WORLD_SIZE=os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    if rank == 0:
        host = bind_address()
        rundir.publish_trainer({"master_addr": host, "master_port": free_port(host), "job": os.environ.get("SLURM_JOB_ID")})
    info = rundir.wait_trainer(timeout_s=600)
    os.environ.update(MASTER_ADDR=info["master_addr"], MASTER_PORT=str(info["master_port"]))
    os.environ.setdefault("LOCKSTEP_WEIGHTS_HOST", info["master_addr"])


def main(argv=None) -> None:
    try:
        run_component(argv)
    except UserError as e:  # deterministic: its one line, and no restart (USER_ERROR_EXIT)
        print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)


def run_component(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=["engine", "rollout", "trainer"])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--index", type=int, default=None, help="engine index (default: from SLURM_PROCID)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--num-producers", type=int, default=1)
    args = p.parse_args(argv)
    # Slurm's pre-emption signal is for the job's driver (it has the trainer checkpoint, then
    # requeues); srun forwards signals to its tasks, so components ignore it instead of dying.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s {args.role} %(name)s %(levelname)s %(message)s")
    from pipeline.config import load_resolved

    cfg = load_resolved(args.run_dir)
    if faults.value("user_error") == args.role:
        raise UserError(f"fault user_error={args.role}: the {args.role} refuses to start")
    if args.role == "trainer":
        trainer_env_from_slurm(args.run_dir)
    index = args.index if args.index is not None else int(os.environ.get("SLURM_PROCID", 0))
    heartbeat = Heartbeat(RunDir(args.run_dir), component_name(args.role, index, args.rank),
                          cfg.faults.heartbeat_interval_s).start()
    if args.role == "engine":
        if cfg.engine.type == "sglang":
            from pipeline.rollout import sglang_server

            host = os.environ.get("LOCKSTEP_ENGINE_HOST") or bind_address(default=cfg.engine.host)
            sglang_server.main(cfg, args.run_dir, index, host)
        else:
            from pipeline.rollout.engine import server

            server.main(engine_argv(cfg, args.run_dir, index))
    elif args.role == "rollout":
        from pipeline.rollout import manager

        manager.main(args.run_dir, args.rank, args.num_producers)
    else:
        if cfg.train.expandable_segments:  # read by torch's allocator at its first use
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if cfg.sft:
            from pipeline.trainer.sft import main as trainer_main
        else:
            from pipeline.trainer.loop import main as trainer_main

        trainer_main(args.run_dir)
    heartbeat.end()  # done (an error never gets here: the process exits with it, its heartbeat goes stale)
    if args.role == "trainer":
        exit_without_finalizing(0)  # its gloo worker threads may still free tensors: see there


def component_name(role: str, index: int, rank: int) -> str:
    """The name a process goes by in logs/ and heartbeat/: engine_<i>, rollout[_<r>], trainer_<rank>."""
    if role == "engine":
        return f"engine_{index}"
    if role == "rollout":
        return "rollout" if rank == 0 else f"rollout_{rank}"
    return f"trainer_{os.environ.get('RANK', 0)}"


if __name__ == "__main__":
    main()
