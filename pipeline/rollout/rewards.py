"""Reward functions: a registry of names plus any `module:function` (or `module.function`) path.

A reward function takes (response_text, label, metadata) and returns a float, or a dict of named
components that includes "score". A function that raises marks that sample failed (reward 0, status
failed, counted in rollout/reward_failed) instead of ending the run.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, Callable

from pipeline.errors import UserError

RewardFn = Callable[[str, Any, dict], "float | dict[str, float]"]

_LEADING_INT = re.compile(r"^\s*(-?\d+)")
_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def arith_reward(response: str, label: Any, metadata: dict) -> float:
    """1 if the response starts with the right integer, else 0 (extra text after it is ignored)."""
    m = _LEADING_INT.match(response)
    return 1.0 if m and m.group(1) == str(label).strip() else 0.0


def exact_match_reward(response: str, label: Any, metadata: dict) -> float:
    return 1.0 if response.strip() == str(label).strip() else 0.0


def final_answer_reward(response: str, label: Any, metadata: dict) -> float:
    """1 if the text after the response's last ">" is exactly the label (surrounding whitespace aside),
    else 0: the `multidigit` task's answer after its scratchpad ("... 4+0+1=5 >5216")."""
    head, marker, answer = response.rpartition(">")
    return 1.0 if marker and answer.strip() == str(label).strip() else 0.0


def math_reward(response: str, label: Any, metadata: dict) -> float:
    """Compare the \\boxed{} answer (else the last number in the response) with the label numerically."""
    boxed = _BOXED.findall(response)
    candidate = boxed[-1] if boxed else (_LAST_NUMBER.findall(response) or [None])[-1]
    if candidate is None:
        return 0.0
    try:
        return 1.0 if abs(float(candidate) - float(str(label))) < 1e-6 else 0.0
    except ValueError:
        return 1.0 if candidate.strip() == str(label).strip() else 0.0


REGISTRY: dict[str, RewardFn] = {
    "arith": arith_reward,
    "exact_match": exact_match_reward,
    "final_answer": final_answer_reward,
    "math": math_reward,
}


class RemoteReward:
    """A reward model behind HTTP: POST {"response", "label", "metadata"} -> {"score": float, ...}.
    Selected with rm_type "remote:http://host:port/path"; extra keys come back as named components.

    The rollout manager scores every sample as it finishes, from many threads: at most
    `max_concurrency` requests are open at once (a server's accept backlog is small: 128 simultaneous
    connections to a plain threading server were reset), and a connection that is refused or reset, a
    timeout or an HTTP 429/5xx is retried `attempts` times with backoff before the sample fails."""

    RETRY_STATUS = (429, 500, 502, 503, 504)

    def __init__(self, url: str, timeout_s: float = 60.0, api_key: str | None = None, max_concurrency: int = 16,
                 attempts: int = 4, backoff_s: float = 0.2):
        import threading

        self.url, self.timeout_s, self.api_key = url, timeout_s, api_key
        self.attempts, self.backoff_s = attempts, backoff_s
        self.slots = threading.BoundedSemaphore(max_concurrency)

    def __call__(self, response: str, label: Any, metadata: dict):
        import json
        import time
        import urllib.error
        import urllib.request

        body = json.dumps({"response": response, "label": label, "metadata": metadata}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.attempts):
            req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with self.slots, urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    out = json.loads(resp.read())
                return out if isinstance(out, dict) else float(out)
            except urllib.error.HTTPError as e:
                if e.code not in self.RETRY_STATUS or attempt + 1 == self.attempts:
                    raise
            except (ConnectionError, TimeoutError, urllib.error.URLError):
                if attempt + 1 == self.attempts:
                    raise
            time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")


def label_for(rm_type: str) -> str | None:
    """rm_type when it is a built-in function, which compares the response with the row's label (a row
    without one can never be right); None for user functions and reward models, which may not need one."""
    return rm_type if rm_type in REGISTRY else None


def resolve_reward(name: str, what: str = "rollout.rm_type") -> RewardFn:
    """The reward function `name` names; `what`, the option that gave it, starts every error."""
    if name in REGISTRY:
        return REGISTRY[name]
    if name.startswith("remote:"):
        import os

        return RemoteReward(name.removeprefix("remote:"), api_key=os.environ.get("LOCKSTEP_RM_API_KEY"))
    if name.startswith(("http://", "https://")):
        raise UserError(f"{what} {name!r}: a reward server is written remote:URL ({what}=remote:{name})")
    if ":" in name:
        module, _, attr = name.partition(":")
    elif "." in name:
        module, _, attr = name.rpartition(".")
    else:
        raise UserError(f"{what} {name!r}: not one of {sorted(REGISTRY)}, a 'module:function' path"
                        " or 'remote:URL'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"{what} {name!r}: cannot import ({e})") from None
    if not callable(fn):
        raise UserError(f"{what} {name!r} is not callable")
    try:
        inspect.signature(fn).bind("response", "label", {})
    except TypeError as e:
        raise UserError(f"{what} {name!r} cannot be called as fn(response, label, metadata) ({e})") from None
    except ValueError:  # no signature to read (a builtin): calls will tell
        pass
    return fn


def score(fn: RewardFn, response: str, label: Any, metadata: dict) -> tuple[float, dict[str, float], str | None]:
    """Run a reward function; returns (score, components, error message or None)."""
    try:
        out = fn(response, label, metadata)
    except Exception as e:  # a user's reward function failing must not end a week-long run
        return 0.0, {}, f"{type(e).__name__}: {e}"
    if isinstance(out, dict):
        if "score" not in out:
            return 0.0, {}, "reward function returned a dict without 'score'"
        comps = {k: float(v) for k, v in out.items() if k != "score"}
        return float(out["score"]), comps, None
    return float(out), {}, None
