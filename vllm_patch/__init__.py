"""Code that runs inside a vLLM server (`make vllm-env`): the hidden-state capture connector."""
