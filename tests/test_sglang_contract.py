"""Contract tests against SGLang's own code (sglang 0.5.23, sglang-router 0.3.2: env/sglang-contract.txt).

SGLang cannot serve on these machines (no GPU, CUDA-only kernel wheels), so everything Lockstep
sends it is checked against the pinned release's own parser, types and source instead:
  - every `sglang.launch_server` command line Lockstep generates parses with ServerArgs' parser and
    builds a ServerArgs carrying the intended values; a flag SGLang does not know is refused;
  - the sglang-router command line parses with the router's own parser;
  - request bodies use only fields of SGLang's request dataclasses (io_struct), sampling parameters
    build a SamplingParams and pass its verify(); the built-in engine's weight-update session refusals
    are SGLang's own messages;
  - every endpoint the client calls is a route of SGLang's HTTP server;
  - the colocated weight payload loads through SGLang's restricted MultiprocessingSerializer;
  - routed experts encoded as the built-in engine does decode the same with SGLang's decoder.
Setup (`scripts/setup.sh test`) installs that environment; if it is missing these tests fail.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO
from pipeline.config import load_config
from pipeline.rollout import protocol
from pipeline.rollout.router import router_argv
from pipeline.rollout.sglang_server import server_argv

CONTRACT_ENV = os.path.join(REPO, ".venv", "sglang-contract")
pytestmark = pytest.mark.slow  # each test imports SGLang's own code in a subprocess


def contract(check: str, data) -> object:
    if not os.path.isfile(os.path.join(CONTRACT_ENV, ".installed")):
        pytest.fail(f"SGLang's contract environment is missing at {CONTRACT_ENV}: run `scripts/setup.sh test`")
    env = dict(os.environ, PYTHONPATH=CONTRACT_ENV)
    res = subprocess.run([sys.executable, os.path.join(REPO, "tests", "sglang_contract.py"), check],
                         input=json.dumps(data), capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout)


def sglang_cfg(*overrides: str):
    return load_config(os.path.join(REPO, "configs", "tiny.yaml"), ["engine.type=sglang", *overrides])


VARIANTS = {
    "default": [],
    "true_on_policy": ["determinism.true_on_policy=true"],
    "r3_moe": ["determinism.routing_replay=true", "model.init=tiny-moe"],
    "tp2_fp8": ["engine.tp_size=2", "engine.quantization=fp8", "engine.kv_cache_dtype=fp8_e4m3",
                "engine.attention_backend=fa3", "model.dtype=bfloat16", "engine.chunked_prefill_size=4096"],
    "colocated_flashinfer": ["engine.colocated=true", "engine.attention_backend=flashinfer",
                             "engine.mem_fraction_static=0.5"],
    "extra_args": ["engine.extra_args=[--disable-radix-cache, --schedule-policy, lpm]"],
    "mtp_nextn": ["model.mtp_num_layers=1", "engine.speculative_algorithm=NEXTN", "engine.speculative_num_steps=2"],
    "cuda_graph_bs": ["engine.cuda_graph_max_bs=48"],
    "no_cuda_graph": ["engine.disable_cuda_graph=true"],
    # DeepSeek-V3 on one 8-GPU node: MLA attention backend, experts over 8 GPUs with DeepEP, DP attention
    "deepseek_ep_dp_attention": ["model.init=deepseek-v3-tiny", "model.dtype=bfloat16", "engine.tp_size=8",
                                 "engine.ep_size=8", "engine.attn_dp_size=8", "engine.attention_backend=flashmla",
                                 "engine.moe_a2a_backend=deepep", "determinism.routing_replay=true"],
}


def test_every_generated_server_command_line_is_accepted_by_sglang_server_args():
    cases, expected = [], []
    for name, overrides in VARIANTS.items():
        cfg = sglang_cfg(*overrides)
        argv = server_argv(cfg, "/models/qwen3", "10.0.0.7", 30011, api_key="run-token")
        want = {"model_path": "/models/qwen3", "host": "10.0.0.7", "port": 30011, "tp_size": cfg.engine.tp_size,
                "mem_fraction_static": cfg.engine.mem_fraction_static, "dtype": cfg.model.dtype,
                "api_key": "run-token", "random_seed": cfg.rollout.rollout_seed, "skip_tokenizer_init": True,
                "enable_deterministic_inference": cfg.determinism.true_on_policy,
                "context_length": cfg.data.max_prompt_len + cfg.rollout.rollout_max_response_len}
        if cfg.determinism.true_on_policy:
            want["rl_on_policy_target"] = "fsdp"
        if name == "tp2_fp8":
            want.update(quantization="fp8", kv_cache_dtype="fp8_e4m3", attention_backend="fa3",
                        chunked_prefill_size=4096)
        if name == "colocated_flashinfer":
            want.update(enable_memory_saver=True, attention_backend="flashinfer")
        if name == "extra_args":
            want.update(disable_radix_cache=True, schedule_policy="lpm")
        if name == "mtp_nextn":
            want.update(speculative_algorithm="NEXTN", speculative_num_steps=2, speculative_eagle_topk=1,
                        speculative_num_draft_tokens=3)
        if name == "r3_moe":
            want["enable_return_routed_experts"] = True
        if name == "cuda_graph_bs":
            want["cuda_graph_max_bs_decode"] = 48
        if name == "no_cuda_graph":
            want.update(cuda_graph_backend_decode="disabled", cuda_graph_backend_prefill="disabled")
        if name == "deepseek_ep_dp_attention":
            want.update(ep_size=8, attn_dp_size=8, attention_backend="flashmla", moe_a2a_backend="deepep",
                        enable_return_routed_experts=True)
        cases.append({"argv": argv, "expect": sorted(want)})
        expected.append((name, want))
    results = contract("server_args", cases)
    for (name, want), case, got in zip(expected, cases, results):
        assert got["ok"], f"{name}: SGLang refused {case['argv']}: {got['error']}"
        assert got["values"] == want, f"{name}: {got['values']} != {want}"


def test_sglang_parser_refuses_what_it_does_not_know():
    """The check above can fail: an option SGLang has no flag for, and a value outside its choices."""
    bad_flag = server_argv(sglang_cfg("engine.extra_args=[--no-such-sglang-flag]"), "/m", "127.0.0.1", 1)
    bad_value = server_argv(sglang_cfg("engine.kv_cache_dtype=fp9"), "/m", "127.0.0.1", 1)
    results = contract("server_args", [{"argv": bad_flag, "expect": []}, {"argv": bad_value, "expect": []}])
    assert not results[0]["ok"] and "no-such-sglang-flag" in results[0]["error"]
    assert not results[1]["ok"] and "fp9" in results[1]["error"]


def test_router_command_line_is_accepted_by_sglang_router():
    argv = router_argv(["http://10.0.0.7:30011", "http://10.0.0.8:30011"], "127.0.0.1", 30999, "cache_aware", "tok",
                       prometheus_port=31001)
    (got,) = contract("router_args", [{"argv": argv, "expect": ["worker_urls", "policy", "host", "port", "api_key",
                                                                "prometheus_host", "prometheus_port"]}])
    assert got["ok"], got
    assert got["values"] == {"worker_urls": ["http://10.0.0.7:30011", "http://10.0.0.8:30011"], "policy": "cache_aware",
                             "host": "127.0.0.1", "port": 30999, "api_key": "tok", "prometheus_host": "127.0.0.1",
                             "prometheus_port": 31001}


def client_endpoints() -> set[str]:
    """Every endpoint path string in the modules that talk to engines."""
    paths = set()
    for rel in ("pipeline/rollout/client.py", "pipeline/weights/broadcast.py", "pipeline/rollout/manager.py",
                "pipeline/trainer/loop.py"):
        for node in ast.walk(ast.parse(open(os.path.join(REPO, rel)).read())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("/") \
                    and node.value[1:2].isalpha() and " " not in node.value and "." not in node.value:
                paths.add(node.value)
    return paths


def test_request_bodies_and_endpoints_match_sglang():
    bucket = [("model.layers.0.mlp.up_proj.weight", torch.zeros(4, 2, dtype=torch.bfloat16)),
              ("model.norm.weight", torch.ones(2))]
    bodies = {
        "GenerateReqInput": protocol.generate_body([[1, 2]], [{}], return_routed_experts=True, rid=["a"]),
        "InitWeightsUpdateGroupReqInput": protocol.init_group_body(
            master_address="10.0.0.1", master_port=1, rank_offset=1, world_size=2, group_name="g", backend="nccl",
            timeout_s=60),
        "UpdateWeightsFromDistributedReqInput": protocol.update_distributed_body(bucket, "g", 3),
        "UpdateWeightsFromTensorReqInput": protocol.update_tensor_body(bucket, tp_size=2, version=3),
        "UpdateWeightFromDiskReqInput": protocol.update_disk_body("/ckpt/hf", 3),
        "BeginWeightUpdateReqInput": protocol.begin_weight_update_body(),
        "EndWeightUpdateReqInput": protocol.end_weight_update_body(),
        "ReleaseMemoryOccupationReqInput": protocol.memory_body([protocol.MemoryTag.KV_CACHE]),
        "ResumeMemoryOccupationReqInput": protocol.memory_body(None),
        "AbortReq": protocol.abort_body(),
    }
    endpoint_of = {"InitWeightsUpdateGroupReqInput": "/init_weights_update_group"}
    params = [protocol.sampling_params(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=20, seed=12345),
              {"max_new_token": 16}]  # a misspelt field: must be refused, so this check can fail
    codes = np.arange(5 * 2 * 3, dtype=np.int32).reshape(5, 2, 3)
    from pipeline.rollout.engine.server import encode_routed_experts

    out = contract("schema", {"sampling": params,
                              "routed_experts_b64": encode_routed_experts([torch.from_numpy(codes)])})
    print(f"checked against sglang {out['version']}")
    for cls, body in bodies.items():
        extra = protocol.EXTENSIONS.get(endpoint_of.get(cls, ""), frozenset())
        unknown = set(body) - set(out["fields"][cls]) - extra
        assert not unknown, f"{cls}: SGLang has no field(s) {sorted(unknown)}"
    assert set(bodies["UpdateWeightsFromDistributedReqInput"]) >= {"names", "dtypes", "shapes", "group_name"}
    assert "selector" in out["fields"]["BeginWeightUpdateReqInput"]
    # the built-in engine refuses a broken weight-update session with SGLang's own words
    sessions = [protocol.SESSION_REQUIRED.format(endpoint=e)
                for e in ("update_weights_from_tensor", "update_weights_from_distributed")]
    sessions += [protocol.SESSION_ALREADY_OPEN, protocol.SESSION_NOT_OPEN]
    assert not set(sessions) - set(out["weight_update_messages"]), out["weight_update_messages"]
    good, bad = out["sampling"]
    assert good["ok"], good
    assert good["values"]["sampling_seed"] == 12345 and good["values"]["no_stop_trim"] is True
    assert good["values"]["skip_special_tokens"] is False
    assert not bad["ok"] and "max_new_token" in bad["error"]
    legacy = {"/get_weight_version"}  # asked only when /model_info answers 404 (SGLang before 0.5.2x)
    used = client_endpoints()
    assert {"/generate", "/update_weights_from_distributed", "/begin_weight_update", "/end_weight_update",
            "/model_info"} <= used
    missing = used - legacy - set(out["routes"])
    assert not missing, f"SGLang {out['version']} has no route(s) {sorted(missing)}"
    assert out["routed_experts"] == codes.reshape(-1).tolist()


def test_colocated_weight_payload_loads_through_sglang_deserializer():
    named = [("model.embed_tokens.weight", torch.randn(8, 4)), ("model.norm.weight", torch.ones(4, dtype=torch.bfloat16))]
    body = protocol.update_tensor_body(named, tp_size=1, version=1)
    got = contract("tensor_payload", {"payload": body["serialized_named_tensors"][0]})
    assert got["names"] == [n for n, _ in named]
    assert got["dtypes"] == [str(t.dtype) for _, t in named]
    assert got["shapes"] == [list(t.shape) for _, t in named]
    assert got["sums"] == pytest.approx([float(t.double().sum()) for _, t in named], abs=0)


def test_flattened_bucket_body_is_sglangs_and_loads_through_its_own_code():
    """weights.tensor_format=flattened to SGLang engines: with SGLang importable (its contract environment
    here, a trainer beside SGLang in a run), the body is SGLang's flattened_bucket exactly: fields of
    UpdateWeightsFromTensorReqInput, a payload SGLang's restricted deserializer accepts, holding SGLang's
    own FlattenedTensorMetadata, which SGLang's own _update_weights_from_flattened_bucket turns back
    into the sent tensors byte for byte (bf16, FP8 e4m3 + its fp32 scale, fp32). The built-in engine's
    reader gives the same tensors from the same payload."""
    out = contract("flattened_bucket", {"repo": REPO})
    assert out["metadata_class"] == "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata"
    assert set(out["fields"]) <= set(out["sglang_fields"]), sorted(set(out["fields"]) - set(out["sglang_fields"]))
    assert out["load_format"] == "flattened_bucket" and out["weight_version"] == "4" and out["payloads"] == 2
    assert out["result"] == [True, "Success"]
    assert out["sglang"] == out["sent"] and out["builtin"] == out["sent"]
