"""A small engine in plain torch: the student's forward pass over a KV cache of its own.

It reads the weights of a Hugging Face Llama or Qwen2 causal LM once (`state_dict`) and never calls the model
again. What an engine must match to serve cartridges: keys are cached *after* RoPE, in the Hugging Face
"rotate half" layout, one ``[kv_heads, tokens, head_dim]`` tensor per layer; a cartridge is exactly such a cache
for positions ``0..p-1``, so installing one is a copy (`KVCache.install`) and the prompt then runs at positions
``p..``. Simplicity over speed: one sequence at a time, no fused kernels.
"""

from __future__ import annotations

import torch

from cartridges_sdk.kit import UnsupportedModelError, architecture_of

ARCHITECTURES = ("llama", "qwen2")  # what this engine implements; anything else is refused by name


class KVCache:
    """One sequence's keys and values, per layer ``[kv_heads, capacity, head_dim]``: plain tensors the engine owns.
    `length` tokens are filled; the next token goes at position `length`."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device):
        shape = (kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = 0

    def install(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append a cartridge's per-layer KV as is: its keys were rotated for the positions it was made at, so
        several cartridges installed one after another are used in order, as `Cartridge.compose` places them."""
        start, n = self.length, layers[0][0].shape[1]
        for i, (k, v) in enumerate(layers):
            self.keys[i][:, start : start + n] = k
            self.values[i][:, start : start + n] = v
        self.length = start + n


class Engine:
    """The forward pass of a Llama or Qwen2 model: embeddings, then per layer RMSNorm, grouped-query attention with
    RoPE over the cache, RMSNorm, a SiLU-gated MLP; then the final norm and the output head."""

    def __init__(self, model):
        config = model.config
        self.arch = arch = architecture_of(config)
        _refuse_unsupported(config, arch)
        self.layers, self.kv_heads, self.head_dim = arch["num_layers"], arch["num_kv_heads"], arch["head_dim"]
        self.heads = config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.w = w = {name: t.detach() for name, t in model.state_dict().items()}  # plain tensors, by HF's names
        embed = w["model.embed_tokens.weight"]
        self.dtype, self.device = embed.dtype, embed.device
        self.lm_head = w.get("lm_head.weight", embed)  # tied embeddings: the output head is the embedding matrix
        # RoPE: dimension pair (i, i + head_dim/2) turns by position * inv_freq[i] (Hugging Face "rotate half")
        theta = float(arch["rope"]["rope_theta"])
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim)

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.layers, self.kv_heads, self.head_dim, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, ids: list[int], cache: KVCache, *, all_logits: bool = False) -> torch.Tensor:
        """Run `ids` at positions ``cache.length..``, appending their keys and values to the cache. Returns float32
        logits ``[vocab]`` for the last token, or ``[len(ids), vocab]`` for every one with `all_logits`."""
        start, n = cache.length, len(ids)
        if start + n > cache.keys[0].shape[1]:
            raise ValueError(f"{start + n} tokens do not fit a cache of {cache.keys[0].shape[1]}.")
        x = self.w["model.embed_tokens.weight"][torch.tensor(ids, device=self.device)]
        cos, sin = self._rope(torch.arange(start, start + n, device=self.device))
        for i in range(self.layers):
            x = x + self._attention(i, self._norm(x, f"model.layers.{i}.input_layernorm"), cache, cos, sin)
            x = x + self._mlp(i, self._norm(x, f"model.layers.{i}.post_attention_layernorm"))
        cache.length = start + n
        x = self._norm(x if all_logits else x[-1:], "model.norm")
        logits = (x @ self.lm_head.T).float()
        return logits if all_logits else logits[0]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.w.get(f"{name}.bias")  # Qwen2 has q/k/v biases; Llama none (unless attention_bias=True)
        y = x @ self.w[f"{name}.weight"].T
        return y if bias is None else y + bias

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RMSNorm, computed in float32 as transformers does."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.w[f"{name}.weight"] * h.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq.to(positions.device)[None]
        emb = torch.cat([angles, angles], dim=-1)  # [n, head_dim]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def _attention(self, i: int, x: torch.Tensor, cache: KVCache, cos, sin) -> torch.Tensor:
        p, n, d = f"model.layers.{i}.self_attn", x.shape[0], self.head_dim
        q = self._linear(x, f"{p}.q_proj").view(n, self.heads, d).transpose(0, 1)  # [heads, n, d]
        k = self._linear(x, f"{p}.k_proj").view(n, self.kv_heads, d).transpose(0, 1)  # [kv_heads, n, d]
        v = self._linear(x, f"{p}.v_proj").view(n, self.kv_heads, d).transpose(0, 1)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        start = cache.length
        cache.keys[i][:, start : start + n] = k  # stored post-RoPE: the layout a cartridge holds
        cache.values[i][:, start : start + n] = v
        keys, values = cache.keys[i][:, : start + n], cache.values[i][:, : start + n]
        # grouped-query attention: query head h reads KV head h // group
        group = self.heads // self.kv_heads
        q = q.reshape(self.kv_heads, group, n, d)
        scores = (q @ keys[:, None].transpose(-1, -2)).float() * d**-0.5  # [kv_heads, group, n, start + n]
        query_pos = torch.arange(start, start + n, device=x.device)[:, None]
        causal = torch.arange(start + n, device=x.device)[None, :] <= query_pos
        scores = scores.masked_fill(~causal, float("-inf"))
        out = scores.softmax(-1).to(values.dtype) @ values[:, None]  # [kv_heads, group, n, d]
        out = out.reshape(self.heads, n, d).transpose(0, 1).reshape(n, self.heads * d)
        return self._linear(out, f"{p}.o_proj")

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp"
        gate = torch.nn.functional.silu(self._linear(x, f"{p}.gate_proj"))
        return self._linear(gate * self._linear(x, f"{p}.up_proj"), f"{p}.down_proj")


def _refuse_unsupported(config, arch: dict) -> None:
    """Refuse, naming the fix, what this engine does not implement (rather than computing something else)."""
    fix = "serve this model with runtime='hf' / synthesizer='hf', or add the variant to cartridges_example/engine.py"
    if arch["model_type"] not in ARCHITECTURES:
        raise UnsupportedModelError(f"The example engine runs {list(ARCHITECTURES)} models, not "
                                    f"{arch['model_type']!r}; {fix}.")
    rope = arch["rope"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or rope.get("factor") is not None:
        raise UnsupportedModelError(f"The example engine implements plain RoPE, not rope_type={rope_type!r} "
                                    f"(rope scaling {rope}); {fix}.")
    unsupported = {
        "partial_rotary_factor": arch.get("partial_rotary_factor", 1.0) not in (None, 1.0),
        "hidden_act": getattr(config, "hidden_act", "silu") != "silu",
        "use_sliding_window": bool(getattr(config, "use_sliding_window", False)),
        "layer_types": any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()),
    }
    for name, bad in unsupported.items():
        if bad:
            raise UnsupportedModelError(f"The example engine does not implement {name}="
                                        f"{getattr(config, name, arch.get(name))!r}; {fix}.")
