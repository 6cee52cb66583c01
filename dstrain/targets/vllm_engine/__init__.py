"""What runs inside the vLLM engine's own interpreter for target.backend=vllm (never imports dstrain): the capture
server (server.py) and the CPU-safe hidden-states connector vLLM loads through kv_connector_module_path."""
