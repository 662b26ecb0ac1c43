"""cartridges-vllm: self-study synthesis on vLLM's engine. vLLM is imported only when an engine starts."""
