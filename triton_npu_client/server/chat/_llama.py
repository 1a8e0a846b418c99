"""A Llama-family decoder (Llama, Qwen2, Mistral) in plain torch, on the paged KV cache.

The weights come from a Hugging Face checkpoint folder (``config.json`` and ``model.safetensors``, or a
sharded ``model.safetensors.index.json`` with its shards) and the model is a frozen set of tensors driven
by :func:`forward`, like the GPT-2 decoder beside it: rotary position embeddings (with the ``rope_scaling``
variants these checkpoints use), RMSNorm, a SwiGLU MLP, grouped-query attention, optional q/k/v biases
(Qwen2) and tied or untied embeddings.

The arithmetic follows ``transformers``' ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and
``MistralForCausalLM`` step by step (RMSNorm in float32 then cast back, cos/sin tables computed in float32
and cast to the model's dtype, the same inverse frequencies for every rope type accepted), so the logits
match theirs within float32 rounding. A config option that would change that arithmetic and is not
implemented is refused when the config is read, never loaded into wrong logits.

Sliding-window attention (Mistral, Qwen2 with ``use_sliding_window``) is not implemented; inside one window
it is the same as full attention, so :attr:`Llama.max_positions` is capped at the window and a context the
engine serves never reaches past it. The same cap makes ``dynamic`` (NTK) rope exact: transformers only
rescales its frequencies for sequences longer than ``max_position_embeddings``.

torch is imported inside the functions, never at module level, so that ``import
triton_npu_client.server`` stays torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._files import read_json_config

if TYPE_CHECKING:
    import torch

    from ._decoders import AttendFn

__all__ = [
    "LLAMA_FAMILY",
    "ROPE_TYPES",
    "Llama",
    "LlamaConfig",
    "LlamaLayer",
    "RopeScaling",
    "RotaryTable",
    "load_llama",
    "rope_frequencies",
]

# config.json model_type values this decoder reads: one block structure, differing only in biases and windows.
LLAMA_FAMILY = ("llama", "qwen2", "mistral")
# transformers' ROPE_INIT_FUNCTIONS keys implemented here, plus "default" (no scaling).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# transformers' ACT2FN maps both names to SiLU.
_SILU = frozenset({"silu", "swish"})
# transformers' default rope_theta (RotaryEmbeddingConfigMixin.default_theta) when a config names none.
_DEFAULT_THETA = 10_000.0
# transformers' MistralConfig default: a Mistral config.json without the key gets this window.
_MISTRAL_DEFAULT_WINDOW = 4096


def _number(params: Mapping[str, Any], key: str, rope_type: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"rope_scaling of type {rope_type!r} needs a number {key!r}, not {value!r}")
    return float(value)


def _optional_number(params: Mapping[str, Any], key: str) -> float | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"rope_scaling {key!r} must be a number, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class RopeScaling:
    """Rotary embedding parameters: the base ``theta`` and one of :data:`ROPE_TYPES` with its own fields.

    Fields a type does not use stay ``None``. ``original_max_position_embeddings`` is the pretraining
    context of ``llama3`` and ``yarn``; ``factor`` is required by every type but ``default`` (``yarn``
    derives it from the two context lengths when it is null, as transformers does).
    """

    rope_type: str = "default"
    theta: float = _DEFAULT_THETA
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> RopeScaling:
        """Read the rope settings of a whole ``config.json``, in either format transformers writes.

        Older checkpoints keep ``rope_theta`` at the top level and the scaling in ``rope_scaling`` (type under
        ``type`` or ``rope_type``); transformers 5 writes both into ``rope_parameters``. As in transformers, a
        non-empty ``rope_scaling`` wins over ``rope_parameters``, and a theta inside the dict over the top-level one.
        """
        params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        if not isinstance(params, Mapping):
            raise ValueError(f"rope_scaling must be an object, not {params!r}")
        if params and all(isinstance(value, Mapping) for value in params.values()):
            # transformers nests rope settings by layer type for models that mix them (Gemma 3 and kin).
            raise ValueError(f"per-layer-type rope settings are not supported: {sorted(params)}")
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}: supported are {', '.join(ROPE_TYPES)}")
        partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        if partial is not None and float(partial) != 1.0:
            raise ValueError(f"unsupported partial_rotary_factor {partial!r}: rotary embeddings cover the whole head")
        theta = params.get("rope_theta", raw.get("rope_theta"))
        theta = _DEFAULT_THETA if theta is None else float(theta)
        if rope_type == "default":
            return cls(theta=theta)
        if rope_type in ("linear", "dynamic"):
            return cls(rope_type=rope_type, theta=theta, factor=_number(params, "factor", rope_type))
        # transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3 style) wins,
        # else the dict's own, else the model's context length.
        original = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        original = int(original or raw["max_position_embeddings"])
        if rope_type == "llama3":
            return cls(
                rope_type=rope_type,
                theta=theta,
                factor=_number(params, "factor", rope_type),
                low_freq_factor=_number(params, "low_freq_factor", rope_type),
                high_freq_factor=_number(params, "high_freq_factor", rope_type),
                original_max_position_embeddings=original,
            )
        # yarn
        return cls(
            rope_type=rope_type,
            theta=theta,
            factor=_optional_number(params, "factor"),
            original_max_position_embeddings=original,
            attention_factor=_optional_number(params, "attention_factor"),
            beta_fast=_optional_number(params, "beta_fast"),
            beta_slow=_optional_number(params, "beta_slow"),
            mscale=_optional_number(params, "mscale"),
            mscale_all_dim=_optional_number(params, "mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-family model, as read from a Hugging Face ``config.json``.

    ``qkv_bias``, ``o_bias`` and ``mlp_bias`` say which linear layers carry a bias: Llama sets the first two
    with ``attention_bias`` and the last with ``mlp_bias``; Qwen2 always has q/k/v biases and no others;
    Mistral has none. ``sliding_window`` is the window some layer uses, or ``None``.
    """

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in LLAMA_FAMILY:
            raise ValueError(f"model_type {self.model_type!r} is not one of {', '.join(LLAMA_FAMILY)}")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, not {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 or null, not {self.sliding_window}")

    @property
    def max_positions(self) -> int:
        """The longest context served exactly: ``max_position_embeddings``, capped at the sliding window."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LlamaConfig:
        """Read the fields this decoder needs; refuse options that would change its arithmetic."""
        model_type = raw.get("model_type")
        if model_type not in LLAMA_FAMILY:
            raise ValueError(f"model_type {model_type!r} is not one of {', '.join(LLAMA_FAMILY)}")
        act = raw.get("hidden_act", "silu")
        if act not in _SILU:
            raise ValueError(f"unsupported hidden_act {act!r}: the gated MLP here is SiLU (silu)")
        if raw.get("quantization_config"):
            method = raw["quantization_config"].get("quant_method", "?")
            raise ValueError(f"quantized checkpoints are not supported (quantization_config {method!r})")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // heads
        if not raw.get("head_dim") and hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        kv_heads = raw.get("num_key_value_heads") or heads
        layers = int(raw["num_hidden_layers"])
        if model_type == "llama":
            qkv_bias = o_bias = bool(raw.get("attention_bias", False))
            mlp_bias = bool(raw.get("mlp_bias", False))
        elif model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:
            qkv_bias = o_bias = mlp_bias = False
        return cls(
            model_type=str(model_type),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            vocab_size=int(raw["vocab_size"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=RopeScaling.from_config(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_window=_sliding_window(str(model_type), raw, layers),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        """Read ``config.json``; ``path`` is the file or the checkpoint folder holding it."""
        return cls.from_dict(read_json_config(path))


def _sliding_window(model_type: str, raw: Mapping[str, Any], layers: int) -> int | None:
    """The attention window some layer uses, as transformers decides it, or None when every layer sees everything."""
    if model_type == "mistral":
        window = raw.get("sliding_window", _MISTRAL_DEFAULT_WINDOW)
        return None if window is None else int(window)
    if model_type == "qwen2" and raw.get("use_sliding_window"):
        window = raw.get("sliding_window", 4096)
        layer_types = raw.get("layer_types")
        if layer_types is None:
            sliding = layers > int(raw.get("max_window_layers", 28))
        else:
            sliding = "sliding_attention" in layer_types
        return int(window) if sliding and window is not None else None
    return None


def rope_frequencies(config: LlamaConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [head_dim / 2] (float32, on the host) and the cos/sin scale of ``config.rope``.

    The same formulas, in the same order of float32 operations, as transformers' ``ROPE_INIT_FUNCTIONS`` and
    ``compute_default_rope_parameters``, so that the tables built from them are equal to transformers'.
    """
    import torch

    rope, dim = config.rope, config.head_dim
    base = rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    inv_freq = 1.0 / (base**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "dynamic":
        # transformers rescales the base only for sequences longer than max_position_embeddings, and
        # max_positions never exceeds it: below that length the frequencies are the default ones.
        return inv_freq, 1.0
    factor = rope.factor
    if rope.rope_type == "linear":
        assert factor is not None
        return inv_freq / factor, 1.0
    original = rope.original_max_position_embeddings
    assert original is not None
    if rope.rope_type == "llama3":
        assert factor is not None
        assert rope.low_freq_factor is not None
        assert rope.high_freq_factor is not None
        low, high = rope.low_freq_factor, rope.high_freq_factor
        low_freq_wavelen = original / low
        high_freq_wavelen = original / high
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama), 1.0
    # yarn (transformers' _compute_yarn_parameters)
    if factor is None:
        factor = config.max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low_dim, high_dim = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low_dim, high_dim = math.floor(low_dim), math.ceil(high_dim)
    low_dim, high_dim = max(low_dim, 0), min(high_dim, dim - 1)
    if low_dim == high_dim:
        high_dim += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low_dim) / (high_dim - low_dim), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryTable:
    """cos and sin of every position up to the model's limit, built on the model's device as they are needed.

    The table grows by doubling (capped at ``limit``) the first time a step reaches past it; each entry is
    ``cos(position * inv_freq)`` in float32, scaled and cast to the model's dtype exactly as transformers
    does per call, so growing never changes an entry. Only the step loop's thread uses it.
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype, limit: int) -> None:
        self.inv_freq = inv_freq
        self.scaling = scaling
        self.dtype = dtype
        self.limit = limit
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self._cos is None else int(self._cos.shape[0])

    def _grow(self, needed: int) -> None:
        import torch

        length = min(self.limit, max(needed, 2 * self.length, 256))
        positions = torch.arange(length, device=self.inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * self.scaling).to(self.dtype)
        self._sin = (emb.sin() * self.scaling).to(self.dtype)

    def reserve(self, needed: int) -> None:
        """Hold at least ``needed`` positions (<= ``limit``): called on the host before a forward reads them."""
        if needed > self.length:
            self._grow(needed)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [*positions.shape, head_dim] for ``positions``, all below the reserved length."""
        assert self._cos is not None
        assert self._sin is not None
        return self._cos[positions], self._sin[positions]


@dataclass(frozen=True)
class LlamaLayer:
    """One decoder block's weights, in Hugging Face's [out, in] layout (``F.linear(x, w)``).

    q/k/v are one matrix (rows: the query heads, then the key heads, then the value heads) and gate/up
    another (gate rows, then up rows): a decode step runs two matmuls there instead of five.
    """

    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass(frozen=True)
class Llama:
    """A loaded Llama-family model: config and weights, all on one device in one dtype. See :func:`load_llama`."""

    config: LlamaConfig
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: tuple[LlamaLayer, ...]
    norm_weight: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed_tokens when tied
    rotary: RotaryTable

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @property
    def max_positions(self) -> int:
        return self.config.max_positions

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """(layers, key/value heads, head_dim): what one position of the KV cache holds per layer."""
        config = self.config
        return config.num_hidden_layers, config.num_key_value_heads, config.head_dim

    def prepare(self, positions: int) -> None:
        """Grow the rotary table to ``positions`` entries (refusing past :attr:`max_positions`)."""
        if positions > self.max_positions:
            raise ValueError(f"positions up to {positions} exceed the model's max_positions {self.max_positions}")
        self.rotary.reserve(positions)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        cos, sin = self.rotary.lookup(positions)
        # [rows, T, 1 (broadcast over heads), head_dim]
        return self.embed_tokens[tokens], (cos[:, :, None], sin[:, :, None])

    def layer(self, index: int, x: torch.Tensor, context: Any, attention: AttendFn) -> torch.Tensor:
        import torch.nn.functional as F

        config = self.config
        layer = self.layers[index]
        cos, sin = context
        rows, steps = x.shape[0], x.shape[1]
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        eps = config.rms_norm_eps
        h = _rms_norm(x, layer.input_norm, eps)
        qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias)
        q = _rotate(qkv[..., :q_size].view(rows, steps, heads, head_dim), cos, sin)
        k = _rotate(qkv[..., q_size : q_size + kv_size].view(rows, steps, kv_heads, head_dim), cos, sin)
        v = qkv[..., q_size + kv_size :].view(rows, steps, kv_heads, head_dim)
        x = x + F.linear(attention(q, k, v, head_dim**-0.5), layer.o_weight, layer.o_bias)
        h = _rms_norm(x, layer.post_norm, eps)
        gate, up = F.linear(h, layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down_weight, layer.down_bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        return F.linear(_rms_norm(x, self.norm_weight, self.config.rms_norm_eps), self.lm_head).float()


def _weight_files(path: Path) -> dict[str, Path]:
    """Each weight's name -> the safetensors file holding it: ``model.safetensors``, or the sharded index's map."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_config(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = {str(name): path / str(shard) for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise FileNotFoundError(f"{index} names the shard {shard.name}, which is not in {path}")
        return files
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    raise FileNotFoundError(f"no model.safetensors nor model.safetensors.index.json in {path}")


def load_llama(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Llama:
    """Load a Hugging Face Llama, Qwen2 or Mistral checkpoint folder.

    Reads ``config.json`` and ``model.safetensors`` or a sharded ``model.safetensors.index.json`` with its
    shards. Keys are accepted with or without the ``model.`` prefix (``*ForCausalLM`` and bare ``*Model``
    checkpoints). The output projection is ``lm_head.weight``, or ``embed_tokens`` when the config ties them
    (a saved ``lm_head.weight`` is then ignored, as transformers ignores it). ``dtype`` defaults to float32
    whatever the checkpoint's own dtype; each weight is cast as it is placed. Raises ``KeyError`` naming a
    missing weight, ``ValueError`` for a config this decoder does not implement.
    """
    import torch

    path = Path(path)
    config = LlamaConfig.from_file(path)
    dtype = torch.float32 if dtype is None else dtype
    files = _weight_files(path)
    with ExitStack() as stack:
        return _load(path, config, files, stack, device, dtype)


def _load(
    path: Path,
    config: LlamaConfig,
    files: Mapping[str, Path],
    stack: ExitStack,
    device: str | torch.device,
    dtype: torch.dtype,
) -> Llama:
    import torch
    from safetensors import safe_open

    names = {name.removeprefix("model."): name for name in files}
    handles: dict[Path, Any] = {}

    def take(key: str) -> torch.Tensor:
        name = names.get(key)
        if name is None:
            raise KeyError(f"checkpoint {path} has no weight {key!r} (nor 'model.{key}')")
        file = files[name]
        if file not in handles:
            handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
        # One tensor at a time from the mapped file: host memory holds a single weight, never a whole shard.
        tensor: torch.Tensor = handles[file].get_tensor(name)
        return tensor.to(device=device, dtype=dtype).contiguous()

    def fused(keys: Sequence[str]) -> torch.Tensor:
        return torch.cat([take(key) for key in keys]).contiguous()

    def fused_bias(keys: Sequence[str], present: bool) -> torch.Tensor | None:
        return fused(keys) if present else None

    layers = []
    for i in range(config.num_hidden_layers):
        prefix = f"layers.{i}."
        qkv = [f"{prefix}self_attn.{p}_proj." for p in "qkv"]
        gate_up = [f"{prefix}mlp.{p}_proj." for p in ("gate", "up")]
        down, o = f"{prefix}mlp.down_proj.", f"{prefix}self_attn.o_proj."
        layers.append(
            LlamaLayer(
                input_norm=take(prefix + "input_layernorm.weight"),
                qkv_weight=fused([p + "weight" for p in qkv]),
                qkv_bias=fused_bias([p + "bias" for p in qkv], config.qkv_bias),
                o_weight=take(o + "weight"),
                o_bias=take(o + "bias") if config.o_bias else None,
                post_norm=take(prefix + "post_attention_layernorm.weight"),
                gate_up_weight=fused([p + "weight" for p in gate_up]),
                gate_up_bias=fused_bias([p + "bias" for p in gate_up], config.mlp_bias),
                down_weight=take(down + "weight"),
                down_bias=take(down + "bias") if config.mlp_bias else None,
            )
        )
    embed_tokens = take("embed_tokens.weight")
    lm_head = embed_tokens if config.tie_word_embeddings else take("lm_head.weight")
    if embed_tokens.shape[0] != config.vocab_size or lm_head.shape[0] != config.vocab_size:
        raise ValueError(
            f"checkpoint {path}: embed_tokens has {embed_tokens.shape[0]} rows and lm_head {lm_head.shape[0]}, "
            f"config.json's vocab_size is {config.vocab_size}"
        )
    inv_freq, scaling = rope_frequencies(config)
    return Llama(
        config=config,
        embed_tokens=embed_tokens,
        layers=tuple(layers),
        norm_weight=take("norm.weight"),
        lm_head=lm_head,
        rotary=RotaryTable(inv_freq.to(device), scaling, dtype, config.max_positions),
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm: normalised in float32 whatever the dtype, cast back, then scaled.
    import torch

    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, halves (not pairs) rotated together.
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
