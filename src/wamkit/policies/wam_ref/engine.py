"""wam-ref's inference engine: model inputs + seeds -> model-space action chunks, fast.

One understanding-tower pass per observation (the prefix K/V), then the whole Euler sampler of the generation tower
(`GenerationTower.denoise`). The speed options change which kernels run, never the arithmetic:
- cuda_graphs: on a CUDA device the whole denoising loop is one CUDA graph per batch bucket (batches are padded up
  to the next bucket); `capture` happens on first use of a bucket, or up front through `WamRefPolicy.warmup`.
- kv_layout: the prefix K/V during denoising, "expanded" (repeated to all query heads once per observation: SDPA
  then runs without GQA, so a fused masked-attention kernel can take it) or "room" (kv heads only, SDPA with
  enable_gqa). Either way the action tokens' K/V go into free slots in place.
- compile: torch.compile of each generation block and of the understanding tower's norms and MLPs (fuses the
  elementwise work around the GEMMs); needs a working Inductor backend (Triton on GPUs).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from wamkit.policies.wam_ref.config import Placement
from wamkit.policies.wam_ref.model import Prefix, WamRefModel, head_dim_of, write_heads


class InferenceEngine:
    def __init__(self, model: WamRefModel, text_config, *, horizon: int, model_action_dim: int, state_dim: int,
                 placement: Placement, cuda_graphs: bool, kv_layout: str, compile: bool,
                 buckets: tuple[int, ...]):
        self.model, self.text_config = model, text_config
        self.horizon, self.model_action_dim, self.state_dim = horizon, model_action_dim, state_dim
        self.placement = placement
        self.cuda_graphs, self.kv_layout, self.compile = cuda_graphs, kv_layout, compile
        self.buckets = buckets
        self._graphs: dict[tuple, _DenoiseGraph] = {}
        self._graph_pool = None
        self._buffers: dict[tuple, dict[str, Any]] = {}

    @property
    def gen_tokens(self) -> int:
        """Tokens of the generation tower: the action chunk (+ one state token)."""
        return self.horizon + (1 if self.state_dim > 0 else 0)

    def kv_heads(self) -> int:
        tc = self.text_config
        return tc.num_attention_heads if self.kv_layout == "expanded" else tc.num_key_value_heads

    def graphed(self) -> bool:
        """Whether sample() replays CUDA graphs (cuda_graphs on a CUDA device)."""
        return self.cuda_graphs and self.placement.device.type == "cuda"

    def noise(self, seeds: Sequence[int]) -> torch.Tensor:
        """(N, horizon, model_action_dim) float32 noise; row i comes from its own generator seeded by seeds[i]."""
        rows = [torch.randn((self.horizon, self.model_action_dim),
                            generator=torch.Generator().manual_seed(int(s) % (2 ** 63))) for s in seeds]
        return torch.stack(rows) if rows else torch.zeros((0, self.horizon, self.model_action_dim))

    @torch.no_grad()
    def sample(self, inputs: dict[str, torch.Tensor], seeds: Sequence[int], steps: int) -> torch.Tensor:
        """Model-space action chunks (N, horizon, model_action_dim) float32: one prefix pass, then Euler steps."""
        m = self.model
        prefix: Prefix = m.encode_prefix(inputs["input_ids"], inputs["attention_mask"], inputs["mm_token_type_ids"],
                                         inputs["pixel_values"], inputs["image_grid_thw"], inputs.get("position_ids"))
        x = self.noise(seeds).to(self.placement.device, torch.float32)
        if self.graphed():
            return self.sample_graphed(prefix, x, inputs.get("state"), steps)
        room = prefix.with_room(self.gen_tokens, self.kv_heads())
        return m.gen.denoise(room, x, inputs.get("state"), steps)

    # ------------------------------------------------------------------ CUDA graphs
    def graph_bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        return n

    def sample_graphed(self, prefix: Prefix, x: torch.Tensor, state, steps: int) -> torch.Tensor:
        """The Euler loop replayed from a CUDA graph: the batch is padded to a bucket (`buckets`), its inputs
        copied into static buffers shared by every bucket's graph. Same arithmetic as the eager loop; which GPU
        kernels run (and so the last bits) can differ from eager and between buckets."""
        n, s = x.shape[0], prefix.key_mask.shape[1]
        bucket = self.graph_bucket(n)
        key = (bucket, steps, s, self.kv_layout)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = _DenoiseGraph(self, bucket, steps, s)
        return g.run(prefix, x, state)

    def graph_pool(self):
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def static_buffers(self, s: int) -> dict[str, Any]:
        """The graphs' input/output buffers at the largest bucket (allocated once per prefix length and layout)."""
        key = (s, self.kv_layout)
        st = self._buffers.get(key)
        if st is not None:
            return st
        top = max(self.buckets)
        hd = head_dim_of(self.text_config)
        heads, n, dev, dt = self.kv_heads(), self.gen_tokens, self.placement.device, self.placement.dtype
        L = len(self.model.gen.blocks)
        st = {"keys": [torch.zeros(top, heads, s + n, hd, device=dev, dtype=dt) for _ in range(L)],
              "values": [torch.zeros(top, heads, s + n, hd, device=dev, dtype=dt) for _ in range(L)],
              "key_mask": torch.ones(top, s + n, dtype=torch.bool, device=dev),
              "next_pos": torch.zeros(top, dtype=torch.long, device=dev),
              "x": torch.zeros(top, self.horizon, self.model_action_dim, device=dev, dtype=torch.float32),
              "out": torch.zeros(top, self.horizon, self.model_action_dim, device=dev, dtype=torch.float32),
              "state": torch.zeros(top, self.state_dim, device=dev, dtype=dt) if self.state_dim > 0 else None}
        self._buffers[key] = st
        return st

    def release_graphs(self) -> None:
        """Drop every captured CUDA graph, their memory pool and static buffers (e.g. before changing kv_layout)."""
        self._graphs.clear()
        self._graph_pool = None
        self._buffers.clear()

    # ------------------------------------------------------------------ compile
    def enable_compile(self) -> None:
        """torch.compile (Inductor) of the generation blocks and of the understanding tower's RMSNorms and MLPs, in
        place (`nn.Module.compile`). Dynamo's automatic dynamic shapes: the second batch size seen recompiles with
        a symbolic batch dimension."""
        import torch._dynamo

        self.compile = True
        for k in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                  "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, k):
                setattr(torch._dynamo.config, k, max(getattr(torch._dynamo.config, k), 256))
        for blk in self.model.gen.blocks:
            blk.compiled = True   # its two pure functions, compiled once for all blocks (see GenBlock)
        for name, mod in self.model.und.named_modules():
            kind = type(mod).__name__
            if kind.endswith("RMSNorm") or kind.endswith("TextMLP") or kind.endswith("VisionMLP"):
                mod.compile()


class _DenoiseGraph:
    """One captured CUDA graph of the whole denoising loop (`GenerationTower.denoise`) for one (bucket, steps, S).

    Its inputs live in static buffers that every bucket's graph shares (views of the first `bucket` rows of one
    max-size set, so memory does not grow with the number of buckets); the graphs share one memory pool too, which
    is safe because they never run at the same time and leave nothing alive in it (the result is copied out)."""

    def __init__(self, eng: InferenceEngine, bucket: int, steps: int, s: int):
        m = eng.model
        self.s, self.steps, self.bucket = s, steps, bucket
        st = eng.static_buffers(s)
        self.keys = [k[:bucket] for k in st["keys"]]
        self.values = [v[:bucket] for v in st["values"]]
        self.key_mask, self.next_pos = st["key_mask"][:bucket], st["next_pos"][:bucket]
        self.x, self.out = st["x"][:bucket], st["out"][:bucket]
        self.state = st["state"][:bucket] if st["state"] is not None else None
        self.prefix = Prefix(self.keys, self.values, self.key_mask, self.next_pos)
        dev = eng.placement.device

        def loop():
            self.out.copy_(m.gen.denoise(self.prefix, self.x, self.state, steps))

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            loop()  # warm-up outside the capture (library handles, kernel selection, compilation)
        torch.cuda.current_stream(dev).wait_stream(side)
        pool = eng.graph_pool()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            loop()

    def run(self, prefix: Prefix, x: torch.Tensor, state) -> torch.Tensor:
        # rows past n keep whatever they held (finite values from an earlier call or the initial zeros/ones):
        # every row is computed independently, so they cannot change rows < n
        n = x.shape[0]
        for dsts, srcs in ((self.keys, prefix.keys), (self.values, prefix.values)):
            for dst, src in zip(dsts, srcs):
                write_heads(dst, src, 0)
        self.key_mask[:n, :self.s].copy_(prefix.key_mask)
        self.next_pos[:n].copy_(prefix.next_pos)
        self.x[:n].copy_(x)
        if self.state is not None:
            self.state[:n].copy_(state.to(self.state.dtype))
        self.graph.replay()
        return self.out[:n].clone()
