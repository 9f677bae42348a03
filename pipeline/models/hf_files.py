"""The weight files of a Hugging Face checkpoint directory, read without torch (the launcher's checks):
which safetensors files there are, the tensor names their headers list, and whether the headers agree
with config.json (layers, embedding shape).
"""

from __future__ import annotations

import json
import os
import re

from pipeline.errors import UserError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# Buffers older transformers saved beside the weights; transformers itself ignores them on loading.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def weight_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files (the index's shards, or the single file); a UserError naming the
    problem when the index is unreadable or a shard it names is missing."""
    index = os.path.join(model_dir, INDEX_NAME)
    if os.path.exists(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{index!r} is not a safetensors index ({type(e).__name__}: {e})") from None
        missing = [n for n in files if not os.path.isfile(os.path.join(model_dir, n))]
        if missing:
            raise UserError(f"{model_dir!r}: {INDEX_NAME} names {len(missing)} shard(s) that are not there"
                            f" ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): an incomplete download?")
        return files
    if os.path.exists(os.path.join(model_dir, SINGLE_NAME)):
        return [SINGLE_NAME]
    raise UserError(f"{model_dir!r} has no {SINGLE_NAME} or {INDEX_NAME}")


def weight_names(model_dir: str) -> dict[str, str]:
    """Tensor name -> the file holding it, from the files' headers alone (no tensor is read): a UserError
    naming a file that is not a readable safetensors file (truncated, or not safetensors at all)."""
    from safetensors import safe_open

    names: dict[str, str] = {}
    for file in weight_files(model_dir):
        try:
            with safe_open(os.path.join(model_dir, file), framework="numpy") as f:
                names.update(dict.fromkeys(f.keys(), file))
        except Exception as e:  # SafetensorError, OSError: any of them means an unreadable file
            raise UserError(f"{os.path.join(model_dir, file)!r} is not a readable safetensors file (truncated or"
                            f" incomplete download?): {e}") from None
    return names


LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
EMBED_NAME = "model.embed_tokens.weight"


def tensor_shapes(model_dir: str, names: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from its file's header (nothing read), each file opened once."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(names.values())):
        with safe_open(os.path.join(model_dir, file), framework="numpy") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


# The shape config.json gives a tensor, for the names whose rule holds in every family Lockstep reads
# (tests/test_user_inputs.py checks each rule against the model's own state dict for every family and
# preset). Names without a rule (MLA's projections, biases, MTP heads, FP8 scales) are left to the loader.
def _shape_rules(a) -> dict[str, tuple[int, ...]]:
    attn_out = a.num_attention_heads * (a.v_head_dim if a.is_mla else a.head_dim)
    rules = {
        "input_layernorm.weight": (a.hidden_size,), "post_attention_layernorm.weight": (a.hidden_size,),
        "self_attn.o_proj.weight": (a.hidden_size, attn_out),
        "mlp.gate_proj.weight": (a.intermediate_size, a.hidden_size),
        "mlp.up_proj.weight": (a.intermediate_size, a.hidden_size),
        "mlp.down_proj.weight": (a.hidden_size, a.intermediate_size),
    }
    if not a.is_mla:
        rules.update({
            "self_attn.q_proj.weight": (a.num_attention_heads * a.head_dim, a.hidden_size),
            "self_attn.k_proj.weight": (a.num_key_value_heads * a.head_dim, a.hidden_size),
            "self_attn.v_proj.weight": (a.num_key_value_heads * a.head_dim, a.hidden_size),
            "self_attn.q_norm.weight": (a.head_dim,), "self_attn.k_norm.weight": (a.head_dim,),
        })
    if a.num_experts:
        rules["mlp.gate.weight"] = (a.num_experts, a.hidden_size)
        for proj in ("gate_proj", "up_proj"):
            rules[f"mlp.experts.*.{proj}.weight"] = (a.moe_intermediate_size, a.hidden_size)
        rules["mlp.experts.*.down_proj.weight"] = (a.hidden_size, a.moe_intermediate_size)
    return rules


EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def expected_shape(name: str, args, rules: dict[str, tuple[int, ...]] | None = None) -> tuple[int, ...] | None:
    """The shape config.json (`args`: its ModelArgs) gives the decoder tensor `name`; None where no rule
    here covers it (`rules`: _shape_rules(args), when the caller asks for many names). Pure."""
    if name == EMBED_NAME or name == "lm_head.weight":
        return (args.vocab_size, args.hidden_size)
    if name == "model.norm.weight":
        return (args.hidden_size,)
    m = LAYER_NAME.match(name)
    if not m or int(m.group(1)) >= args.num_hidden_layers:
        return None
    return (rules or _shape_rules(args)).get(EXPERT_INDEX.sub(".experts.*.", name[m.end():]))


def shape_mismatch(shapes: dict[str, tuple[int, ...]], args) -> str | None:
    """The first tensor whose shape in the headers (`shapes`) is not the one config.json gives it, as one
    line naming it and how many differ; None when all agree. Pure."""
    rules = _shape_rules(args)
    wrong = []
    for name, shape in shapes.items():
        want = expected_shape(name, args, rules)
        if want is not None and tuple(shape) != want:
            wrong.append((name, tuple(shape), want))
    if not wrong:
        return None
    name, got, want = wrong[0]
    more = f" ({len(wrong)} tensors differ)" if len(wrong) > 1 else ""
    return (f"{name} is {' x '.join(map(str, got))} in the weights, but config.json gives"
            f" {' x '.join(map(str, want))}{more}: a config.json of another model?")


def config_mismatch(names: dict[str, str], embed_shape: list[int] | None, layers: int, vocab: int,
                    hidden: int, mtp_layers: int = 0) -> str | None:
    """Why the weights cannot be the model config.json describes (its decoder layers, its MTP layers,
    which DeepSeek numbers after the decoder's, its vocabulary and width), as the tensor names and the
    embedding's shape show; None when they can be. Pure. MTP layers config.json names but the weights lack
    are not a mismatch (checkpoints are often published without them; the loader says what they are for)."""
    have = {int(m.group(1)) for n in names if (m := LAYER_NAME.match(n))}
    if have:
        missing = sorted(set(range(layers)) - have)
        if missing:
            return (f"config.json says num_hidden_layers: {layers}, but the weights have no layer"
                    f" {', '.join(map(str, missing[:3]))}{', ...' if len(missing) > 3 else ''} (they hold layers"
                    f" 0-{max(have)}): a config.json of another model?")
        if max(have) >= layers + mtp_layers:
            return (f"the weights hold layers 0-{max(have)}, but config.json says num_hidden_layers: {layers}"
                    f"{f' (+ {mtp_layers} MTP)' if mtp_layers else ''}: a config.json of another model?")
    if embed_shape is not None and embed_shape != [vocab, hidden]:
        return (f"{EMBED_NAME} is {embed_shape[0]} x {embed_shape[1]}, but config.json says vocab_size {vocab},"
                f" hidden_size {hidden}: a config.json of another model?")
    return None


def head_differs(embedding, lm_head) -> bool:
    """Whether a saved lm_head.weight (a torch tensor, None when not saved) is not the embedding it is
    tied to: transformers then keeps it untied, and dropping it would train another model."""
    import torch  # late: the launcher's checks import this module without torch

    if embedding is None or lm_head is None:
        return False
    return embedding.shape != lm_head.shape or not torch.equal(embedding, lm_head)


def tied_head_differs(model_dir: str, names: dict[str, str]) -> bool:
    """head_differs on the checkpoint's files: reads those two tensors only (as torch tensors: numpy has
    no bfloat16); False when either is absent."""
    from safetensors import safe_open

    embed, head = EMBED_NAME, "lm_head.weight"
    if embed not in names or head not in names:
        return False
    tensors = []
    for name in (embed, head):
        with safe_open(os.path.join(model_dir, names[name]), framework="pt") as f:
            tensors.append(f.get_tensor(name))
    return head_differs(*tensors)


def tied_head_error(source: str) -> UserError:
    return UserError(f"{source}: config.json says tie_word_embeddings: true, but the checkpoint's lm_head.weight differs"
                     " from model.embed_tokens.weight: set \"tie_word_embeddings\": false in config.json (what"
                     " transformers loads), or remove lm_head.weight")
