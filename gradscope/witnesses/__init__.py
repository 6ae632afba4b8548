"""What ``gradscope check`` runs, one module per witness; ``check`` runs them on a YAML spec's
model (the Keras wing's check is ``gradscope.keras.check``)."""
