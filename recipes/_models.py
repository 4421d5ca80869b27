"""The recipes' models that the benchmark also times (its ``small_cnn`` and ``bn_resnet``
workloads): uncompiled Keras models.

Example:
    >>> small_cnn_model(seed=1, num_classes=3).name
    'small_cnn'
"""

from __future__ import annotations

from typing import Any


def small_cnn_model(seed: int = 0, image_shape: tuple[int, int, int] = (32, 32, 3),
                    num_classes: int = 10) -> Any:
    """The small CNN (uncompiled) of the ``small_cnn`` workload and of ``recipes.small_cnn``:
    Conv2D+bias+relu, a strided conv, a residual block, Dense layers; weights from ``seed``.

    >>> small_cnn_model().output_shape
    (None, 10)
    """
    import keras
    from keras import layers

    keras.utils.set_random_seed(seed)
    inputs = keras.Input(image_shape)
    x = layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    x = layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(x)  # 16x16
    y = layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    y = layers.Conv2D(32, 3, padding="same")(y)
    x = layers.Activation("relu")(layers.Add()([x, y]))  # residual block
    x = layers.Conv2D(64, 3, strides=2, padding="same", activation="relu")(x)  # 8x8
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dense(64, activation="relu")(x)
    x = layers.Dense(32, activation="relu")(x)
    outputs = layers.Dense(num_classes, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="small_cnn")


def bn_resnet_model(num_classes: int = 10, momentum: float = 0.99) -> Any:
    """The ``bn_resnet`` workload's model (uncompiled; also ``recipes.bn_resnet``'s): a small
    ResNet-style CNN on 32x32x3 with batch norm, 7 convolutions each followed by
    BatchNormalization (``momentum``), two residual blocks (one downsampling, with a
    projection).

    >>> bn_resnet_model(3).output_shape
    (None, 3)
    """
    import keras
    from keras import layers

    def conv_bn(x: Any, filters: int, kernel: int = 3, strides: int = 1) -> Any:
        x = layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False)(x)
        return layers.BatchNormalization(momentum=momentum)(x)

    inp = keras.Input((32, 32, 3))
    x = layers.ReLU()(conv_bn(inp, 32))
    y = conv_bn(layers.ReLU()(conv_bn(x, 32)), 32)
    x = layers.ReLU()(layers.Add()([x, y]))
    y = conv_bn(layers.ReLU()(conv_bn(x, 64, strides=2)), 64)
    x = layers.ReLU()(layers.Add()([conv_bn(x, 64, kernel=1, strides=2), y]))
    x = layers.GlobalAveragePooling2D()(x)
    out = layers.Dense(num_classes, activation="softmax")(x)
    return keras.Model(inp, out, name="bn_resnet")
