"""KV-cache size calculator: bytes per token, sequence and block for a model shape.

Every layer stores one key and one value vector per KV head per token, so
``bytes_per_token = layers * kv_heads * (head_size + head_size_v) * dtype_bytes`` (the value
head size is the key's but for MLA models run expanded). A multi-head latent attention
model's latent cache stores one row of ``latent_size`` values per token and layer instead
(``layers * latent_size * dtype_bytes``, a per-token format's row with its one scale: the
ops read it as keys and its leading columns as values); the report gives the expanded size
beside it.

A model with sliding-window layers (a ``layer_pattern`` of sliding : full layers) keeps
them in KV groups of their own (:mod:`paged_attention_ext.kv_groups`) that hold only
their window; chunked-attention layers (``attention_chunk_size``, Llama-4: the pattern's
first count is then chunked layers) hold only their current chunk. The report then counts each group's blocks as the block manager holds them
while a sequence decodes, beside one block table for every layer (the layout without
KV groups).

A hybrid model with linear-attention layers (Qwen3.5, Qwen3-Next: ``linear_layers`` gated
DeltaNet layers beside ``layers`` full-attention ones) keeps K/V for the full layers only
and one fixed-size state per linear layer and sequence (:mod:`paged_attention_ext.state_slots`):
the report splits a sequence's bytes into paged K/V and fixed state, beside what it would
take if every layer kept K/V.

Gemma-4 shapes add full-attention layers of another shape (``full_kv_heads``,
``full_head_size``: ``num_global_key_value_heads``, ``global_head_dim``) and trailing layers
that reuse an earlier layer's K/V (``kv_shared_layers``) and store nothing. Their groups hold
layers of one shape each and are sized by bytes; the report compares them with one pool
shape for every layer (each layer stored as large as the largest, one table).

The per-token formats (``int8_per_token_head``, ``int4_per_token_head``) store each row of
``head_size`` values with its scales: ``head_size + 4`` and ``head_size / 2 + 8`` bytes
(:func:`paged_attention_ext.token_quantization.bytes_per_token_head`), counted wherever a
row's bytes are.
"""

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from ..block_manager import BlockSpaceManager
from ..token_quantization import TOKEN_FORMATS, bytes_per_token_head
from ..kv_groups import (Chunked, KVGroupLayout, LayerShape, Window, first_visible_position,
                         trailing_readers)

GIB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_size: int
    sliding_window: Optional[int] = None
    # (sliding, full) layers, repeating from layer 0; (1, 0): every layer sliding.
    layer_pattern: Tuple[int, int] = (0, 1)
    # MLA: the expanded value head size (None: head_size) and the latent row
    # (kv_lora_rank + qk_rope_head_dim) that replaces a layer's K/V in a latent cache.
    head_size_v: Optional[int] = None
    latent_size: Optional[int] = None
    # Chunked local attention (Llama-4): the pattern's first count is chunked layers.
    attention_chunk_size: Optional[int] = None
    # Linear-attention layers beside the ``layers`` that keep K/V, and the values each keeps
    # per sequence (convolution window and recurrent matrix: :func:`gated_deltanet_state`).
    linear_layers: int = 0
    linear_state_values: int = 0
    # Gemma-4: the full-attention layers' KV heads and head size where they differ, and the
    # trailing layers that reuse an earlier layer's K/V (they store nothing).
    full_kv_heads: Optional[int] = None
    full_head_size: Optional[int] = None
    kv_shared_layers: int = 0

    def expanded_layer_bytes(self, dtype: str) -> int:
        """Bytes one layer stores per token as K/V per head (the largest layer's, where
        layers differ)."""
        return max(layer_bytes(dtype, shape) for shape in self.layer_shapes())

    def layer_shapes(self) -> List[LayerShape]:
        """Each layer's (KV heads, key head size, value head size)."""
        sliding = (self.kv_heads, self.head_size, self.head_size_v or self.head_size)
        full_size = self.full_head_size or self.head_size
        full = (self.full_kv_heads or self.kv_heads, full_size,
                full_size if self.full_head_size else self.head_size_v or self.head_size)
        return [sliding if window else full for window in self.windows()]

    @property
    def is_heterogeneous(self) -> bool:
        """Layers differ in shape, or some store nothing."""
        return len(set(self.layer_shapes())) > 1 or self.kv_shared_layers > 0

    def readers(self) -> Dict[int, int]:
        """Layers that store nothing -> the layer whose K/V they read."""
        return trailing_readers(self.windows(), self.kv_shared_layers)

    def stored_bytes(self, dtype: str) -> int:
        """Bytes all layers store per token (K/V per head; readers store none)."""
        readers = self.readers()
        return sum(layer_bytes(dtype, shape) for layer, shape in enumerate(self.layer_shapes())
                   if layer not in readers)

    def windows(self) -> List[Window]:
        """Each layer's window (None: full attention; Chunked: chunked local attention)."""
        local, full = self.layer_pattern
        window: Window = (Chunked(self.attention_chunk_size) if self.attention_chunk_size
                          else self.sliding_window)
        if window is None or local == 0:
            return [None] * self.layers
        period = local + full
        return [window if i % period < local else None for i in range(self.layers)]


def window_label(window: Window) -> str:
    """A KV group's kind in words."""
    if window is None:
        return "full attention"
    if isinstance(window, Chunked):
        return f"chunks of {window.size}"
    return f"window {window}"


def gated_deltanet_state(key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                         conv_kernel: int) -> int:
    """Values one gated-DeltaNet layer keeps per sequence, as transformers keeps them: the
    convolution window (q, k and v channels, ``conv_kernel`` tokens) and the recurrent
    matrix (``key_dim x value_dim`` per value head)."""
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    return channels * conv_kernel + value_heads * key_dim * value_dim


# Published configurations (config.json of each model).
PRESETS: Dict[str, ModelShape] = {
    "llama-2-7b": ModelShape(layers=32, kv_heads=32, head_size=128),
    "llama-2-13b": ModelShape(layers=40, kv_heads=40, head_size=128),
    "llama-2-70b": ModelShape(layers=80, kv_heads=8, head_size=128),
    "llama-3-8b": ModelShape(layers=32, kv_heads=8, head_size=128),
    "mistral-7b": ModelShape(layers=32, kv_heads=8, head_size=128),
    "qwen2-7b": ModelShape(layers=28, kv_heads=4, head_size=128),
    "opt-13b": ModelShape(layers=40, kv_heads=40, head_size=128),  # the vLLM paper's model
    # Sliding-window layers beside full ones (their KV groups: docs/kv_groups.md).
    "gemma-3-27b": ModelShape(62, 16, 128, sliding_window=1024, layer_pattern=(5, 1)),
    "gemma-3-1b": ModelShape(26, 1, 256, sliding_window=512, layer_pattern=(5, 1)),
    "gpt-oss-120b": ModelShape(36, 8, 64, sliding_window=128, layer_pattern=(1, 1)),
    "gemma-2-9b": ModelShape(42, 8, 256, sliding_window=4096, layer_pattern=(1, 1)),
    "cohere-2-7b": ModelShape(32, 8, 128, sliding_window=4096, layer_pattern=(3, 1)),
    "mistral-7b-v0.1": ModelShape(32, 8, 128, sliding_window=4096, layer_pattern=(1, 0)),
    # Chunked local attention beside NoPE full layers (every 4th).
    "llama-4-scout": ModelShape(48, 8, 128, attention_chunk_size=8192, layer_pattern=(3, 1)),
    # Gemma-4 as its model cards describe it: sliding layers of head 256, full layers of head
    # 512. 31B: full layers K=V with 4 KV heads (stored as two tensors, see docs/kv_groups.md);
    # E4B: the last 18 layers reuse K/V.
    "gemma-4-31b": ModelShape(60, 16, 256, sliding_window=1024, layer_pattern=(5, 1),
                              full_kv_heads=4, full_head_size=512),
    "gemma-4-e4b": ModelShape(42, 2, 256, sliding_window=512, layer_pattern=(5, 1),
                              full_head_size=512, kv_shared_layers=18),
    # Multi-head latent attention: expanded per query head (keys 128 + 64 RoPE, values 128)
    # or latent rows of 512 + 64.
    "deepseek-v3": ModelShape(61, 128, 192, head_size_v=128, latent_size=576),
    "deepseek-v2-lite": ModelShape(27, 16, 192, head_size_v=128, latent_size=576),
    "kimi-k2": ModelShape(61, 64, 192, head_size_v=128, latent_size=576),
    # Gated DeltaNet beside gated full attention, 3 : 1 (K/V: the full layers only; a state
    # per linear layer and sequence: docs/linear_attention.md).
    "qwen3.5-35b-a3b": ModelShape(10, 2, 256, linear_layers=30,
                                  linear_state_values=gated_deltanet_state(16, 32, 128, 128, 4)),
    "qwen3-next-80b-a3b": ModelShape(12, 2, 256, linear_layers=36,
                                     linear_state_values=gated_deltanet_state(16, 32, 128, 128, 4)),
}

# fp8 names as the caches' kv_cache_dtype takes them (docs/fp8.md); "fp8" is fp8_e4m3.
DTYPE_BYTES: Dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
                               "fp8_e5m2": 1}
# Every dtype the calculator takes: the above, and the per-token formats (a row's bytes:
# row_bytes).
DTYPES: List[str] = sorted(DTYPE_BYTES) + list(TOKEN_FORMATS)


def resolve_shape(preset: Optional[str] = None, layers: Optional[int] = None,
                  kv_heads: Optional[int] = None, head_size: Optional[int] = None,
                  sliding_window: Optional[int] = None,
                  layer_pattern: Optional[Tuple[int, int]] = None,
                  attention_chunk_size: Optional[int] = None) -> ModelShape:
    """A preset's shape with any explicitly given field overriding it; no preset needs all three
    sizes (a window needs a pattern, default every layer sliding)."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    base = asdict(PRESETS[preset]) if preset else {}
    given = {k: v for k, v in dict(layers=layers, kv_heads=kv_heads, head_size=head_size,
                                   sliding_window=sliding_window, layer_pattern=layer_pattern,
                                   attention_chunk_size=attention_chunk_size).items()
             if v is not None}
    fields = {**base, **given}
    missing = [k for k in ("layers", "kv_heads", "head_size") if k not in fields]
    if missing:
        raise ValueError("give --preset or all of --layers --kv-heads --head-size "
                         f"(missing: {', '.join(missing)})")
    bad = [k for k in ("layers", "kv_heads", "head_size", "sliding_window", "attention_chunk_size")
           if fields.get(k) is not None and fields[k] < 1]
    if bad:
        raise ValueError(f"{', '.join(bad)} must be >= 1")
    pattern = tuple(fields.get("layer_pattern", (0, 1)))
    if len(pattern) != 2 or min(pattern) < 0 or sum(pattern) < 1:
        raise ValueError(f"layer_pattern must be (sliding, full) layer counts, got {pattern}")
    if fields.get("sliding_window") is not None and fields.get("attention_chunk_size") is not None:
        raise ValueError("give sliding_window or attention_chunk_size, not both: the pattern's "
                         "local layers either slide or attend within chunks")
    local = "sliding_window" if fields.get("attention_chunk_size") is None else "attention_chunk_size"
    if fields.get(local) is not None and "layer_pattern" not in fields:
        fields["layer_pattern"] = (1, 0)  # a window alone: every layer slides (Mistral v0.1)
    if pattern[0] and fields.get(local) is None:
        raise ValueError(f"layer_pattern {pattern} has sliding layers: give sliding_window "
                         "(or attention_chunk_size for chunked layers)")
    return ModelShape(**{**fields, "layer_pattern": tuple(fields.get("layer_pattern", (0, 1)))})


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    return DTYPE_BYTES[dtype]


def row_bytes(dtype: str, size: int) -> int:
    """Bytes of one token's row of ``size`` values of one KV head (a per-token format's
    scales included)."""
    if dtype in TOKEN_FORMATS:
        return bytes_per_token_head(TOKEN_FORMATS[dtype], size)
    return size * _dtype_bytes(dtype)


def layer_bytes(dtype: str, shape: LayerShape) -> int:
    """Bytes one layer of ``shape`` (KV heads, key and value head size) stores per token."""
    heads, size, size_v = shape
    return heads * (row_bytes(dtype, size) + row_bytes(dtype, size_v))


def bytes_per_token(shape: ModelShape, dtype: str) -> int:
    """The cache's bytes per token: latent rows for an MLA shape, else K/V per head."""
    if shape.latent_size is not None:
        return shape.layers * row_bytes(dtype, shape.latent_size)
    if shape.is_heterogeneous:
        return shape.stored_bytes(dtype)
    return expanded_bytes_per_token(shape, dtype)


def expanded_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    """Bytes per token with every layer's K/V stored per head (MLA models as transformers
    runs them)."""
    return shape.layers * shape.expanded_layer_bytes(dtype)


def kv_report(shape: ModelShape, dtype: str, max_len: int, block_size: Optional[int] = None,
              memory_gib: Optional[float] = None) -> Dict:
    """Sizes per token, per max_len sequence and per block, and what fits in memory_gib."""
    per_token = bytes_per_token(shape, dtype)
    report = {**asdict(shape), "dtype": dtype, "dtype_bytes": DTYPE_BYTES.get(dtype),
              "bytes_per_token": per_token, "max_len": max_len,
              "bytes_per_sequence": per_token * max_len}
    if shape.latent_size is not None:
        expanded = expanded_bytes_per_token(shape, dtype)
        report.update(bytes_per_token_expanded=expanded, latent_saving=expanded / per_token)
    if block_size is not None:
        report.update(block_size=block_size, bytes_per_block=per_token * block_size)
    if memory_gib is not None:
        memory = int(memory_gib * GIB)
        report.update(memory_bytes=memory, tokens_fit=memory // per_token,
                      sequences_fit=memory // (per_token * max_len))
        if block_size is not None:
            report["blocks_fit"] = memory // (per_token * block_size)
    if any(shape.windows()) or shape.is_heterogeneous:
        report["kv_groups"] = kv_group_report(shape, dtype, max_len, block_size or 16, memory_gib)
    if shape.linear_layers:
        report["linear_state"] = linear_state_report(shape, dtype, max_len, memory_gib)
    return report


def linear_state_report(shape: ModelShape, dtype: str, max_len: int,
                        memory_gib: Optional[float] = None) -> Dict:
    """A hybrid linear-attention shape's bytes per sequence: paged K/V of the full layers
    and the fixed state of the linear layers (states are not quantized: at least 2 bytes
    a value), against K/V in every layer."""
    kv = bytes_per_token(shape, dtype) * max_len
    state_bytes = 2 if dtype in TOKEN_FORMATS else max(2, _dtype_bytes(dtype))
    state = shape.linear_layers * shape.linear_state_values * state_bytes
    every_layer = kv * (shape.layers + shape.linear_layers) // shape.layers
    report = {"linear_layers": shape.linear_layers, "kv_bytes_per_sequence": kv,
              "state_bytes_per_sequence": state, "bytes_per_sequence": kv + state,
              "bytes_per_sequence_kv_every_layer": every_layer,
              "saving": every_layer / (kv + state)}
    if memory_gib is not None:
        memory = int(memory_gib * GIB)
        report.update(sequences_fit=memory // (kv + state),
                      sequences_fit_kv_every_layer=memory // every_layer)
    return report


def held_blocks(windows: Tuple[Window, ...], length: int, block_size: int) -> List[int]:
    """Blocks each KV group holds for one sequence decoding at ``length`` tokens, as the
    block manager holds them (a sliding group: its window plus the partial blocks at its ends)."""
    blocks = -(-length // block_size) * len(windows)
    manager = BlockSpaceManager(blocks, 0, block_size, watermark=0.0, kv_group_windows=windows)
    manager.allocate(0, 0, length - 1)
    manager.append(0, 1)  # a decode step: the sliding groups free what it cannot see
    return [len(t.live_blocks) for t in manager.tables[0]]


def kv_group_report(shape: ModelShape, dtype: str, max_len: int, block_size: int,
                    memory_gib: Optional[float] = None) -> Dict:
    """Per KV group: layers, window, bytes per block, blocks held at ``max_len``; the
    sequence's total against one block table for all layers, and the ideal (each
    group exactly the tokens its last query reads: all of them, its window, or its chunk).

    All groups draw pages of one size from one pool, so a group whose layers fill less than
    a page (the last of a kind whose count is no multiple of the group size, or a kind of
    another shape) holds the bytes of a full page: its unused part (``padded_layers`` layer
    slots, or ``padded_bytes`` per block where shapes differ) is counted in its
    ``bytes_held``. With layers of several shapes, "one table" stores every layer in the
    largest shape (one pool shape for every layer)."""
    shaped = shape.is_heterogeneous
    layout = KVGroupLayout.from_windows(shape.windows(), shape.layer_shapes() if shaped else None,
                                        shape.readers())
    layer_block = shape.expanded_layer_bytes(dtype) * block_size  # the largest layer's

    def own_block(group) -> int:  # bytes a block of the group's layers fills
        if group.shape is None:
            return len(group.layers) * layer_block
        return len(group.layers) * block_size * layer_bytes(dtype, group.shape)
    page = (max(own_block(g) for g in layout.groups) if layout.is_shaped
            else layout.layers_per_group * layer_block)
    held = held_blocks(layout.windows, max_len, block_size)
    groups = [{"layers": len(g.layers), "sliding_window": None if g.chunk_size else g.sliding_window,
               "chunk_size": g.chunk_size, "kind": window_label(g.sliding_window),
               "blocks_held": n, "bytes_held": n * page,
               "padded_layers": layout.layers_per_group - len(g.layers),
               "padded_bytes": page - own_block(g), "shape": g.shape}
              for g, n in zip(layout.groups, held)]
    grouped = sum(held) * page
    single = -(-max_len // block_size) * shape.layers * layer_block
    # Each group's tokens its last query reads: all of them, its window, or its chunk.
    read = [max_len - first_visible_position(g.sliding_window, max_len - 1) for g in layout.groups]
    ideal = sum(own_block(g) * n for g, n in zip(layout.groups, read)) // block_size
    report = {"num_groups": len(groups), "layers_per_group": layout.layers_per_group,
              "padded_layers": layout.padded_layers, "bytes_per_block": page, "groups": groups,
              "readers": len(layout.readers), "bytes_per_sequence": grouped,
              "bytes_per_sequence_single_table": single,
              "bytes_per_sequence_ideal": ideal, "fraction_of_single_table": grouped / single,
              "fraction_of_ideal": grouped / ideal,
              "saving": single / grouped}
    if memory_gib is not None:
        report["sequences_fit"] = int(memory_gib * GIB) // grouped
    return report


def format_bytes(n: float) -> str:
    """Binary units, trailing zeros dropped: 524288 -> '512 KiB', 1073741824 -> '1 GiB'."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.2f}".rstrip("0").rstrip(".") + f" {units[i]}"
