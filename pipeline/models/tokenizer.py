"""Tokenizers: load a real model's tokenizer.json (+ tokenizer_config.json), or build the tiny one.

Token ids are the currency of the pipeline (TITO): prompts are encoded once by the rollout manager,
engines return token ids, and the trainer trains on exactly those ids. Text is only for humans and
reward functions; a response is never decoded and re-encoded for training.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pipeline.errors import UserError

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
TINY_CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz +-*=?:.,()<>\n")


@dataclass
class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the special ids the pipeline needs."""

    backend: object  # tokenizers.Tokenizer
    eos_token_id: int
    pad_token_id: int
    bos_token_id: int | None = None
    chat_template: str | None = None
    unk_token_id: int | None = None  # what text the vocabulary lacks becomes (the tiny tokenizer's <unk>)

    @property
    def special_ids(self) -> set[int]:
        return {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the checkpoint's Jinja chat template (generation prompt appended unless
        add_generation_prompt is false)."""
        if not self.chat_template:
            raise UserError("data.apply_chat_template is true but the tokenizer has no chat_template")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt)


def load_tokenizer(model_dir: str) -> Tokenizer:
    """Load tokenizer.json the way a Hugging Face checkpoint ships it."""
    from tokenizers import Tokenizer as HFTokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise UserError(f"no tokenizer.json in {model_dir!r}: the model directory needs its tokenizer files")
    from pipeline.utils.fs import read_json_object

    try:
        backend = HFTokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises a bare Exception for any unreadable file
        raise UserError(f"{path!r} cannot be read as a tokenizer ({str(e).splitlines()[0] if str(e) else type(e).__name__}):"
                        " a truncated download?") from None
    cfg = {}
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        cfg = read_json_object(cfg_path)

    def special(name: str) -> int | None:
        tok = cfg.get(name)
        if isinstance(tok, dict):
            tok = tok.get("content")
        return backend.token_to_id(tok) if tok else None

    eos = special("eos_token")
    gen_cfg = os.path.join(model_dir, "generation_config.json")
    if eos is None and os.path.exists(gen_cfg):
        e = read_json_object(gen_cfg).get("eos_token_id")
        eos = e[0] if isinstance(e, list) else e
    if eos is None:
        raise UserError(f"{model_dir!r}: tokenizer_config.json names no eos_token; add one")
    pad = special("pad_token")
    return Tokenizer(
        backend=backend,
        eos_token_id=eos,
        pad_token_id=pad if pad is not None else eos,
        bos_token_id=special("bos_token"),
        chat_template=read_chat_template(model_dir, cfg),
        unk_token_id=special("unk_token"),
    )


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def read_chat_template(model_dir: str, tokenizer_cfg: dict) -> str | None:
    """The checkpoint's chat template: chat_template.jinja (where transformers 5 saves it), else
    tokenizer_config.json's chat_template (a string, or a list of named templates: the "default" one)."""
    path = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = tokenizer_cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer(out_dir: str) -> Tokenizer:
    """A character-level tokenizer for the synthetic tasks, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + TINY_CHARS)}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in TINY_SPECIALS])
    os.makedirs(out_dir, exist_ok=True)
    backend.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "chat_template": TINY_CHAT_TEMPLATE,
        "model_max_length": 512,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return load_tokenizer(out_dir)
