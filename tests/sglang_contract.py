"""Runs inside SGLang's contract environment (PYTHONPATH=.venv/sglang-contract, see
env/sglang-contract.txt); called by tests/test_sglang_contract.py as
`python tests/sglang_contract.py CHECK < input.json` and prints one JSON result.

What SGLang lets us import on CPU is imported and used as is (ServerArgs and its parser,
SamplingParams, MultiprocessingSerializer, sglang-router's parser). What does not import here
(io_struct and the routed-experts capturer pull in torchvision through the multimodal configs) is
read from the installed SGLang source with `ast`: the request dataclasses' field names, the HTTP
server's routes, the weight updater's answers, and the routed-experts decoder's own function body.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")


def sglang_file(*parts: str) -> str:
    import sglang

    return os.path.join(os.path.dirname(sglang.__file__), *parts)


def check_server_args(cases: list[dict]) -> list[dict]:
    """Parse each command line with ServerArgs' own parser and build ServerArgs from it."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    out = []
    for case in cases:
        try:
            ns, unknown = parser.parse_known_args(case["argv"])
            if unknown:
                raise ValueError(f"unrecognized arguments: {' '.join(unknown)}")
            args = ServerArgs.from_cli_args(ns)
            out.append({"ok": True, "values": {k: getattr(args, k) for k in case["expect"]}})
        except (SystemExit, Exception) as e:  # argparse reports unknown flags by exiting
            out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return out


def check_router_args(cases: list[dict]) -> list[dict]:
    from sglang_router.launch_router import parse_router_args

    out = []
    for case in cases:
        try:
            ra = parse_router_args(case["argv"])
            out.append({"ok": True, "values": {k: getattr(ra, k) for k in case["expect"]}})
        except (SystemExit, Exception) as e:
            out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return out


def dataclass_fields() -> dict[str, list[str]]:
    """Field names of every dataclass in sglang/srt/managers/io_struct.py, own and inherited."""
    tree = ast.parse(open(sglang_file("srt", "managers", "io_struct.py")).read())
    own, bases = {}, {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own[node.name] = [s.target.id for s in node.body
                              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def all_fields(name: str) -> list[str]:
        return [f for b in bases.get(name, []) for f in all_fields(b)] + own.get(name, [])

    return {name: all_fields(name) for name in own}


def http_routes() -> list[str]:
    """Every path the SGLang HTTP server registers with @app.get/post/api_route."""
    tree = ast.parse(open(sglang_file("srt", "entrypoints", "http_server.py")).read())
    routes = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.args
                        and isinstance(d.args[0], ast.Constant) and isinstance(d.args[0].value, str)):
                    routes.append(d.args[0].value)
    return routes


def weight_update_messages() -> list[str]:
    """Every constant `message=` SGLang's scheduler weight updater answers with (its refusals when the
    begin / end weight-update session protocol is broken among them)."""
    path = sglang_file("srt", "managers", "scheduler_components", "weight_updater.py")
    return [kw.value.value for node in ast.walk(ast.parse(open(path).read())) if isinstance(node, ast.Call)
            for kw in node.keywords
            if kw.arg == "message" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)]


def check_sampling_params(params: list[dict]) -> list[dict]:
    from sglang.srt.sampling.sampling_params import SamplingParams

    out = []
    for p in params:
        try:
            sp = SamplingParams(**p)
            sp.verify(vocab_size=1 << 17)
            out.append({"ok": True, "values": {k: getattr(sp, k) for k in p}})
        except Exception as e:
            out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return out


def check_tensor_payload(payload: str) -> dict:
    """Our /update_weights_from_tensor payload through SGLang's own (restricted) deserializer."""
    from sglang.srt.utils.common import MultiprocessingSerializer

    named = MultiprocessingSerializer.deserialize(payload)
    return {"names": [n for n, _ in named], "sums": [float(t.double().sum()) for _, t in named],
            "dtypes": [str(t.dtype) for _, t in named], "shapes": [list(t.shape) for _, t in named]}


def check_flattened_bucket(data: dict) -> dict:
    """Lockstep's flattened_bucket body, built in this process (where SGLang imports, as in a trainer
    beside an SGLang engine): its fields against UpdateWeightsFromTensorReqInput, its payload through
    SGLang's restricted deserializer and SGLang's own _update_weights_from_flattened_bucket body (its
    model's load_weights records what it gets), and the same payload through the built-in engine's reader."""
    import torch

    sys.path.insert(0, data["repo"])
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync import tensor_bucket as sglang_bucket

    from pipeline.rollout import protocol, tensor_bucket
    from pipeline.weights.receiver import load_named_tensors
    from pipeline.weights.tensor import flattened_metadata_class

    cls = flattened_metadata_class("flattened", "sglang")
    g = torch.Generator().manual_seed(0)
    named = [("model.embed_tokens.weight", torch.randn(8, 4, generator=g).to(torch.bfloat16)),
             ("model.layers.0.mlp.down_proj.weight", torch.randn(4, 5, generator=g).to(torch.float8_e4m3fn)),
             ("model.layers.0.mlp.down_proj.weight_scale_inv", torch.rand(1, 1, generator=g)),
             ("model.norm.weight", torch.randn(3, generator=g))]
    flat, metadata = tensor_bucket.flatten(named, cls)
    body = protocol.update_flattened_bucket_body(flat, metadata, tp_size=2, version=4)

    path = sglang_file("srt", "model_executor", "model_runner_components", "weight_updater.py")
    tree = ast.parse(open(path).read())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_update_weights_from_flattened_bucket")
    fn.decorator_list, fn.args.args[0].annotation = [], None
    scope = {"FlattenedTensorMetadata": sglang_bucket.FlattenedTensorMetadata,
             "FlattenedTensorBucket": sglang_bucket.FlattenedTensorBucket}
    exec(compile(ast.Module([fn], []), path, "exec"), scope)
    loaded = []

    class Model:
        def load_weights(self, weights):
            loaded.extend(weights)

    class Runner:
        def get_model(self):
            return Model()

    payloads = body["serialized_named_tensors"]
    result = scope[fn.name](Runner(), MultiprocessingSerializer.deserialize(payloads[1]))
    ours = load_named_tensors(payloads[0], body["load_format"])

    def show(pairs):
        return {"names": [n for n, _ in pairs], "dtypes": [str(t.dtype) for _, t in pairs],
                "shapes": [list(t.shape) for _, t in pairs],
                "bytes": [t.contiguous().view(-1).view(torch.uint8).tolist() for _, t in pairs]}

    return {"metadata_class": f"{cls.__module__}.{cls.__qualname__}" if cls else None,
            "fields": sorted(body), "sglang_fields": dataclass_fields()["UpdateWeightsFromTensorReqInput"],
            "load_format": body["load_format"], "weight_version": body["weight_version"],
            "payloads": len(payloads), "result": list(result), "sent": show(named), "sglang": show(loaded),
            "builtin": show(ours)}


def decode_routed_experts_with_sglang(b64: str) -> list[int]:
    """SGLang's extract_routed_experts_from_meta_info, its own function body, run on our payload."""
    import numpy as np
    import pybase64

    path = sglang_file("srt", "state_capturer", "routed_experts.py")
    tree = ast.parse(open(path).read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "extract_routed_experts_from_meta_info")
    scope = {"np": np, "pybase64": pybase64}
    exec(compile(ast.Module([fn], []), path, "exec"), scope)
    return scope[fn.name]({"meta_info": {"routed_experts": b64}}).tolist()


def check_int4_pack(data: dict) -> dict:
    """compressed-tensors' own packer on our INT4 values, and its unpacker on our packed words."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    q = torch.tensor(data["q"], dtype=torch.int8)
    ours = torch.tensor(data["packed"], dtype=torch.int32)
    return {"packed": pack_to_int32(q, 4).tolist(),
            "unpacked": unpack_from_int32(ours, 4, torch.Size(q.shape)).tolist()}


def main() -> None:
    check = sys.argv[1]
    data = json.load(sys.stdin)
    if check == "server_args":
        result = check_server_args(data)
    elif check == "router_args":
        result = check_router_args(data)
    elif check == "schema":
        import sglang

        result = {"version": sglang.__version__, "fields": dataclass_fields(), "routes": http_routes(),
                  "weight_update_messages": weight_update_messages(),
                  "sampling": check_sampling_params(data["sampling"]),
                  "routed_experts": decode_routed_experts_with_sglang(data["routed_experts_b64"])}
    elif check == "int4_pack":
        result = check_int4_pack(data)
    elif check == "tensor_payload":
        result = check_tensor_payload(data["payload"])
    elif check == "flattened_bucket":
        result = check_flattened_bucket(data)
    else:
        raise SystemExit(f"unknown check {check!r}")
    json.dump(result, sys.stdout, default=str)


if __name__ == "__main__":
    main()
