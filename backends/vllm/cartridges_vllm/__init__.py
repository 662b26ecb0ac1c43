"""cartridges-vllm: cartridges served from vLLM's paged KV cache (runtime + connector), and self-study synthesis on
vLLM's engine. vLLM is imported only when an engine starts (the connector module is loaded by vLLM itself)."""
