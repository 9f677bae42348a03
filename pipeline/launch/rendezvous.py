"""Rendezvous and control through small atomic files in the run directory (no Ray, no extra service).

  run_dir/rendezvous/engine_<i>.json   {url, host, port, pid}     written by each engine when serving
  run_dir/rendezvous/trainer.json      {master_addr, master_port} written by the launcher / trainer rank 0
  run_dir/rendezvous/weights.json      {master_address, master_port, world_size, backend} weight group
  run_dir/control/version.json         {weight_version}           the engines hold this version; rollout
                                                                  step k may start once it is >= k - staleness
  run_dir/control/STOP                 the run is over; rollout side exits
Every file is written atomically (utils.fs), so a reader sees all of it or nothing.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Callable

from pipeline.utils.fs import atomic_write_json, read_json


def rdzv_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "rendezvous")


def control_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "control")


def publish(path: str, info: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_json(path, dict(info, published=time.time()))


def wait_for(path: str, timeout_s: float, alive: Callable[[], None] | None = None, poll_s: float = 0.05) -> dict:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s")
        if alive:
            alive()
        time.sleep(poll_s)
    return read_json(path)


def engine_file(run_dir: str, index: int) -> str:
    return os.path.join(rdzv_dir(run_dir), f"engine_{index}.json")


def engine_urls(run_dir: str, num_engines: int, timeout_s: float = 600.0,
                alive: Callable[[], None] | None = None) -> list[str]:
    return [wait_for(engine_file(run_dir, i), timeout_s, alive)["url"] for i in range(num_engines)]


def current_engine_urls(run_dir: str, num_engines: int) -> list[str]:
    """The URLs engines have published so far (without waiting): a restarted engine's new one included."""
    urls = []
    for i in range(num_engines):
        path = engine_file(run_dir, i)
        if os.path.exists(path):
            urls.append(read_json(path)["url"])
    return urls


def version_file(run_dir: str) -> str:
    return os.path.join(control_dir(run_dir), "version.json")


def publish_version(run_dir: str, version: int) -> None:
    """Trainer rank 0, after every weight sync: the engines now serve `version`."""
    publish(version_file(run_dir), {"weight_version": version})


def wait_version(run_dir: str, at_least: int, poll_s: float = 0.02) -> int | None:
    """Block until the published weight version is >= at_least (returns it) or the run stops (None)."""
    path = version_file(run_dir)
    while True:
        if os.path.exists(path):
            v = int(read_json(path)["weight_version"])
            if v >= at_least:
                return v
        if stop_requested(run_dir):
            return None
        time.sleep(poll_s)


def current_version(run_dir: str) -> int:
    path = version_file(run_dir)
    return int(read_json(path)["weight_version"]) if os.path.exists(path) else 0


def stop_file(run_dir: str) -> str:
    return os.path.join(control_dir(run_dir), "STOP")


def request_stop(run_dir: str, reason: str = "done") -> None:
    publish(stop_file(run_dir), {"reason": reason})


def stop_requested(run_dir: str) -> bool:
    return os.path.exists(stop_file(run_dir))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reset_control(run_dir: str) -> None:
    """Clear step requests, STOP and stale addresses before (re)starting a run in this directory."""
    for d in (control_dir(run_dir), rdzv_dir(run_dir)):
        if os.path.isdir(d):
            for name in os.listdir(d):
                os.unlink(os.path.join(d, name))
        os.makedirs(d, exist_ok=True)


def checkpoint_request_file(run_dir: str) -> str:
    return os.path.join(control_dir(run_dir), "CHECKPOINT")


def request_checkpoint(run_dir: str, reason: str) -> None:
    """Ask the trainer to checkpoint at its next safe point and exit (pre-emption, time limit)."""
    publish(checkpoint_request_file(run_dir), {"reason": reason})


def checkpoint_requested(run_dir: str) -> bool:
    return os.path.exists(checkpoint_request_file(run_dir))


def checkpoint_done_file(run_dir: str) -> str:
    return os.path.join(control_dir(run_dir), "CHECKPOINT_DONE")


def failed_file(run_dir: str) -> str:
    return os.path.join(control_dir(run_dir), "FAILED")


def reset_role(run_dir: str, role: str) -> None:
    """Clear what one side of a run publishes before it (re)starts: the trainer side owns control/ and
    the trainer/weights addresses, the rollout side the engine addresses (paired jobs start apart)."""
    os.makedirs(control_dir(run_dir), exist_ok=True)
    os.makedirs(rdzv_dir(run_dir), exist_ok=True)
    doomed = []
    if role in ("all", "trainer"):
        doomed += [os.path.join(control_dir(run_dir), n) for n in os.listdir(control_dir(run_dir))]
        doomed += [os.path.join(rdzv_dir(run_dir), n) for n in ("trainer.json", "weights.json")]
    if role in ("all", "rollout"):
        doomed += [os.path.join(rdzv_dir(run_dir), n) for n in os.listdir(rdzv_dir(run_dir)) if n.startswith("engine_")]
    for path in doomed:
        if os.path.exists(path):
            os.unlink(path)
