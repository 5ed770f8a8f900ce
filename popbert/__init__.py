"""popbert: pre-train and fine-tune BERT-family models from an annotated ONNX graph."""

__version__ = "0.1.0"
