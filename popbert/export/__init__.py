"""Inference files from a trained graph: ONNX (`inference`), fused for ONNX Runtime (`fused`),
INT8 (`quantize`), the OpenVINO IR (`openvino`), each checked in the runtime that will run it
(`agreement`, `accuracy`) before it is moved into place."""
