"""The YAML wing: a model described by a YAML config, built and run by gradscope.

``config`` (the validated Spec), ``algebra`` (shapes, without TensorFlow), ``data`` and
``weights`` (the batch and the weights), ``engine`` (the model in TensorFlow), ``explain``
(and ``shapes``), ``dynamics`` (across time), ``truncation`` (chunks) and ``inference`` (a
config from a checkpoint's shapes). The Keras wing, ``gradscope.keras``, stands beside it.
"""
