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


def tensor_shape(model_dir: str, names: dict[str, str], name: str) -> list[int] | None:
    """A tensor's shape from its file's header (nothing read); None when the checkpoint has no such tensor."""
    from safetensors import safe_open

    if name not in names:
        return None
    with safe_open(os.path.join(model_dir, names[name]), framework="numpy") as f:
        return list(f.get_slice(name).get_shape())


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
