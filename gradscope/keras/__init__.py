"""The user's own Keras model.

``archive`` and ``graph`` read a saved ``.keras`` file without TensorFlow: the model's
``config.json`` from the zip, as a graph of layer calls. Everything that can be refused from the
structure alone is refused there, before TensorFlow is imported.
"""
