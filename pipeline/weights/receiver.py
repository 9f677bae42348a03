"""Engine side of weight updates (the built-in engine's handlers for SGLang's weight endpoints).

As in SGLang (0.5.2x), tensor and distributed updates run only inside a weight-update session
(/begin_weight_update ... /end_weight_update); outside one, and for a begin while one is open or an
end while none is, the answer is SGLang's refusal (protocol.SESSION_*), so CPU tests hold the
trainer to the protocol real engines enforce. /update_weights_from_disk needs no session.

Broadcast buckets are staged and applied together when the request that carries `weight_version`
(the last bucket) has arrived, so an update cut off half way leaves the engine on its last complete
version, never a mix of two.
"""

from __future__ import annotations

import base64
import io
import logging
import pickle
import threading
import time

import torch

from pipeline import faults
from pipeline.rollout import protocol, tensor_bucket
from pipeline.rollout.protocol import version_from_wire
from pipeline.weights.group import broadcast, create_group
from pipeline.weights.quant import SCALE_SUFFIX, dequantize_fp8_pairs, wire

log = logging.getLogger("lockstep.weights")


def parse_dtype(name: str) -> torch.dtype:
    name = name.removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class TensorUnpickler(pickle.Unpickler):
    """Loads the tensors of /update_weights_from_tensor and nothing else: only torch's own rebuild
    functions, storage and dtype types, the few containers a list of (name, tensor) needs, and a
    flattened bucket's metadata entries (SGLang's class is read as Lockstep's twin of it, so this
    process needs no SGLang)."""

    ALLOWED = {
        ("builtins", "list"), ("builtins", "tuple"), ("builtins", "dict"), ("collections", "OrderedDict"),
        ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"), ("multiprocessing.resource_sharer", "DupFd"),
    }
    METADATA = {("pipeline.rollout.tensor_bucket", "FlattenedTensorMetadata"),
                ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.METADATA:
            return tensor_bucket.FlattenedTensorMetadata
        allowed = ((module, name) in self.ALLOWED
                   or (module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"))
                   or (module == "torch._utils" and name.startswith("_rebuild_"))
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a weight update")
        return super().find_class(module, name)


def load_named_tensors(payload: str, load_format: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one payload: a list of them (load_format None), or a flattened
    bucket (tensor_bucket.LOAD_FORMAT), whose tensors come back as views of its one flat tensor."""
    import torch.multiprocessing  # noqa: F401  (torch's rebuild functions for shared memory / CUDA IPC)

    if load_format not in (None, tensor_bucket.LOAD_FORMAT):
        raise ValueError(f"load_format {load_format!r}: the built-in engine reads none (a list of named "
                         f"tensors) or {tensor_bucket.LOAD_FORMAT!r}")
    data = TensorUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    if load_format == tensor_bucket.LOAD_FORMAT:
        if not (isinstance(data, dict) and {"flattened_tensor", "metadata"} <= data.keys()
                and isinstance(data["metadata"], list)
                and all(isinstance(m, tensor_bucket.FlattenedTensorMetadata) for m in data["metadata"])):
            raise ValueError("a flattened_bucket payload holds {'flattened_tensor': uint8 tensor, 'metadata': "
                             "[FlattenedTensorMetadata, ...]}")
        return tensor_bucket.reconstruct(data["flattened_tensor"], data["metadata"])
    if not isinstance(data, list) or not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor)
                                             for x in data):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return data


class WeightReceiver:
    """Each group (one per trainer-side membership) stages into its own dict under its own lock, so a
    broadcast stuck on a dead group (until its timeout) never blocks, or mixes into, the next one."""

    def __init__(self, engine):
        self.engine = engine
        self.groups: dict[str, object] = {}
        self.staged: dict[str, dict[str, torch.Tensor]] = {}
        self.staging: dict[str, torch.device] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.last_update_s = 0.0
        self.session: protocol.WeightSelector | None = None  # the open session's selector (None: no session)
        self.session_updates = 0  # update requests taken in the open session (for the log)
        self.session_lock = threading.Lock()

    def begin_session(self, body: dict) -> tuple[bool, str]:
        """SGLang's /begin_weight_update. `selector` is recorded as SGLang does; this engine loads every
        tensor it is sent by name (a speculative draft's parameters are its own names), whichever runner
        the selector names."""
        selector = body.get("selector", protocol.WeightSelector.ALL.value)
        if selector not in set(protocol.WeightSelector):
            return False, f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'"
        with self.session_lock:
            if self.session is not None:
                return False, protocol.SESSION_ALREADY_OPEN
            self.session, self.session_updates = protocol.WeightSelector(selector), 0
            self.engine.stats["weight_sessions_begun"] += 1
        log.info("weight-update session begun (selector %s)", selector)
        return True, "Success"

    def end_session(self, body: dict) -> tuple[bool, str]:
        """SGLang's /end_weight_update (this engine has no post-load step to run)."""
        with self.session_lock:
            if self.session is None:
                return False, protocol.SESSION_NOT_OPEN
            self.session, updates = None, self.session_updates
            self.engine.stats["weight_sessions_ended"] += 1
        log.info("weight-update session ended after %d update(s)", updates)
        return True, "Success"

    def refused_outside_session(self, endpoint: str) -> tuple[bool, str] | None:
        """SGLang's answer to a tensor / distributed update outside a session, or None inside one."""
        if self.session is None:
            return False, protocol.SESSION_REQUIRED.format(endpoint=endpoint)
        return None

    def init_group(self, body: dict) -> tuple[bool, str]:
        name = body.get("group_name", "weight_update_group")
        try:
            pg = create_group(body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
                              int(body["world_size"]), body.get("backend", "gloo"),
                              float(body.get("timeout_s", 300)))
        except Exception as e:  # reported to the trainer, which fails with this message
            return False, f"init_weights_update_group failed: {type(e).__name__}: {e}"
        # A new membership replaces the old group; whatever the old one had half-staged is dropped.
        self.groups, self.staged, self.locks = {name: pg}, {name: {}}, {name: threading.Lock()}
        self.staging = {name: torch.device("cpu") if body.get("backend", "gloo") == "gloo" else self.engine.device}
        return True, f"joined group {name}"

    def destroy_group(self, body: dict) -> tuple[bool, str]:
        name = body.get("group_name", "weight_update_group")
        self.groups.pop(name, None)
        self.staged.pop(name, None)
        return True, f"destroyed {name}"

    def update_from_distributed(self, body: dict) -> tuple[bool, str]:
        refused = self.refused_outside_session("update_weights_from_distributed")
        if refused:
            return refused
        name = body.get("group_name", "weight_update_group")
        pg, lock, device = self.groups.get(name), self.locks.get(name), self.staging.get(name)
        if pg is None:
            return False, f"no weight update group {name!r}: call /init_weights_update_group first"
        t0 = time.monotonic()
        time.sleep(faults.seconds("engine_update_delay_s"))
        with lock:
            staged = self.staged.get(name)
            try:
                for tname, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                    t = torch.empty(shape, dtype=parse_dtype(dtype), device=device)
                    broadcast(pg, wire(t), src=0)
                    if staged is not None:
                        staged[tname] = t
            except Exception as e:
                self.staged.pop(name, None)
                self.groups.pop(name, None)
                return False, f"weight broadcast failed, kept version {self.engine.weight_version}: {e}"
            if staged is None or self.groups.get(name) is not pg:
                return False, f"group {name!r} was replaced during the update; kept version {self.engine.weight_version}"
            self.session_updates += 1
            version = version_from_wire(body.get("weight_version"))
            if version is None:
                return True, f"staged {len(body['names'])} tensors"
            self.staged[name] = {}
        self.engine.load_weights(self.dequantized(staged), version)
        self.last_update_s = time.monotonic() - t0
        return self.complete(version) or (True, f"weights updated to version {version}")

    def complete(self, version: int | None) -> tuple[bool, str] | None:
        """A failure answer when the update that carries `version` leaves parameters unwritten since a
        memory release (the engine then keeps refusing /generate); None when the version is whole."""
        missing = self.engine.missing_after_release()
        if version is None or not missing:
            return None
        return False, (f"weight version {version} is incomplete after a memory release: {len(missing)} parameter(s)"
                       f" were not sent (e.g. {missing[0]}); this engine refuses /generate until every one is")

    def dequantized(self, staged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """FP8 updates (weights.quantization=fp8): an FP8 engine (engine.quantization=fp8) keeps the pairs;
        any other computes in its own dtype with the FP8 values, W = q * scale_inv."""
        if self.engine.quantization == "fp8" or not any(n.endswith(SCALE_SUFFIX) for n in staged):
            return staged
        dtypes = {n: p.dtype for n, p in self.engine.params.items()}
        return dequantize_fp8_pairs(staged, dtypes)

    def update_from_tensor(self, body: dict) -> tuple[bool, str]:
        """Colocated update: the tensors arrive as shared-memory (CPU) or CUDA IPC handles, one payload
        per TP rank (this engine is one rank: the first): a handle per tensor, or one per bucket
        (load_format "flattened_bucket": views of one flat tensor, applied alike). Each bucket is
        applied as it arrives (the sender pauses the engine around the whole version); the one that
        carries weight_version must leave no parameter unwritten since a memory release. Tensors already
        on the engine's device are read in place (no staging copy): the sender keeps their memory until
        this answer, and the answer waits for the copies to finish."""
        refused = self.refused_outside_session("update_weights_from_tensor")
        if refused:
            return refused
        payloads = body.get("serialized_named_tensors") or []
        if not payloads:
            return False, "serialized_named_tensors is empty"
        t0 = time.monotonic()
        try:
            named = load_named_tensors(payloads[0], body.get("load_format"))
            t1 = time.monotonic()
            unknown = [n for n, _ in named if n.removesuffix(SCALE_SUFFIX) not in self.engine.params]
            if unknown:
                return False, f"unknown parameter(s) {unknown[:3]}: no weights changed"
            staged = self.dequantized({n: t.to(self.engine.device) for n, t in named})
        except Exception as e:
            return False, f"update_weights_from_tensor failed, kept version {self.engine.weight_version}: {e}"
        version = version_from_wire(body.get("weight_version"))
        self.engine.load_weights(staged, version if version is not None else self.engine.weight_version)
        self.session_updates += 1
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)  # done reading the sender's memory
        self.last_update_s = time.monotonic() - t0
        done = f"{len(staged)} tensors updated in {1e3 * self.last_update_s:.1f} ms (handles opened in {1e3 * (t1 - t0):.1f} ms)"
        return self.complete(version) or (True, done)

    def update_from_disk(self, body: dict) -> tuple[bool, str]:
        from pipeline.models.hf_io import read_state_dict

        try:
            state = read_state_dict(body["model_path"])
        except Exception as e:
            return False, f"update_weights_from_disk failed: {e}"
        if self.engine.model.args.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        version = version_from_wire(body.get("weight_version"))
        self.engine.load_weights(state, version if version is not None else self.engine.weight_version)
        return self.complete(version) or (True, f"loaded {body['model_path']}")
