"""The run directory's API (pipeline/run): its names, the token, the rendezvous and control files."""

from __future__ import annotations

import ast
import os
import stat
import threading
import time

import pytest

from conftest import REPO
from pipeline.run import RunDir, publish, wait_for


def test_names_are_the_protocol(tmp_path):
    """Processes of different versions, old run directories and the docs rely on these names."""
    rd = RunDir(tmp_path)
    rel = lambda p: os.path.relpath(p, tmp_path)  # noqa: E731
    assert rd.root == str(tmp_path)
    assert [rel(p) for p in (rd.config, rd.token_file, rd.model_init, rd.logs, rd.buffer, rd.checkpoints,
                             rd.hf_export, rd.metrics, rd.reward_plot, rd.startup_dir, rd.slurm_dir)] == [
        "config.yaml", ".token", "model_init", "logs", "buffer", "checkpoints", "hf", "metrics.jsonl",
        "reward.png", "startup", "slurm"]
    assert rel(rd.log_file("trainer_%t")) == "logs/trainer_%t.log"
    assert rel(rd.slurm_output) == "logs/slurm-%j.out"
    assert rel(rd.startup_file("engine_1")) == "startup/engine_1.json"
    assert rel(rd.sbatch_file("paired-trainer")) == "slurm/paired-trainer.sbatch"
    assert [rel(p) for p in (rd.engine_file(3), rd.trainer_file, rd.weights_file)] == [
        "rendezvous/engine_3.json", "rendezvous/trainer.json", "rendezvous/weights.json"]
    assert [rel(p) for p in (rd.version_file, rd.stop_file, rd.checkpoint_request_file, rd.checkpoint_done_file,
                             rd.failed_file)] == [
        "control/version.json", "control/STOP", "control/CHECKPOINT", "control/CHECKPOINT_DONE", "control/FAILED"]


def test_token_is_private_and_stable(tmp_path):
    rd = RunDir(str(tmp_path))
    assert rd.token() is None
    token = rd.create_token()
    assert len(token) == 32 and stat.S_IMODE(os.stat(rd.token_file).st_mode) == 0o600
    assert rd.create_token() == rd.token() == token


def test_engines_publish_and_are_waited_for(tmp_path):
    rd = RunDir(str(tmp_path))
    assert rd.current_engine_urls(2) == []
    rd.publish_engine(1, {"url": "http://b"})
    assert rd.current_engine_urls(2) == ["http://b"]
    threading.Timer(0.2, rd.publish_engine, (0, {"url": "http://a"})).start()
    assert rd.engine_urls(2, timeout_s=10) == ["http://a", "http://b"]
    with pytest.raises(TimeoutError, match="engine_2.json did not appear"):
        rd.engine_urls(3, timeout_s=0.1)


def test_wait_for_asks_whether_the_writer_lives(tmp_path):
    def dead():
        raise RuntimeError("the writer exited")

    with pytest.raises(RuntimeError, match="the writer exited"):
        wait_for(str(tmp_path / "never.json"), timeout_s=10, alive=dead)
    publish(str(tmp_path / "sub" / "x.json"), {"a": 1})
    got = wait_for(str(tmp_path / "sub" / "x.json"), timeout_s=1)
    assert got["a"] == 1 and got["published"] <= time.time()
    assert [n for n in os.listdir(tmp_path / "sub")] == ["x.json"]  # no temp file left behind


def test_version_waits_end_with_the_run(tmp_path):
    rd = RunDir(str(tmp_path))
    assert rd.current_version() == 0
    rd.publish_version(2)
    assert rd.wait_version(1) == 2 and rd.current_version() == 2
    threading.Timer(0.2, rd.publish_version, (3,)).start()
    assert rd.wait_version(3) == 3
    threading.Timer(0.2, rd.request_stop).start()
    assert rd.wait_version(10) is None and rd.stop_requested()


def test_checkpoint_request_and_failure(tmp_path):
    rd = RunDir(str(tmp_path))
    assert not rd.checkpoint_requested() and not rd.checkpoint_done() and rd.failure() is None
    rd.request_checkpoint("slurm signal")
    assert rd.checkpoint_requested()
    threading.Timer(0.2, rd.publish_checkpoint_done, (7,)).start()
    assert rd.wait_checkpoint_done(10)["step"] == 7
    rd.publish_failure({"component": "srun_engines", "returncode": 1})
    rd.publish_failure({"component": "srun_trainer", "returncode": 1})  # a consequence: the first one stays
    assert rd.failure()["component"] == "srun_engines"


def test_reset_role_clears_only_that_sides_files(tmp_path):
    rd = RunDir(str(tmp_path))
    rd.publish_engine(0, {"url": "u"})
    rd.publish_trainer({"master_addr": "h", "master_port": 1})
    publish(rd.weights_file, {})
    rd.publish_version(4)
    rd.request_stop()
    rd.reset_role("rollout")
    assert not os.path.exists(rd.engine_file(0))
    assert all(map(os.path.exists, (rd.trainer_file, rd.weights_file, rd.version_file, rd.stop_file)))
    rd.publish_engine(0, {"url": "u"})
    rd.reset_role("trainer")
    assert os.path.exists(rd.engine_file(0)) and os.listdir(rd.control_dir) == []
    assert not os.path.exists(rd.trainer_file) and not os.path.exists(rd.weights_file)
    rd.reset_control()
    assert os.listdir(rd.rendezvous_dir) == [] and os.listdir(rd.control_dir) == []


def test_engine_gets_the_token_from_the_run_dir(tmp_path):
    from pipeline.config import load_config
    from pipeline.launch.component import engine_argv

    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"))
    rd = RunDir(str(tmp_path))
    assert "--api-key" not in engine_argv(cfg, rd.root, 0)
    token = rd.create_token()
    argv = engine_argv(cfg, rd.root, 0)
    assert argv[argv.index("--api-key") + 1] == token
    assert argv[argv.index("--ready-file") + 1] == rd.engine_file(0)


# Names of the run directory's entries (RunDir's). A path built from one of these by hand outside
# pipeline/run/ is the bug this test is for: os.path.join(run_dir, "logs"), run / "hf", f"{run_dir}/control/...".
RUN_DIR_NAMES = {"config.yaml", ".token", "model_init", "logs", "buffer", "checkpoints", "hf", "metrics.jsonl",
                 "reward.png", "startup", "slurm", "rendezvous", "control", "version.json", "trainer.json",
                 "weights.json", "STOP", "CHECKPOINT", "CHECKPOINT_DONE", "FAILED"}


def hand_joined(tree: ast.AST):
    for node in ast.walk(tree):
        parts = []
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join":
            if node.args and ast.unparse(node.args[0]) != "REPO":  # the repository's own slurm/ and configs/
                parts = node.args[1:]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts = [node.right]
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if any(f"/{name}/" in text or text.endswith(f"/{name}") for name in RUN_DIR_NAMES):
                yield node.lineno, ast.unparse(node)
        for p in parts:
            if isinstance(p, ast.Constant) and p.value in RUN_DIR_NAMES:
                yield node.lineno, ast.unparse(node)


def test_no_run_dir_path_is_joined_by_hand():
    found = []
    for top in ("pipeline", "bench"):
        for d, _, files in os.walk(os.path.join(REPO, top)):
            for f in sorted(files):
                path = os.path.join(d, f)
                if f.endswith(".py") and not path.startswith(os.path.join(REPO, "pipeline", "run", "")):
                    with open(path) as fh:
                        found += [f"{os.path.relpath(path, REPO)}:{line}: {src}"
                                  for line, src in hand_joined(ast.parse(fh.read(), path))]
    assert not found, "ask RunDir (pipeline/run/rundir.py) for these paths:\n" + "\n".join(found)


def test_heartbeats_name_their_node_and_go_silent_when_stopped(tmp_path, monkeypatch):
    from pipeline.run.heartbeat import Heartbeat, silent

    monkeypatch.setenv("SLURMD_NODENAME", "n7")
    rd = RunDir(tmp_path)
    hb = Heartbeat(rd, "engine_0", interval_s=0.05).start()
    time.sleep(0.3)
    beats = rd.heartbeats()
    assert beats["engine_0"]["node"] == "n7" and beats["engine_0"]["pid"] == os.getpid()
    assert silent(beats, timeout_s=0.2) == {}
    hb.stop()
    time.sleep(0.4)
    assert list(silent(rd.heartbeats(), timeout_s=0.2)) == ["engine_0"]
    Heartbeat(rd, "engine_1", interval_s=1).beat()
    rd.clear_heartbeats("engine_0")  # engine_0 only, not engine_1 (nor an engine_10)
    assert list(rd.heartbeats()) == ["engine_1"]
    done = Heartbeat(rd, "rollout", interval_s=0.05).start()
    done.end()  # a component that finished its work withdraws its heartbeat: no hang to find
    assert list(rd.heartbeats()) == ["engine_1"]


def test_running_attempt_is_the_last_start_once_every_component_beats_after_it(tmp_path):
    from pipeline.run.heartbeat import Heartbeat

    rundir = RunDir(tmp_path)
    rundir.append_event({"event": "start", "attempt": 1, "time": time.time() - 100})
    Heartbeat(rundir, "a", 1.0).beat()
    assert rundir.running_attempt(("a", "b"), fresh_s=5) is None  # b has not beaten
    Heartbeat(rundir, "b", 1.0).beat()
    assert rundir.running_attempt(("a", "b"), fresh_s=5)["attempt"] == 1
    rundir.append_event({"event": "start", "attempt": 2, "time": time.time() + 1})
    assert rundir.running_attempt(("a", "b"), fresh_s=5) is None  # the beats are older than attempt 2
    assert rundir.running_attempt(("a",), fresh_s=0) is None  # not fresh
