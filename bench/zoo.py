"""A zoo of models tfmx's authors did not write: ``keras.applications`` CNNs and ``keras_hub``
transformer backbones, each with a small classification head, random weights.

Each :class:`ZooModel` builds at two sizes:

- ``"bench"``: the published architecture (``keras.applications.MobileNetV3Small``,
  ``EfficientNetB0``, ``ConvNeXtTiny``, ``DenseNet121``, ``EfficientNetV2B0``,
  ``ResNet50V2``, ``Xception``) at a small input, or a keras_hub
  backbone configured small (2 layers, width 128, 64 tokens). ``tfmx bench --model zoo``
  measures these (:mod:`bench.workloads` registers them as workloads ``zoo_<name>``).
- ``"tiny"``: the same building blocks, as few as show each kind once, at a tiny input: the
  CNNs through Keras's own application builders (``keras.src.applications``: private, the
  functions the public constructors call, with fewer blocks), the backbones with width 16 and
  8 tokens. The parity tests (tests/test_zoo.py) train these.

What each brings that tfmx's own workloads do not:

- ``mobilenet_v3_small``: depthwise convolutions, hard-swish (``x * relu6(x + 3) / 6``),
  squeeze-excite (global pool, two 1x1 convolutions, hard-sigmoid, a multiply), batch norm.
- ``efficientnet_b0``: swish, depthwise convolutions, squeeze-excite with sigmoid, batch norm,
  drop-connect (``Dropout`` with a noise shape) on the residuals.
- ``convnext_tiny``: 7x7 depthwise convolutions, LayerNormalization over channels, GELU
  (exact), layer scale (a learned per-channel multiply), batch norm nowhere.
- ``densenet121``: batch norm before each convolution (BN-ReLU-Conv), Concatenate.
- ``efficientnet_v2_b0``: fused MBConv blocks (a regular 3x3 convolution where MBConv has its
  1x1 expansion and depthwise pair: alone without expansion, else followed by a 1x1
  projection), then MBConv blocks with squeeze-excite; swish, batch norm, drop-connect.
- ``resnet50_v2``: pre-activation bottlenecks: BN-ReLU before the convolutions (the block's
  input normalized once for both the shortcut and the residual branch), a residual Add of two
  biased convolutions (the 1x1 convolution shortcut and the branch's last 1x1), 1x1 max-pool
  shortcuts on the stride-2 blocks, a BN-ReLU after the last block.
- ``xception``: separable convolutions (``SeparableConv2D``: a 3x3 depthwise convolution, then a
  pointwise 1x1 projection, no bias) each followed by batch norm, ReLU between them, residual
  Adds of strided 1x1 convolution shortcuts, max pooling. Keras writes its blocks inline, so
  the tiny size is the whole network at its smallest input (71 x 71).
- ``bert``: keras_hub's BertBackbone: token, position and segment embeddings, post-norm
  TransformerEncoder blocks (attention with a padding mask, LayerNorm, GELU feed-forward).
- ``gpt2``: keras_hub's GPT2Backbone: pre-norm causal TransformerDecoder blocks.
- Both keep keras_hub's dropout of 0.1 (embeddings, attention, residuals): a training step draws
  a uniform number for every attention score and every activation it drops from.
- ``llama``: keras_hub's LlamaBackbone: rotary position embeddings, RMSNorm (its own
  LlamaLayerNorm), grouped-query attention (4 query heads, 2 key/value heads), SwiGLU.
- ``mixtral``: keras_hub's MixtralBackbone: Llama's blocks with a mixture of 4 SwiGLU experts
  in place of the feed-forward, top-2 routing (softmax, ``top_k``, ``one_hot``), dense
  dispatch (every expert's ``Einsum`` on every token, weighted by the routing), the router's
  load-balancing loss.
- ``qwen_moe``: keras_hub's QwenMoeBackbone: Mixtral's routing with the experts' gate and up
  projections in one kernel, plus a shared expert gated by a sigmoid.
- ``gemma``: keras_hub's GemmaBackbone: embeddings scaled by the square root of the width,
  RMSNorm with a ``(1 + scale)`` weight (its own RMSNormalization), multi-query attention (4
  query heads, one key/value head, in Gemma's own attention layer), a GeGLU feed-forward (the
  tanh GELU of the gate times the up projection), rotary embeddings. (Its embeddings tied to
  the output logits belong to GemmaCausalLM, not to the backbone: the head here is a Dense.)
- ``qwen3``: keras_hub's Qwen3Backbone: Llama's blocks (rotary, grouped-query attention,
  SwiGLU, RMSNorm) with an RMSNorm over each head's queries and keys before the rotary
  embedding.

keras_hub is imported only when one of its models is built (``pip install "tfmx[zoo]"``).

Example:
    >>> from bench import zoo
    >>> sorted(zoo.MODELS)[:3]
    ['bert', 'convnext_tiny', 'densenet121']
    >>> zoo.MODELS["llama"].needs_keras_hub, zoo.MODELS["convnext_tiny"].needs_keras_hub
    (True, False)
    >>> x, y = zoo.sample_data("mobilenet_v3_small", 4, size="tiny")
    >>> x.shape, x.dtype.name, y.shape
    ((4, 32, 32, 3), 'float32', (4,))
    >>> zoo.build("mobilenet_v3_small", size="tiny").output_shape  # doctest: +SKIP
    (None, 10)
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

import numpy as np

SIZES = ("bench", "tiny")


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One zoo entry: how to build it at each size, its input and its bench defaults.

    ``input_shape`` and ``tiny_input_shape`` exclude the batch; ``vocabulary`` is 0 for
    float inputs (images) and the number of token ids otherwise (inputs are int32 ids below
    it). ``families`` are the tfmx pattern families expected to fuse something in its
    training step (tests/test_zoo.py checks them in ``tfmx.report()``); ``composite`` names
    what tfmx leaves to TensorFlow's own ops.
    """

    name: str
    description: str
    builder: Callable[[str, int], Any]  # (size, num_classes) -> uncompiled keras.Model
    input_shape: tuple[int, ...]
    tiny_input_shape: tuple[int, ...]
    vocabulary: int = 0
    tiny_vocabulary: int = 0
    needs_keras_hub: bool = False
    families: tuple[str, ...] = ()
    composite: tuple[str, ...] = ()
    batch_size: int = 16
    rounds: int = 6
    steps: int = 3

    def shape(self, size: str = "bench") -> tuple[int, ...]:
        """The input shape (no batch) at ``size``.

        >>> MODELS["bert"].shape("tiny")
        (8,)
        """
        return self.tiny_input_shape if _size(size) == "tiny" else self.input_shape

    def vocab(self, size: str = "bench") -> int:
        """The number of token ids at ``size`` (0: float inputs).

        >>> MODELS["gpt2"].vocab("tiny"), MODELS["densenet121"].vocab()
        (64, 0)
        """
        return self.tiny_vocabulary if _size(size) == "tiny" else self.vocabulary


def _size(size: str) -> str:
    if size not in SIZES:
        raise ValueError(f"unknown zoo size {size!r}; choose from {SIZES}")
    return size


def keras_hub_available() -> bool:
    """Whether keras_hub can be imported here (without importing it).

    >>> keras_hub_available() in (True, False)
    True
    """
    return importlib.util.find_spec("keras_hub") is not None


def _keras_hub() -> Any:
    try:
        import keras_hub
    except ImportError as err:
        raise ImportError(
            "this zoo model is a keras_hub backbone: pip install \"tfmx[zoo]\" (keras-hub; on "
            "a machine where its tensorflow-text requirement does not install: pip install "
            "--no-deps keras-hub, then tokenizers, regex and rich, what it imports)") from err
    return keras_hub


# -- CNNs: keras.applications ------------------------------------------------------------------
def _cnn(name: str, size: str, num_classes: int, published: str, tiny: Callable[..., Any],
         **options: Any) -> Any:
    """``keras.applications.<published>`` at "bench" size, else ``tiny(**arguments)`` (one of
    Keras's own application builders); include_top=False, pooling="avg", weights=None,
    ``options`` to both; then Dense(num_classes, softmax)."""
    import keras

    shape = MODELS[name].shape(size)
    common = {"input_shape": shape, "include_top": False, "weights": None, "pooling": "avg",
              **options}
    if size == "bench":
        base = getattr(keras.applications, published)(**common)
    else:
        base = tiny(**common)
    out = keras.layers.Dense(num_classes, activation="softmax", name="zoo_head")(base.output)
    return keras.Model(base.input, out, name=f"zoo_{name}_{size}")


def _mobilenet_v3_small(size: str, num_classes: int) -> Any:
    from keras.src.applications import mobilenet_v3 as m

    def stack_fn(x: Any, kernel: int, activation: Any, se_ratio: float) -> Any:
        # one block of each kind MobileNetV3Small has: relu + SE (stride 2), relu without SE,
        # hard-swish + SE (5x5, stride 2), hard-swish + SE with a residual
        x = m._inverted_res_block(x, 1, 16, 3, 2, se_ratio, m.relu, 0)
        x = m._inverted_res_block(x, 72.0 / 16, 24, 3, 2, None, m.relu, 1)
        x = m._inverted_res_block(x, 4, 24, kernel, 1, se_ratio, activation, 2)
        return x

    def tiny(**common: Any) -> Any:
        return m.MobileNetV3(stack_fn, 64, model_type="small", name="MobileNetV3Tiny",
                             **common)

    return _cnn("mobilenet_v3_small", size, num_classes, "MobileNetV3Small", tiny,
                include_preprocessing=False)


_EFFICIENTNET_TINY_BLOCKS = [
    # EfficientNetB0's first two kinds of block: no expansion, then 6x expansion, stride 2
    {"kernel_size": 3, "repeats": 1, "filters_in": 32, "filters_out": 16, "expand_ratio": 1,
     "id_skip": True, "strides": 1, "se_ratio": 0.25},
    {"kernel_size": 3, "repeats": 2, "filters_in": 16, "filters_out": 24, "expand_ratio": 6,
     "id_skip": True, "strides": 2, "se_ratio": 0.25},
]


def _efficientnet_b0(size: str, num_classes: int) -> Any:
    from keras.src.applications.efficientnet import EfficientNet

    def tiny(**common: Any) -> Any:
        return EfficientNet(1.0, 1.0, common["input_shape"][0],
                            blocks_args=_EFFICIENTNET_TINY_BLOCKS, name="efficientnet_tiny",
                            **common)

    return _cnn("efficientnet_b0", size, num_classes, "EfficientNetB0", tiny)


def _convnext_tiny(size: str, num_classes: int) -> Any:
    from keras.src.applications.convnext import ConvNeXt

    def tiny(**common: Any) -> Any:
        return ConvNeXt(depths=[1, 1, 1, 1], projection_dims=[16, 24, 32, 48],
                        default_size=32, name="convnext_pico", **common)

    return _cnn("convnext_tiny", size, num_classes, "ConvNeXtTiny", tiny,
                include_preprocessing=False)


def _densenet121(size: str, num_classes: int) -> Any:
    from keras.src.applications.densenet import DenseNet

    def tiny(**common: Any) -> Any:
        return DenseNet([1, 1, 1, 1], name="densenet_tiny", **common)

    return _cnn("densenet121", size, num_classes, "DenseNet121", tiny)


_EFFICIENTNET_V2_TINY_BLOCKS = [
    # EfficientNetV2B0's three kinds of block: fused MBConv without expansion (one 3x3
    # convolution), fused MBConv with a 4x expansion (3x3 convolution, then 1x1), stride 2,
    # MBConv (1x1 expansion, 3x3 depthwise, squeeze-excite, 1x1), stride 2
    {"kernel_size": 3, "num_repeat": 1, "input_filters": 16, "output_filters": 16,
     "expand_ratio": 1, "se_ratio": 0, "strides": 1, "conv_type": 1},
    {"kernel_size": 3, "num_repeat": 1, "input_filters": 16, "output_filters": 24,
     "expand_ratio": 4, "se_ratio": 0, "strides": 2, "conv_type": 1},
    {"kernel_size": 3, "num_repeat": 2, "input_filters": 24, "output_filters": 32,
     "expand_ratio": 4, "se_ratio": 0.25, "strides": 2, "conv_type": 0},
]


def _efficientnet_v2_b0(size: str, num_classes: int) -> Any:
    from keras.src.applications.efficientnet_v2 import EfficientNetV2

    def tiny(**common: Any) -> Any:
        return EfficientNetV2(1.0, 1.0, common["input_shape"][0],
                              blocks_args=_EFFICIENTNET_V2_TINY_BLOCKS,
                              name="efficientnetv2_tiny", **common)

    return _cnn("efficientnet_v2_b0", size, num_classes, "EfficientNetV2B0", tiny,
                include_preprocessing=False)


def _resnet50_v2(size: str, num_classes: int) -> Any:
    from keras.src.applications import resnet

    def stack_fn(x: Any) -> Any:
        # ResNet50V2's three kinds of pre-activation bottleneck, one stack: a 1x1 convolution
        # shortcut (first of a stack), an identity shortcut, a stride-2 one (last of a stack:
        # a 1x1 max-pool shortcut)
        return resnet.stack_residual_blocks_v2(x, 8, 3, name="conv2")

    def tiny(**common: Any) -> Any:
        return resnet.ResNet(stack_fn, True, True, name="resnet_v2_tiny", **common)

    return _cnn("resnet50_v2", size, num_classes, "ResNet50V2", tiny)


def _xception(size: str, num_classes: int) -> Any:
    import keras

    # Keras writes Xception's blocks inline (no builder of fewer blocks): the whole network at
    # both sizes, the tiny one at the smallest input it takes
    return _cnn("xception", size, num_classes, "Xception", keras.applications.Xception)


# -- transformer backbones: keras_hub ------------------------------------------------------------
# (layers, heads, key/value heads, width, feed-forward width) per size
_TRANSFORMER_SIZES = {"bench": (2, 4, 2, 128, 512), "tiny": (1, 2, 1, 16, 32)}


def _backbone_classifier(name: str, size: str, num_classes: int,
                         make: Callable[[Any, int, tuple], Any]) -> Any:
    """Token ids -> the backbone ``make(keras_hub, vocabulary, (layers, heads, key/value
    heads, width, feed-forward width))`` (a padding mask of ones: every token real) -> its
    last token (or BERT's pooled output) -> Dense(num_classes, softmax)."""
    import keras

    spec = MODELS[name]
    backbone = make(_keras_hub(), spec.vocab(size), _TRANSFORMER_SIZES[size])
    ids = keras.Input(spec.shape(size), dtype="int32", name="token_ids")
    inputs = {"token_ids": ids, "padding_mask": keras.ops.ones_like(ids)}
    if "segment_ids" in backbone.input:
        inputs["segment_ids"] = keras.ops.zeros_like(ids)
    out = backbone(inputs)
    # BERT's pooled output, else the last token (causal attention has seen every one)
    features = out["pooled_output"] if isinstance(out, dict) else out[:, -1, :]
    probs = keras.layers.Dense(num_classes, activation="softmax", name="zoo_head")(features)
    return keras.Model(ids, probs, name=f"zoo_{name}_{size}")


def _classic(name: str, cls: str) -> Callable[[str, int], Any]:
    """The builder of a BERT- or GPT-2-style backbone (keras_hub.models.<cls>: learned
    positions up to the model's sequence length)."""

    def builder(size: str, num_classes: int) -> Any:
        seq = MODELS[name].shape(size)[0]
        return _backbone_classifier(name, size, num_classes, lambda hub, vocab, d: (
            getattr(hub.models, cls)(vocabulary_size=vocab, num_layers=d[0], num_heads=d[1],
                                     hidden_dim=d[3], intermediate_dim=d[4],
                                     max_sequence_length=seq)))

    return builder


def _llama(size: str, num_classes: int) -> Any:
    return _backbone_classifier("llama", size, num_classes, lambda hub, vocab, d: (
        hub.models.LlamaBackbone(vocabulary_size=vocab, num_layers=d[0], num_query_heads=d[1],
                                 num_key_value_heads=d[2], hidden_dim=d[3],
                                 intermediate_dim=d[4])))


def _mixtral(size: str, num_classes: int) -> Any:
    return _backbone_classifier("mixtral", size, num_classes, lambda hub, vocab, d: (
        hub.models.MixtralBackbone(vocabulary_size=vocab, num_layers=d[0],
                                   num_query_heads=d[1], num_key_value_heads=d[2],
                                   hidden_dim=d[3], intermediate_dim=d[4], num_experts=4,
                                   top_k=2)))


def _qwen_moe(size: str, num_classes: int) -> Any:
    return _backbone_classifier("qwen_moe", size, num_classes, lambda hub, vocab, d: (
        hub.models.QwenMoeBackbone(vocabulary_size=vocab, num_layers=d[0],
                                   num_query_heads=d[1], num_key_value_heads=d[2],
                                   hidden_dim=d[3], intermediate_dim=d[4],
                                   moe_intermediate_dim=d[4] // 2,
                                   shared_expert_intermediate_dim=d[4], num_experts=4,
                                   top_k=2, norm_top_k_prob=True)))


def _gemma(size: str, num_classes: int) -> Any:
    return _backbone_classifier("gemma", size, num_classes, lambda hub, vocab, d: (
        hub.models.GemmaBackbone(vocabulary_size=vocab, num_layers=d[0], num_query_heads=d[1],
                                 num_key_value_heads=1, hidden_dim=d[3],
                                 intermediate_dim=2 * d[4], head_dim=d[3] // d[1])))


def _qwen3(size: str, num_classes: int) -> Any:
    return _backbone_classifier("qwen3", size, num_classes, lambda hub, vocab, d: (
        hub.models.Qwen3Backbone(vocabulary_size=vocab, num_layers=d[0], num_query_heads=d[1],
                                 num_key_value_heads=d[2], head_dim=d[3] // d[1],
                                 hidden_dim=d[3], intermediate_dim=d[4])))


def _application(name: str, cls: str, side: int, what: str,
                 builder: Callable[[str, int], Any], families: tuple[str, ...],
                 composite: tuple[str, ...], batch_size: int = 16, rounds: int = 6,
                 tiny_side: int = 32) -> ZooModel:
    """A keras.applications CNN's entry: ``side`` x ``side`` x 3 images (``tiny_side`` tiny)."""
    return ZooModel(name, f"keras.applications.{cls}(weights=None), {side}x{side}x3: {what}",
                    builder, (side, side, 3), (tiny_side, tiny_side, 3), families=families,
                    composite=composite, batch_size=batch_size, rounds=rounds, steps=3)


def _hub_model(name: str, what: str, head: str, builder: Callable[[str, int], Any],
               families: tuple[str, ...], composite: tuple[str, ...]) -> ZooModel:
    """A keras_hub backbone's entry: 64 tokens (8 tiny) of a vocabulary of 1000 (64 tiny)."""
    return ZooModel(name, f"keras_hub {what}, 64 tokens, vocabulary 1000, {head} -> Dense",
                    builder, (64,), (8,), vocabulary=1000, tiny_vocabulary=64,
                    needs_keras_hub=True, families=families, composite=composite,
                    batch_size=32, rounds=8, steps=5)


MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in (
        _application("mobilenet_v3_small", "MobileNetV3Small", 64,
                     "depthwise, hard-swish, squeeze-excite, batch norm", _mobilenet_v3_small,
                     ("batch_norm", "pointwise"),
                     ("hard-swish", "squeeze-excite", "depthwise convolution"),
                     batch_size=32, rounds=8),
        _application("efficientnet_b0", "EfficientNetB0", 64,
                     "depthwise, swish, squeeze-excite, batch norm, drop-connect",
                     _efficientnet_b0, ("batch_norm", "pointwise"),
                     ("swish", "squeeze-excite", "depthwise convolution")),
        _application("convnext_tiny", "ConvNeXtTiny", 32,
                     "7x7 depthwise, LayerNorm, GELU, layer scale", _convnext_tiny,
                     ("layer_norm", "gelu"), ("layer scale", "depthwise convolution")),
        _application("densenet121", "DenseNet121", 32, "BN-ReLU-Conv, Concatenate",
                     _densenet121, ("batch_norm", "pointwise"), ("concatenate",)),
        _application("efficientnet_v2_b0", "EfficientNetV2B0", 64,
                     "fused MBConv (3x3 expansion convolutions), MBConv with squeeze-excite, "
                     "swish, batch norm", _efficientnet_v2_b0,
                     ("batch_norm", "swish", "squeeze_excite", "pointwise"),
                     ("depthwise convolution",)),
        _application("resnet50_v2", "ResNet50V2", 32,
                     "pre-activation bottlenecks (BN-ReLU-Conv), max-pool shortcuts",
                     _resnet50_v2, ("batch_norm", "contraction", "pointwise"),
                     ("pre-activation ReLU",)),
        _application("xception", "Xception", 71,
                     "separable convolutions (depthwise, then a pointwise 1x1 projection) with "
                     "batch norm, 1x1 convolution shortcuts", _xception,
                     ("batch_norm", "separable"), ("depthwise convolution",), tiny_side=71),
        _hub_model("bert", "BertBackbone, 2 layers x 128, 4 heads, FFN 512", "pooled",
                   _classic("bert", "BertBackbone"),
                   ("layer_norm", "attention", "gelu"), ("embeddings", "dropout")),
        _hub_model("gpt2", "GPT2Backbone, 2 layers x 128, 4 heads, FFN 512", "last token",
                   _classic("gpt2", "GPT2Backbone"), ("layer_norm", "attention", "gelu"),
                   ("embeddings", "dropout")),
        _hub_model("llama", "LlamaBackbone, 2 layers x 128, 4 query / 2 key-value heads, "
                   "SwiGLU 512, rotary, RMSNorm", "last token", _llama,
                   ("einsum_dense", "scaled_rms_norm", "gated_product"),
                   ("rotary embedding", "RMSNorm", "SwiGLU", "grouped-query attention")),
        _hub_model("mixtral", "MixtralBackbone, 2 layers x 128, 4 query / 2 key-value heads, "
                   "4 SwiGLU experts of 512, top-2 routing", "last token", _mixtral,
                   ("einsum_dense", "scaled_rms_norm", "moe"), ("MoE routing", "MoE experts")),
        _hub_model("qwen_moe", "QwenMoeBackbone, 2 layers x 128, 4 query / 2 key-value heads, "
                   "4 SwiGLU experts of 256 and a gated shared expert of 512, top-2 routing",
                   "last token", _qwen_moe, ("einsum_dense", "scaled_rms_norm"),
                   ("MoE routing", "MoE experts")),
        _hub_model("gemma", "GemmaBackbone, 2 layers x 128, 4 query heads / 1 key-value head, "
                   "GeGLU 512, rotary, RMSNorm (1 + scale)", "last token", _gemma,
                   ("einsum_dense", "scaled_rms_norm", "rotary", "gated_product"),
                   ("multi-query attention",)),
        _hub_model("qwen3", "Qwen3Backbone, 2 layers x 128, 4 query / 2 key-value heads, "
                   "SwiGLU 512, rotary, RMSNorm, per-head query/key RMSNorm", "last token",
                   _qwen3, ("einsum_dense", "scaled_rms_norm", "rotary", "grouped_attention",
                           "gated_product"),
                   ("grouped-query attention",)),
    )
}


def build(name: str, size: str = "bench", num_classes: int = 10, seed: int | None = None) -> Any:
    """The uncompiled model ``name`` of :data:`MODELS` at ``size`` ("bench" or "tiny"), its
    head a Dense(num_classes, softmax); weights from ``seed`` when given (else the global
    Keras seed's state).

    >>> build("resnet")
    Traceback (most recent call last):
    ...
    ValueError: unknown zoo model 'resnet'; choose from ('mobilenet_v3_small', \
'efficientnet_b0', 'convnext_tiny', 'densenet121', 'efficientnet_v2_b0', 'resnet50_v2', \
'xception', 'bert', 'gpt2', 'llama', 'mixtral', 'qwen_moe', 'gemma', 'qwen3')
    >>> build("llama", size="tiny").output_shape  # doctest: +SKIP
    (None, 10)
    """
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; choose from {tuple(MODELS)}")
    size = _size(size)
    if seed is not None:
        import keras

        keras.utils.set_random_seed(seed)
    return MODELS[name].builder(size, num_classes)


def sample_data(name: str, n: int, size: str = "bench", num_classes: int = 10,
                seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random inputs for ``name`` at ``size`` (standard normal images, or int32 token
    ids below the model's vocabulary) and int32 labels below ``num_classes``.

    >>> x, y = sample_data("bert", 3, size="tiny")
    >>> x.shape, x.dtype.name, bool(x.max() < 64), y.dtype.name
    ((3, 8), 'int32', True, 'int32')
    """
    spec = MODELS[name]
    rng = np.random.default_rng(seed)
    shape = (n, *spec.shape(size))
    if spec.vocab(size):
        x = rng.integers(0, spec.vocab(size), size=shape).astype(np.int32)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    return x, rng.integers(0, num_classes, size=n).astype(np.int32)


__all__ = ["MODELS", "SIZES", "ZooModel", "build", "keras_hub_available", "sample_data"]
