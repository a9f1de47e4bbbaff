"""Compressed native checkpoints (`infire-jax compress`).

A compressed checkpoint is a directory:

    compressed_manifest.json   written last, with its own CRC32: format, model config and name,
                               each tensor's codec, shape and the CRC32 of its bfloat16 bytes,
                               and every other file's size and SHA-256
    weights.safetensors        raw tensors (bfloat16 bits as uint16) and the compressed parts,
                               "<name>::<part>" (compression/palette.py, compression/entropy.py)
    tokenizer.json, tokenizer_config.json

Loading checks every file's size and SHA-256 before reading it, and every decoded tensor's CRC32,
so a damaged or truncated checkpoint is refused with an error that names the file or tensor,
never served as wrong weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zlib
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from infire_jax.compression import (
    BF16, FORMATS, KINDS, EntropyTensor, PaletteTensor, as_bf16, decode_entropy, decode_palette, encode_entropy,
    encode_palette, kind_of, selected)
from infire_jax.errors import ConfigError, CorruptCheckpointError, UnsupportedModelError
from infire_jax.loaders.weights import LoadedModel
from infire_jax.models.config import ModelConfig
from infire_jax.loaders.tokenizer import Tokenizer

FORMAT = "infire-jax-compressed"
FORMAT_VERSION = 2  # 2: MLA's W_uk [H, Dn, R], W_uv [H, R, Dv] (loaders/weights.py NATIVE_FORMAT_VERSION)
MANIFEST = "compressed_manifest.json"
WEIGHTS = "weights.safetensors"
_SEP = "::"


def is_compressed_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


# ---- writing -------------------------------------------------------------------------------------

def host_weights(model: LoadedModel) -> Mapping[str, np.ndarray]:
    """The model's host weights; a `dummy:` model's are drawn (on the device) and copied here."""
    if model.weights is not None:
        return model.weights
    from infire_jax.models.registry import drawn_weights

    return drawn_weights(model.config, jnp.bfloat16, seed=model.random_seed)


def write_compressed(model: LoadedModel, out: str, fmt: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """Writes `model` in bfloat16 with the selected kinds' weights in `fmt`; returns the manifest's
    tensor table (codec, bytes before and after, per tensor)."""
    from safetensors.numpy import save_file

    if fmt not in FORMATS:
        raise ConfigError(f"unknown compression format {fmt!r}; choose from {list(FORMATS)}")
    if os.path.exists(out) and os.listdir(out):
        raise ConfigError(f"{out} exists and is not empty")
    weights = host_weights(model)
    chosen = set(selected(list(weights), kinds))
    parts: dict[str, np.ndarray] = {}
    tensors: dict[str, Any] = {}
    for name in sorted(weights):
        x = as_bf16(weights[name])
        entry = {"shape": list(x.shape), "crc32": zlib.crc32(np.ascontiguousarray(x).view(np.uint16).data),
                 "bytes": x.nbytes, "kind": kind_of(name)}
        if name in chosen:
            stacked = name.startswith("layers.")
            t = encode_palette(x, stacked=stacked, name=name) if fmt == "palette" else encode_entropy(x)
            parts.update({f"{name}{_SEP}{part}": a for part, a in t.arrays().items()})
            entry.update(codec=fmt, stacked=stacked, stored_bytes=t.nbytes)
        else:
            parts[name] = np.ascontiguousarray(x).view(np.uint16)
            entry.update(codec="raw", stored_bytes=x.nbytes)
        tensors[name] = entry
    tmp = f"{out.rstrip(os.sep)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(parts, os.path.join(tmp, WEIGHTS))
    model.tokenizer.save(tmp)
    body = {"format": FORMAT, "format_version": FORMAT_VERSION, "name": model.name,
            "config": model.config.to_dict(), "tensors": tensors,
            "files": {rel: _file_record(os.path.join(tmp, rel)) for rel in sorted(os.listdir(tmp))}}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"crc32": _json_crc32(body), "body": body}, f)
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(tmp, out)
    return tensors


def size_summary(tensors: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """(bfloat16 bytes, stored bytes) per kind of weight, other weights, and the whole model."""
    out = {key: (0, 0) for key in (*KINDS, "other", "model")}
    for entry in tensors.values():
        for key in (entry["kind"] or "other", "model"):
            before, after = out[key]
            out[key] = (before + entry["bytes"], after + entry["stored_bytes"])
    return {k: v for k, v in out.items() if v[0]}


def _file_record(path: str) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return {"size": os.path.getsize(path), "sha256": h.hexdigest()}


def _json_crc32(data: dict) -> int:
    return zlib.crc32(json.dumps(data, sort_keys=True).encode())


# ---- reading -------------------------------------------------------------------------------------

def _manifest(path: str) -> dict[str, Any]:
    where = os.path.join(path, MANIFEST)
    try:
        with open(where) as f:
            doc = json.load(f)
        body = doc["body"]
        ok = doc.get("crc32") == _json_crc32(body)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{where} is unreadable: {e}") from e
    if not ok:
        raise CorruptCheckpointError(f"{where} fails its CRC32")
    if body.get("format") != FORMAT or body.get("format_version") != FORMAT_VERSION:
        raise UnsupportedModelError(f"{where} has format {body.get('format')} v{body.get('format_version')}, "
                                    f"expected {FORMAT} v{FORMAT_VERSION}")
    return body


def read_compressed_config(path: str) -> ModelConfig:
    return ModelConfig.from_dict(_manifest(path)["config"])


def _verify_files(path: str, files: Mapping[str, Any]) -> None:
    for rel, want in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CorruptCheckpointError(f"{full} is missing")
        size = os.path.getsize(full)
        if size != want["size"]:
            raise CorruptCheckpointError(f"{full} has {size} bytes, expected {want['size']} (truncated or replaced)")
        if _file_record(full)["sha256"] != want["sha256"]:
            raise CorruptCheckpointError(f"{full} fails its SHA-256 checksum")


def _decode(name: str, entry: Mapping[str, Any], parts: Mapping[str, np.ndarray], where: str) -> np.ndarray:
    """One tensor as bfloat16, checked against its recorded shape and CRC32."""
    codec = entry["codec"]
    try:
        if codec == "raw":
            x = parts[name].view(BF16)
        else:
            cls = PaletteTensor if codec == "palette" else EntropyTensor
            fields = {f: parts[f"{name}{_SEP}{f}"] for f in cls.__dataclass_fields__ if f != "stacked"}
            x = (decode_palette(PaletteTensor(**fields, stacked=entry["stacked"])) if codec == "palette"
                 else decode_entropy(EntropyTensor(**fields)))
    except (KeyError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: tensor {name!r} ({codec}) cannot be decoded: {e}") from e
    if list(x.shape) != entry["shape"] or zlib.crc32(np.ascontiguousarray(x).view(np.uint16).data) != entry["crc32"]:
        raise CorruptCheckpointError(f"{where}: tensor {name!r} decodes to wrong weights (shape or CRC32)")
    return x


def load_compressed(path: str) -> LoadedModel:
    """The model in bfloat16 on the host, every file and tensor verified first."""
    from safetensors.numpy import load_file

    body = _manifest(path)
    _verify_files(path, body["files"])
    where = os.path.join(path, WEIGHTS)
    parts = load_file(where)
    weights = {name: _decode(name, entry, parts, where) for name, entry in body["tensors"].items()}
    return LoadedModel(config=ModelConfig.from_dict(body["config"]), tokenizer=Tokenizer.from_dir(path),
                       name=body["name"], weights=weights)

