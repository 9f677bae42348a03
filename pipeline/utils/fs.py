"""Atomic writes on a shared filesystem (Lustre, GPFS, NFS): temp name -> flush -> fsync -> rename.

Readers only ever look for final names, so a crash leaves either the old state or the new one,
never a half-written file under a name somebody trusts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(path: str) -> str:
    """A hidden sibling name that readers ignore (starts with '.', ends with '.tmp')."""
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}.{uuid.uuid4().hex[:8]}.tmp")


def atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path) or ".")


def atomic_write_json(path: str, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def read_json_object(path: str) -> dict:
    """A JSON file a user brings (config.json, tokenizer_config.json, ...) that must hold one object; a
    UserError naming the file and what is wrong with it otherwise (missing, a directory, not UTF-8, not
    JSON, not an object)."""
    from pipeline.errors import UserError

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path!r} not found") from None
    except IsADirectoryError:
        raise UserError(f"{path!r} is a directory, not a JSON file") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path!r} is not UTF-8 text (byte {e.start}): a binary or damaged file?") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path!r} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg}): a truncated or"
                        " hand-edited file?") from None
    if not isinstance(data, dict):
        raise UserError(f"{path!r} holds a JSON {type(data).__name__}, not an object of fields")
    return data


@contextlib.contextmanager
def atomic_dir(path: str):
    """Yield a temp directory next to `path`; on success fsync it and rename it to `path`.

    An existing `path` is replaced (moved aside first, then removed), so readers see the old or the
    new directory, never a mix.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    try:
        yield tmp
        for name in os.listdir(tmp):
            fp = os.path.join(tmp, name)
            if os.path.isfile(fp):
                with open(fp, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(tmp)
        old = None
        if os.path.exists(path):
            old = tmp_name(path)
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(parent)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
