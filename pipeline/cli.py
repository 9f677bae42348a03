"""`lockstep`: the command line. Thin: parse, import late, call one function, turn UserError into one line.

  lockstep run CONFIG [key.sub=value ...]      run the job on this machine (engines, rollout, trainer)
  lockstep submit CONFIG [overrides] [--cluster NAME] [--dry-run] [--wait]   submit to Slurm
  lockstep nightly submit MATRIX | report DIR  scaling matrix as job arrays; table + plot vs nodes
  lockstep config show CONFIG [overrides]      print the resolved config
  lockstep config options                      every option with its type, default and meaning
  lockstep buffer inspect|verify RUN_DIR     per-step table of the rollout buffer / check every checksum
  lockstep summary RUN_DIR                     the end-of-run summary (and reward.png) again
  lockstep status RUN_DIR                      steps, last checkpoint, job attempts, failures and their nodes
  lockstep eval RUN_DIR|MODEL_DIR [--dataset NAME=PATH ...] [--out DIR] [overrides]   evaluate a model alone
  lockstep data make-arith OUT_DIR             write the synthetic arithmetic task as JSONL
  lockstep data make-multidigit OUT_DIR        multi-digit arithmetic with a scratchpad: sft / train / test JSONL
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pipeline.errors import ComponentFailed, UserError


def cmd_run(args) -> int:
    from pipeline.config import load_config
    from pipeline.launch.local import run_local
    from pipeline.launch.prepare import prepare_run
    from pipeline.observability.report import plot_rewards, summary
    from pipeline.observability.startup import LAUNCH, StartupClock

    clock = StartupClock(started=time.time())
    with clock.phase("prepare"):
        cfg = load_config(args.config, args.overrides)
        cfg, rundir = prepare_run(cfg)
    clock.publish(rundir.startup_file(LAUNCH))
    shape = (f"SFT, {cfg.samples_per_step} rows/step" if cfg.sft else
             f"{cfg.rollout.rollout_batch_size}x{cfg.rollout.n_samples_per_prompt} samples/step, "
             f"{cfg.engine.num_engines} engine(s)")
    print(f"lockstep: run_dir {rundir.root} ({cfg.num_rollout} steps, {shape}, {cfg.train.num_gpus} trainer rank(s))",
          file=sys.stderr)
    run_local(cfg, rundir, progress=not args.no_progress)
    if cfg.logging.plot:
        plot_rewards(rundir.root)
    print(summary(rundir.root))
    return 0


def cmd_submit(args) -> int:
    import dataclasses

    from pipeline.config import load_config
    from pipeline.launch.prepare import prepare_run
    from pipeline.launch.slurm.plan import check_request
    from pipeline.launch.slurm.profile import load_profile
    from pipeline.launch.slurm.submit import dry_run, submit

    cfg = load_config(args.config, args.overrides)
    if args.cluster:
        cfg = dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, cluster=args.cluster))
    profile = load_profile(cfg.slurm.cluster)
    check_request(cfg, profile)  # refuse impossible requests before touching the run directory
    cfg, rundir = prepare_run(cfg, profile)
    if args.dry_run:
        for path in dry_run(cfg, profile, rundir.root):
            print(f"# {path}")
            print(open(path).read())
        return 0
    since = len(rundir.read_events())  # events of earlier jobs in this run directory are not news
    jobs = submit(cfg, rundir.root, profile)
    ids = [j.job_id for j in jobs]
    print(f"lockstep: submitted {', '.join(ids)} ({cfg.slurm.mode}, cluster {profile.name});"
          f" run_dir {rundir.root}", file=sys.stderr)
    if not args.wait:
        return 0
    from pipeline.launch.slurm.follow import follow
    from pipeline.observability.metrics import read_metrics
    from pipeline.observability.report import ProgressBar, plot_rewards, summary

    bar = ProgressBar(cfg.num_rollout, enabled=cfg.logging.progress)

    def say(line: str) -> None:
        print(("\n" if bar.enabled and bar.tty else "") + f"lockstep: {line}", file=sys.stderr, flush=True)

    outcome = follow(ids, rundir, say, since=since, tick=lambda state: bar.update(read_metrics(rundir.root), status=state))
    bar.close()
    if not outcome.ok:
        print(f"lockstep: error: {outcome.message} (lockstep status {rundir.root}; logs in {rundir.logs})",
              file=sys.stderr)
        return 1
    print(f"lockstep: {outcome.message}", file=sys.stderr)
    plot_rewards(rundir.root)
    print(summary(rundir.root))
    return 0


def cmd_nightly(args) -> int:
    from pipeline.launch.slurm import nightly

    if args.action == "report":
        print(nightly.report(args.target))
        return 0
    matrix = nightly.load_matrix(args.target)
    out = nightly.submit_matrix(matrix, dry_run=args.dry_run)
    if args.dry_run:
        for script in out["scripts"]:
            print(f"# {script}\n{open(script).read()}")
        return 0
    print(f"lockstep: submitted arrays {[a['job'] for a in out['arrays']]}, series {[s['job'] for s in out['series']]}",
          file=sys.stderr)
    if args.wait:
        states = nightly.wait(out)
        print(json.dumps(states), file=sys.stderr)
        print(nightly.report(matrix.out_dir))
        if any(s != "COMPLETED" for s in states.values()):
            return 1
    return 0


def cmd_config(args) -> int:
    from pipeline.config import RunConfig, dump_config, load_config
    from pipeline.config.core import option_table

    if args.action == "show":
        print(dump_config(load_config(args.config, args.overrides)), end="")
    else:
        for name, tp, default, doc in option_table(RunConfig):
            print(f"{name:<40} {tp:<28} {default:<14} {doc}")
    return 0


def existing_dir(path: str, what: str = "run directory") -> str:
    """`path` when it is a directory; a UserError line naming what it is instead."""
    if not os.path.isdir(path):
        raise UserError(f"{path!r} is {'a file' if os.path.exists(path) else 'not found'}: give a {what}")
    return path


def cmd_status(args) -> int:
    from pipeline.observability.status import status

    existing_dir(args.run_dir)
    print(status(args.run_dir))
    return 0


def cmd_summary(args) -> int:
    from pipeline.observability.report import plot_rewards, summary

    existing_dir(args.run_dir)
    plot_rewards(args.run_dir)
    print(summary(args.run_dir))
    return 0


def cmd_eval(args) -> int:
    from pipeline.launch.evaluate import run_eval
    from pipeline.observability.report import eval_table

    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f"--out {args.out!r} is a file: give a directory for the eval's results")
    summary, out = run_eval(args.target, args.dataset, args.overrides, args.out)
    s = summary["sampling"]
    print(f"eval of {args.target}: {summary['n_samples_per_prompt']} sample(s) per prompt, temperature"
          f" {s['temperature']}, top_p {s['top_p']}, at most {s['max_new_tokens']} tokens")
    print(eval_table(summary))
    for name, path in summary["sets"].items():
        print(f"{name}: {path}")
    return 0


def cmd_buffer(args) -> int:
    from pipeline.buffer import tools

    existing_dir(args.run_dir)
    if args.action == "inspect":
        print(tools.inspect(args.run_dir))
        return 0
    ok, report = tools.verify(args.run_dir)
    print(report)
    return 0 if ok else 1


def cmd_data(args) -> int:
    from pipeline.rollout.tasks import make_arith, make_multidigit

    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise UserError(f"{args.out_dir!r} is a file: give a directory to write the data set into")
    if args.task == "make-arith":
        make_arith(args.out_dir, seed=args.seed)
        print(f"wrote {args.out_dir}/train.jsonl and test.jsonl")
        return 0
    sizes = {k: getattr(args, k) for k in ("n_sft", "n_train", "n_test_per_digits", "sft_max_digits", "max_digits")}
    try:
        counts = make_multidigit(args.out_dir, seed=args.seed, **sizes)
    except ValueError as e:
        raise UserError(str(e)) from None
    print(f"wrote {args.out_dir}/: " + ", ".join(f"{name}.jsonl ({n} rows)" for name, n in counts.items()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lockstep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a job on this machine")
    r.add_argument("config", help="YAML recipe, e.g. configs/tiny.yaml")
    r.add_argument("overrides", nargs="*", help="key.sub=value (or a unique leaf name: rollout_batch_size=8)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(fn=cmd_run)

    sb = sub.add_parser("submit", help="submit the job to Slurm (heterogeneous job through submitit)")
    sb.add_argument("config")
    sb.add_argument("overrides", nargs="*")
    sb.add_argument("--cluster", default=None, help="cluster profile from env/ (default: slurm.cluster)")
    sb.add_argument("--dry-run", action="store_true", help="write and print the batch script(s), submit nothing")
    sb.add_argument("--wait", action="store_true", help="follow the job to its end (progress, summary)")
    sb.set_defaults(fn=cmd_submit)

    n = sub.add_parser("nightly", help="scaling matrix as Slurm job arrays; report of step time vs nodes")
    n.add_argument("action", choices=["submit", "report"])
    n.add_argument("target", help="matrix YAML (submit) or its out_dir (report)")
    n.add_argument("--dry-run", action="store_true")
    n.add_argument("--wait", action="store_true")
    n.set_defaults(fn=cmd_nightly)

    c = sub.add_parser("config", help="show the resolved config or list all options")
    c.add_argument("action", choices=["show", "options"])
    c.add_argument("config", nargs="?", default=None)
    c.add_argument("overrides", nargs="*")
    c.set_defaults(fn=cmd_config)

    st = sub.add_parser("status", help="progress, job attempts, failures (and their nodes) of a run")
    st.add_argument("run_dir")
    st.set_defaults(fn=cmd_status)

    s = sub.add_parser("summary", help="summary and reward plot of a finished run")
    s.add_argument("run_dir")
    s.set_defaults(fn=cmd_summary)

    e = sub.add_parser("eval", help="evaluate a run's final model, or a model directory, on held-out sets")
    e.add_argument("target", help="a run directory (its hf/ export and config) or a Hugging Face model directory")
    e.add_argument("overrides", nargs="*", help="key.sub=value, e.g. eval.n_samples_per_prompt=8 eval.temperature=0")
    e.add_argument("--dataset", action="append", default=[], metavar="NAME=PATH",
                   help="an eval set (repeatable); replaces eval.datasets of the run's config")
    e.add_argument("--out", default=None, help="results directory (default: RUN_DIR/eval/hf; required for a model dir)")
    e.set_defaults(fn=cmd_eval)

    b = sub.add_parser("buffer", help="inspect or verify a run's rollout buffer")
    b.add_argument("action", choices=["inspect", "verify"])
    b.add_argument("run_dir")
    b.set_defaults(fn=cmd_buffer)

    d = sub.add_parser("data", help="write a synthetic task")
    d.add_argument("task", choices=["make-arith", "make-multidigit"])
    d.add_argument("out_dir")
    d.add_argument("--seed", type=int, default=0, help="the split's (and problems') seed")
    d.add_argument("--n-sft", type=int, default=20000, help="make-multidigit: SFT rows (with the scratchpad)")
    d.add_argument("--n-train", type=int, default=20000, help="make-multidigit: RL prompts")
    d.add_argument("--n-test-per-digits", type=int, default=64,
                   help="make-multidigit: held-out problems per first-operand length (2..max-digits)")
    d.add_argument("--sft-max-digits", type=int, default=4, help="make-multidigit: longest first operand in SFT rows")
    d.add_argument("--max-digits", type=int, default=4, help="make-multidigit: longest first operand in RL and test")
    d.set_defaults(fn=cmd_data)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may come after flags (`run cfg.yaml --no-progress a.b=1`): collect the strays.
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return args.fn(args)
    except UserError as e:
        print(f"lockstep: error: {e}", file=sys.stderr)
        return 2
    except ComponentFailed as e:
        print(f"lockstep: error: {e}; last lines of its log:\n{e.log_tail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lockstep: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
