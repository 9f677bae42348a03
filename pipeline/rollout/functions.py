"""Resolving and calling a rollout function (`rollout.generate_fn: module:function`, sync or async)."""

from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import TYPE_CHECKING, Callable

from pipeline.errors import UserError
from pipeline.rollout.base import RolloutSample
from pipeline.rollout.trajectory import Trajectory

if TYPE_CHECKING:  # the launcher's checks resolve functions without torch (the handle's protocol imports it)
    from pipeline.rollout.handle import PoolHandle


def resolve_generate_fn(path: str) -> Callable:
    """The function `module:function` names; a one-line UserError naming the fix otherwise."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise UserError(f"rollout.generate_fn {path!r}: write it as module:function"
                        " (e.g. pipeline.rollout.envs.calculator:generate)")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise UserError(f"rollout.generate_fn {path!r}: module {module!r} is not importable ({type(e).__name__}: {e});"
                        " check the name and that its directory is on PYTHONPATH") from None
    if not hasattr(mod, attr):
        raise UserError(f"rollout.generate_fn {path!r}: module {module!r} has no attribute {attr!r}")
    fn = getattr(mod, attr)
    if not inspect.isfunction(fn) and not inspect.iscoroutinefunction(fn):
        raise UserError(f"rollout.generate_fn {path!r} is a {type(fn).__name__}, not a function:"
                        " give a (sample, engine) -> Trajectory function, sync or async")
    return fn


def run_generate_fn(fn: Callable, sample: RolloutSample, handle: "PoolHandle") -> Trajectory:
    """Call the function (an async one in its own event loop, in this worker thread)."""
    if inspect.iscoroutinefunction(fn):
        from pipeline.rollout.handle import AsyncHandle

        traj = asyncio.run(fn(sample, AsyncHandle(handle)))
    else:
        traj = fn(sample, handle)
    if not isinstance(traj, Trajectory):
        raise TypeError(f"rollout function {fn.__module__}.{fn.__qualname__} returned {type(traj).__name__},"
                        " not a pipeline.rollout.trajectory.Trajectory")
    return traj
