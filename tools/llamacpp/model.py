"""Tiny deterministic GGUF models for a real llama-server: seeded random weights, a real tokenizer.

No model hub is reachable, and none is needed to measure a server: a `llama`-architecture model with random
f16 weights loads, tokenizes, prefills and decodes like a trained one of its size; only its text is gibberish
(and it rarely emits EOS, so completions run to `max_tokens`). The tokenizer (every `tokenizer.*` key) is
copied from a vocab-only GGUF of the llama.cpp tree, and a ChatML template is added so that
`/v1/chat/completions` works. The same spec, seed and vocab always write the same bytes, and the file is cached
under a key of all three (and the `gguf` package's version).

Needs the `gguf` package (in the test extras), imported only when a model is written.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from tools.llamacpp.build import cache_root

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    layers: int = 4
    dim: int = 256
    heads: int = 8
    ffn: int = 768
    context: int = 4096
    seed: int = 26

    @property
    def name(self) -> str:
        return f"tiny-llama-{self.layers}x{self.dim}"


TINY = ModelSpec()  # 40 MB: loads in ~0.1 s, a 1,000-token prompt prefills in ~0.2 s on 2 cores
# The tiny one with room for prompts over 4,096 tokens (a slot's context is capped at the model's).
LONG = ModelSpec(context=8192)
# 121 MB: prefill ~4x the tiny one's, so that a prompt cache's effect stands out of a shared machine's noise.
SMALL = ModelSpec(layers=8, dim=512, heads=8, ffn=1536)


def model_path(spec: ModelSpec, vocab: Path) -> Path:
    """Where `spec` with `vocab`'s tokenizer is (or will be) cached."""
    material = json.dumps({"spec": asdict(spec), "vocab": _digest(vocab), "gguf": metadata.version("gguf")})
    key = hashlib.sha256(material.encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{spec.name}-{key}.gguf"


def ensure_model(spec: ModelSpec, vocab: Path) -> Path:
    """The cached model file, written first if it is not there (to a temporary name, then renamed)."""
    path = model_path(spec, vocab)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        _write(spec, vocab, partial)
        partial.rename(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(spec: ModelSpec, vocab: Path, path: Path) -> None:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(vocab)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab_size = len(tokens.data)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(spec.name)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.dim)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.heads)
    writer.add_rope_dimension_count(spec.dim // spec.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.") and name != "tokenizer.chat_template":
            _copy(writer, name, field)
    writer.add_chat_template(CHATML)

    rng = np.random.default_rng(spec.seed)

    def weight(*shape: int) -> Any:
        # Small and centred, so that activations stay finite through the layers (no NaN logits).
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    def norm() -> Any:
        return np.ones(spec.dim, dtype=np.float32)

    # numpy shapes are (rows, columns): ggml's dimensions reversed.
    writer.add_tensor("token_embd.weight", weight(vocab_size, spec.dim))
    for layer in range(spec.layers):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", norm())
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{part}.weight", weight(spec.dim, spec.dim))
        writer.add_tensor(f"{block}.ffn_norm.weight", norm())
        writer.add_tensor(f"{block}.ffn_gate.weight", weight(spec.ffn, spec.dim))
        writer.add_tensor(f"{block}.ffn_up.weight", weight(spec.ffn, spec.dim))
        writer.add_tensor(f"{block}.ffn_down.weight", weight(spec.dim, spec.ffn))
    writer.add_tensor("output_norm.weight", norm())
    writer.add_tensor("output.weight", weight(vocab_size, spec.dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _copy(writer: Any, name: str, field: Any) -> None:
    """One key of the vocab file, with its own GGUF type (an array keeps its element type)."""
    import gguf

    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
    else:
        writer.add_key_value(name, field.contents(), kind)
