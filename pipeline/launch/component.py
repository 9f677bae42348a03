"""Entry points of the processes a run is made of; the local launcher and Slurm's srun both call these.

  python -m pipeline.launch.component engine  --run-dir D --index I
  python -m pipeline.launch.component rollout --run-dir D [--rank R --num-producers P]
  python -m pipeline.launch.component trainer --run-dir D      (torchrun-style env: RANK, WORLD_SIZE, ...)
Each reads the resolved config the launcher wrote to D/config.yaml.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def engine_argv(cfg, run_dir: str, index: int) -> list[str]:
    """Arguments of the built-in engine server for engine `index` of this run."""
    from pipeline.launch import rendezvous as rdzv
    from pipeline.launch.layout import RunLayout

    e = cfg.engine
    context = cfg.data.max_prompt_len + cfg.rollout.rollout_max_response_len
    argv = [
        "--model-path", RunLayout(run_dir).model_dir(cfg),
        "--host", os.environ.get("LOCKSTEP_ENGINE_HOST", e.host),
        "--port", "0",
        "--max-running-requests", str(e.max_running_requests),
        "--context-length", str(context),
        "--dtype", cfg.model.dtype,
        "--device", e.device,
        "--num-threads", str(e.num_threads),
        "--ready-file", rdzv.engine_file(run_dir, index),
    ]
    if cfg.determinism.true_on_policy:
        argv.append("--true-on-policy")
    return argv


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=["engine", "rollout", "trainer"])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--index", type=int, default=None, help="engine index (default: from SLURM_PROCID)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--num-producers", type=int, default=1)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s {args.role} %(name)s %(levelname)s %(message)s")
    from pipeline.config import load_resolved

    if args.role == "engine":
        from pipeline.rollout.engine import server

        cfg = load_resolved(args.run_dir)
        index = args.index if args.index is not None else int(os.environ.get("LOCKSTEP_ENGINE_INDEX", 0))
        server.main(engine_argv(cfg, args.run_dir, index))
    elif args.role == "rollout":
        from pipeline.rollout import manager

        manager.main(args.run_dir, args.rank, args.num_producers)
    else:
        from pipeline.trainer import loop

        loop.main(args.run_dir)


if __name__ == "__main__":
    main()
