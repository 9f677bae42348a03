"""The DeepSeek-V3 MoE block: routed experts chosen by a grouped sigmoid router, plus shared experts.

Router (`gate`, transformers' DeepseekV3TopkRouter; fp32 whatever the model dtype, as there):
  scores  = sigmoid(x W_gate^T)                                      [N, E]
  choice  = scores + e_score_correction_bias                         selection only (aux-loss-free balancing)
  groups  = the topk_group of n_group expert groups with the largest sum of their two best choices
  experts = top-k of choice within those groups                      [N, k]
  weights = scores at those experts, / their sum (+1e-20) if norm_topk_prob, x routed_scaling_factor
Output = sum_k weights_k expert_k(x) + shared_experts(x).

R3 (rollout routing replay) records and replays the final expert ids: the correction bias and the
groups only pick experts, so a replayed token takes the trace's experts and its weights come from
the sigmoid scores of those experts, normalised and scaled as above (`MoeRouting.select` in
pipeline/models/qwen3.py does the record / compare / replay for both MoE families).

Legend: N tokens, D hidden, E routed experts, G expert groups, k experts per token.
"""

from __future__ import annotations

import torch
from torch import nn

import lockstep_kernels as kernels

from pipeline.models.config import ModelArgs
from pipeline.models.layers import MLP, Experts, run_experts

NORM_EPS = 1e-20  # transformers' denominator guard of the normalised top-k weights


class TopkRouter(nn.Module):
    """`mlp.gate`: weight [E, D] and e_score_correction_bias [E] (a checkpoint value, not trained here:
    a frozen parameter, so it travels with the weights to engines and exports)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_experts), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = args.num_experts_per_tok, args.n_group, args.topk_group
        self.norm_topk, self.scaling = args.norm_topk_prob, args.routed_scaling_factor

    def forward(self, x_ND, routing, moe_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, k], fp32 weights [N, k])."""
        logits_NE = kernels.linear(x_ND.float(), self.weight.float())
        if routing is not None:
            logits_NE = routing.perturb(moe_idx, logits_NE)
        scores_NE = kernels.sigmoid(logits_NE)
        choice_NE = group_limited(scores_NE + self.e_score_correction_bias.float(), self.n_group, self.topk_group)
        if routing is None:
            idx_Nk = kernels.topk_indices(choice_NE, self.top_k)
        else:
            idx_Nk = routing.select(moe_idx, choice_NE, self.top_k)
        w_Nk = scores_NE.gather(-1, idx_Nk)
        if self.norm_topk:
            w_Nk = w_Nk / (w_Nk.sum(-1, keepdim=True) + NORM_EPS)
        return idx_Nk, w_Nk * self.scaling


def group_limited(choice_NE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice with every expert outside the token's topk_group best groups (a group scores the sum of its
    two largest choices) set to -inf."""
    if topk_group >= n_group:
        return choice_NE
    n, e = choice_NE.shape
    group_NG = choice_NE.view(n, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
    keep_Ng = kernels.topk_indices(group_NG, topk_group)
    mask_NG = torch.zeros_like(group_NG, dtype=torch.bool).scatter_(1, keep_Ng, True)
    mask_NE = mask_NG[:, :, None].expand(n, n_group, e // n_group).reshape(n, e)
    return choice_NE.masked_fill(~mask_NE, float("-inf"))


class DeepseekMoE(nn.Module):
    """transformers' DeepseekV3MoE with per-expert parameter names as its checkpoints store them
    (mlp.experts.<e>.{gate,up,down}_proj, mlp.shared_experts.*, mlp.gate.*)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = TopkRouter(args)
        self.experts = Experts(MLP(args.hidden_size, args.moe_intermediate_size) for _ in range(args.num_experts))
        self.shared_experts = (MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)
                               if args.n_shared_experts else None)

    def forward(self, x_ND, routing, moe_idx: int):
        idx_Nk, w_Nk = self.gate(x_ND, routing, moe_idx)
        out_ND = run_experts(self.experts, x_ND, idx_Nk, w_Nk)
        if self.shared_experts is not None:
            out_ND = out_ND + self.shared_experts(x_ND)
        return out_ND


# ---- the checkpoint's MTP (nextn) layer -------------------------------------------------------------------
# DeepSeek-V3 ships its MTP module as one more decoder layer, model.layers.<num_hidden_layers>, with
# enorm / hnorm / eh_proj / shared_head.norm beside the decoder layer's own weights and copies of the
# embedding and LM head (embed_tokens, shared_head.head). It computes what Lockstep's MTP head
# (pipeline/models/mtp.py) computes: eh_proj([enorm(embedding of token i+1), hnorm(hidden state i)]), the
# decoder layer, shared_head.norm, the shared LM head. Inside Lockstep it carries the head's `mtp.*`
# names; checkpoints read and written keep DeepSeek's.
NEXTN_TO_MTP = {"enorm.": "mtp.pre_fc_norm_embedding.", "hnorm.": "mtp.pre_fc_norm_hidden.", "eh_proj.": "mtp.fc.",
                "shared_head.norm.": "mtp.norm."}
NEXTN_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def nextn_to_mtp(state: dict[str, torch.Tensor], args: ModelArgs, mtp_layers: int | None):
    """A DeepSeek-V3 checkpoint's state and args as load_model builds them: the nextn layer's weights
    under the MTP head's names (its embedding and LM-head copies dropped: the head shares the model's),
    or dropped when mtp_layers is 0. A config that names a nextn layer the checkpoint lacks
    (transformers writes num_nextn_predict_layers=1 and no such layer) has no MTP head (load_model
    adds a fresh one if one is asked for)."""
    import dataclasses

    prefix = f"model.layers.{args.num_hidden_layers}."
    nextn = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    state = {k: v for k, v in state.items() if not _beyond_layers(k, args.num_hidden_layers)}
    if args.mtp_num_hidden_layers and not nextn:
        args = dataclasses.replace(args, mtp_num_hidden_layers=0)
    if nextn and mtp_layers != 0 and args.mtp_num_hidden_layers:
        for rest, t in nextn.items():
            if rest not in NEXTN_COPIES:
                state[_mtp_name(rest)] = t
    return state, args


def mtp_to_nextn(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The reverse, for an export: mtp.* as model.layers.<num_hidden_layers>.*, with the embedding and
    LM-head copies DeepSeek's checkpoints (and SGLang's NEXTN loader) carry."""
    prefix = f"model.layers.{args.num_hidden_layers}."
    out = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    mtp = {k: v for k, v in state.items() if k.startswith("mtp.")}
    if not mtp:
        return out
    back = {v: k for k, v in NEXTN_TO_MTP.items()}
    for name, t in mtp.items():
        rest = next((back[m] + name[len(m):] for m in back if name.startswith(m)), None)
        out[prefix + (rest if rest is not None else name.removeprefix("mtp.layers.0."))] = t
    for copy, source in NEXTN_COPIES.items():
        src = state.get(source, state["model.embed_tokens.weight"])  # a tied LM head is the embedding
        out[prefix + copy] = src.clone()  # a copy on disk (safetensors refuses shared storage)
    return out


def _mtp_name(rest: str) -> str:
    for theirs, ours in NEXTN_TO_MTP.items():
        if rest.startswith(theirs):
            return ours + rest[len(theirs):]
    return "mtp.layers.0." + rest


def _beyond_layers(name: str, n: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= n
