"""wam-ref's inference engine: model inputs + seeds -> model-space action chunks, fast.

One understanding-tower pass per observation (the prefix K/V), then the whole Euler sampler of the generation tower
(`GenerationTower.denoise`). The speed options change which kernels run, never the arithmetic:
- fused: q/k/v and gate/up as one GEMM each, in the generation blocks and the understanding text layers (derived
  weights, see fused.FusedWeights), and the prefix pass of prefix.PrefixPass (no host synchronisation); off: the
  reference path (transformers' forward for the prefix, one GEMM per projection).
- cuda_graphs: on a CUDA device the whole denoising loop is one CUDA graph per batch bucket (batches are padded up
  to the next bucket); `capture` happens on first use of a bucket, or up front through `WamRefPolicy.warmup`.
- prefix_graphs (with cuda_graphs): the prefix pass (vision + understanding tower) is a CUDA graph per bucket too,
  writing the K/V straight into the denoising graph's input buffers. A capture that fails falls back to the eager
  prefix for that bucket (with a warning; `prefix_graph_errors` holds why).
- kv_layout: the prefix K/V during denoising, "expanded" (repeated to all query heads once per observation: SDPA
  then runs without GQA, so a fused masked-attention kernel can take it), "room" (kv heads only, SDPA with
  enable_gqa) or "folded" (kv heads only; each kv head's query heads stacked along the query axis, so SDPA runs
  without GQA over a quarter of expanded's K/V bytes: model.attend). Either way the action tokens' K/V go into
  free slots in place. prefix_fold (the policy's) folds the prefix pass's text attention the same way
  (prefix.PrefixPass._fold_mask).
- compile: torch.compile of each generation block, the prefix's text layers (compile_prefix: two functions per
  layer around attention, or each norm, MLP and the rotary embedding on its own) and the vision layers (fuses the
  elementwise work around the GEMMs); needs a working Inductor backend (Triton on GPUs).
- gemm: the denoising loop's GEMM kernels: cublas (F.linear), triton (skinny.py's split-K kernel where the loop has
  <= 64 rows; its tile / split per shape tuned on the real weights on first use of a row count, `gemm_tuning`),
  autotune (the generation blocks' functions compiled in Inductor's max-autotune mode: Triton templates vs cuBLAS).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Sequence

import torch

from wamkit.policies.wam_ref.config import KV_LAYOUTS, Placement, bucket_for
from wamkit.policies.wam_ref import skinny
from wamkit.policies.wam_ref.fused import FusedWeights
from wamkit.policies.wam_ref.model import Prefix, WamRefModel, head_dim_of, write_heads
from wamkit.policies.wam_ref.prefix import PrefixPass


class InferenceEngine:
    def __init__(self, model: WamRefModel, text_config, *, horizon: int, model_action_dim: int, state_dim: int,
                 placement: Placement, cuda_graphs: bool, kv_layout: str, compile: bool,
                 buckets: tuple[int, ...], image_slots: list[tuple[int, int]], fused: bool = True,
                 prefix_graphs: bool = True, gemm: str = "cublas"):
        self.model, self.text_config = model, text_config
        self.horizon, self.model_action_dim, self.state_dim = horizon, model_action_dim, state_dim
        self.placement = placement
        self.cuda_graphs, self.kv_layout, self.compile = cuda_graphs, kv_layout, compile
        self.fused, self.prefix_graphs = fused, prefix_graphs
        self.buckets = buckets
        self.weights = FusedWeights(model)
        self.prefix_pass = PrefixPass(model, image_slots)
        self.emulate_graphs = False   # tests: run the graph plumbing (static buffers, buckets) eagerly on the CPU
        self.prefix_graph_errors: dict[tuple, str] = {}
        self.phase_ms: dict[str, float] | None = None   # set to {} (bench): sample() fills in prefix / denoise ms
        self._graphs: dict[tuple, _DenoiseGraph] = {}
        self._prefix_graphs: dict[tuple, _PrefixGraph | None] = {}
        self._graph_pool: dict[str, Any] = {}
        self._graph_weights = 0
        self._buffers: dict[tuple, dict[str, Any]] = {}
        self.gemm_tuning: dict[tuple, dict] = {}   # gemm=triton: (BLOCK_M, N, K) -> skinny.tune's result
        self._tuned: set[tuple[int, bool]] = set()
        self._gemm = "cublas"
        self.gemm = gemm

    @property
    def gemm(self) -> str:
        """Which kernels run the denoising loop's GEMMs: cublas | triton | autotune (see the module docstring)."""
        return self._gemm

    @gemm.setter
    def gemm(self, value: str) -> None:
        if value not in skinny.GEMM_CHOICES:
            raise ValueError(f"gemm must be one of {', '.join(skinny.GEMM_CHOICES)}, got {value!r}")
        self._gemm = value
        for blk in self.model.gen.blocks:
            blk.gemm = value

    def tune_gemms(self, rows: int, fw: FusedWeights | None) -> None:
        """gemm=triton on a CUDA device: the skinny kernel's config for each GEMM shape of the loop at this row count,
        measured once per row block over every block's weights (skinny.tune); no-op otherwise."""
        if self.gemm != "triton" or self.placement.device.type != "cuda" or rows > skinny.MAX_ROWS:
            return
        ok, _ = skinny.available()
        if not ok:
            return
        bm = skinny.block_m(rows)
        if (bm, fw is not None) in self._tuned:
            return
        blocks = self.model.gen.blocks
        if fw is not None:
            groups = [[w for w, _ in fw.gen], [w for _, w in fw.gen]]
        else:
            groups = [[getattr(b, name).weight for b in blocks] for name in ("q_proj", "k_proj", "v_proj",
                                                                              "gate_proj", "up_proj")]
        groups += [[b.o_proj.weight for b in blocks], [b.down_proj.weight for b in blocks]]
        for ws in groups:
            key = (bm, *ws[0].shape)
            if key not in self.gemm_tuning:
                self.gemm_tuning[key] = skinny.tune(rows, ws)
                if self.gemm_tuning[key]["config"] is None:   # no config ran here: keep serving, on cuBLAS
                    warnings.warn(f"wam-ref gemm=triton: the skinny kernel did not run for {key} "
                                  f"({self.gemm_tuning[key]['errors']}); using gemm=cublas")
                    self.gemm = "cublas"
                    return
        self._tuned.add((bm, fw is not None))

    @property
    def gen_tokens(self) -> int:
        """Tokens of the generation tower: the action chunk (+ one state token)."""
        return self.horizon + (1 if self.state_dim > 0 else 0)

    @property
    def kv_layout(self) -> str:
        """The prefix K/V layout while denoising: expanded | room | folded (see the module docstring)."""
        return self._kv_layout

    @kv_layout.setter
    def kv_layout(self, value: str) -> None:
        if value not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {value!r}")
        self._kv_layout = value
        for blk in self.model.gen.blocks:
            blk.fold_gqa = value == "folded"

    def kv_heads(self) -> int:
        """Heads of the denoising loop's K/V buffers: every query head's (expanded) or the kv heads'."""
        tc = self.text_config
        return tc.num_attention_heads if self.kv_layout == "expanded" else tc.num_key_value_heads

    def graphed(self) -> bool:
        """Whether sample() replays CUDA graphs (cuda_graphs on a CUDA device)."""
        return self.cuda_graphs and (self.placement.device.type == "cuda" or self.emulate_graphs)

    def fused_weights(self) -> FusedWeights | None:
        """The fused weights, up to date (None when fused is off or unavailable: meta device, sharded)."""
        if not self.fused or not self.weights.available():
            return None
        fw = self.weights.get()
        if fw.storage_generation != self._graph_weights:   # graphs captured over freed fused tensors: recapture
            self.release_graphs()
            self._graph_weights = fw.storage_generation
        return fw

    def noise(self, seeds: Sequence[int]) -> torch.Tensor:
        """(N, horizon, model_action_dim) float32 noise; row i comes from its own generator seeded by seeds[i]."""
        rows = [torch.randn((self.horizon, self.model_action_dim),
                            generator=torch.Generator().manual_seed(int(s) % (2 ** 63))) for s in seeds]
        return torch.stack(rows) if rows else torch.zeros((0, self.horizon, self.model_action_dim))

    def encode(self, inputs: dict[str, torch.Tensor], fw: FusedWeights | None) -> Prefix:
        """The prefix pass: prefix.PrefixPass with fused weights, else transformers' forward (the reference)."""
        if fw is not None:
            return self.prefix_pass(inputs, fw)
        return self.model.encode_prefix(inputs["input_ids"], inputs["attention_mask"], inputs["mm_token_type_ids"],
                                        inputs["pixel_values"], inputs["image_grid_thw"], inputs.get("position_ids"))

    @torch.no_grad()
    def sample(self, inputs: dict[str, torch.Tensor], seeds: Sequence[int], steps: int) -> torch.Tensor:
        """Model-space action chunks (N, horizon, model_action_dim) float32: one prefix pass, then Euler steps."""
        fw = self.fused_weights()
        x = self.noise(seeds).to(self.placement.device, torch.float32)
        marks = [self._mark()]
        if self.graphed():
            out = self.sample_graphed(inputs, x, inputs.get("state"), steps, fw, marks)
        else:
            with torch.profiler.record_function("wamkit.prefix"):
                prefix = self.encode(inputs, fw)
            marks.append(self._mark())
            self.tune_gemms(x.shape[0] * self.gen_tokens, fw)
            with torch.profiler.record_function("wamkit.denoise"):
                room = prefix.with_room(self.gen_tokens, self.kv_heads())
                out = self.model.gen.denoise(room, x, inputs.get("state"), steps, None if fw is None else fw.gen)
        marks.append(self._mark())
        if self.phase_ms is not None:
            self.phase_ms = dict(zip(("prefix", "denoise"), _elapsed_ms(marks)))
        return out

    def _mark(self):
        """A phase boundary for phase_ms: a recorded CUDA event (device time), or the host clock on the CPU."""
        if self.phase_ms is None:
            return None
        if self.placement.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    # ------------------------------------------------------------------ CUDA graphs
    def graph_bucket(self, n: int) -> int:
        return bucket_for(self.buckets, n)

    def sample_graphed(self, inputs, x: torch.Tensor, state, steps: int, fw: FusedWeights | None,
                       marks: list | None = None) -> torch.Tensor:
        """The Euler loop (and with prefix_graphs the prefix pass) replayed from CUDA graphs: the batch is padded
        to a bucket (`buckets`), its inputs copied into static buffers shared by every bucket's graph. Same
        arithmetic as the eager path; which GPU kernels run (and so the last bits) can differ from eager and
        between buckets."""
        n, s = x.shape[0], inputs["input_ids"].shape[1]
        bucket = self.graph_bucket(n)
        self.tune_gemms(bucket * self.gen_tokens, fw)
        key = (bucket, steps, s, self.kv_layout, fw is not None, self.gemm)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = _DenoiseGraph(self, bucket, steps, s, fw)
        pg = self.prefix_graph(bucket, s, fw) if self.prefix_graphs else None
        marks = [] if marks is None else marks
        with torch.profiler.record_function("wamkit.prefix"):
            if pg is not None:
                pg.run(inputs, n)
            else:
                g.fill(self.encode(inputs, fw), n)
        marks.append(self._mark())
        with torch.profiler.record_function("wamkit.denoise"):
            return g.run_prefilled(x, state)

    def prefix_graph(self, bucket: int, s: int, fw: FusedWeights | None) -> "_PrefixGraph | None":
        """The prefix graph of a bucket (captured on first use); None when its capture failed (eager prefix)."""
        key = (bucket, s, self.kv_layout, fw is not None)
        if key not in self._prefix_graphs:
            try:
                self._prefix_graphs[key] = _PrefixGraph(self, bucket, s, fw)
            except Exception as e:  # noqa: BLE001 - a capture that fails leaves the eager prefix, and says why
                self.prefix_graph_errors[key] = f"{type(e).__name__}: {e}"
                warnings.warn(f"wam-ref: prefix CUDA graph for batch bucket {bucket} failed ({type(e).__name__}: "
                              f"{e}); this bucket's prefix runs eagerly")
                self._prefix_graphs[key] = None
        return self._prefix_graphs[key]

    def graph_pool(self, kind: str = "denoise"):
        """The memory pool shared by the graphs of one kind (denoise | prefix: apart, so that a prefix capture that
        fails cannot leave the denoising graphs' pool half-used)."""
        if self.emulate_graphs:
            return None
        if kind not in self._graph_pool:
            self._graph_pool[kind] = torch.cuda.graph_pool_handle()
        return self._graph_pool[kind]

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
        self._prefix_graphs.clear()
        self.prefix_graph_errors.clear()
        self._graph_pool = {}
        self._buffers.clear()

    # ------------------------------------------------------------------ compile
    def enable_compile(self) -> None:
        """torch.compile (Inductor) of the generation blocks, the prefix pass's text layers (PrefixPass.compile_as),
        and the understanding tower's modules (_compile_understanding), in place. Dynamo's automatic dynamic shapes: the
        second batch size seen recompiles with a symbolic batch dimension."""
        import torch._dynamo

        self.compile = True
        for k in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                  "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, k):
                setattr(torch._dynamo.config, k, max(getattr(torch._dynamo.config, k), 256))
        self.prefix_pass.compiled = True
        for blk in self.model.gen.blocks:
            blk.compiled = True   # its two pure functions, compiled once for all blocks (see GenBlock)
        _compile_understanding(self.model.und)


def twin_engine(eng: InferenceEngine) -> InferenceEngine:
    """A second engine over the same model and fused weights, with its own CUDA graphs, memory pools and static
    buffers, so the two can compute at the same time (on two streams, from two threads: the server's
    concurrent_batches). Its compile setting is eng's (the model's compiled modules are shared; the prefix pass's
    compiled functions too, once eng has made them)."""
    twin = InferenceEngine(eng.model, eng.text_config, horizon=eng.horizon, model_action_dim=eng.model_action_dim,
                           state_dim=eng.state_dim, placement=eng.placement, cuda_graphs=eng.cuda_graphs,
                           kv_layout=eng.kv_layout, compile=eng.compile, buckets=eng.buckets,
                           image_slots=eng.prefix_pass.image_slots, fused=eng.fused,
                           prefix_graphs=eng.prefix_graphs, gemm=eng.gemm)
    twin.weights = eng.weights   # one set of fused copies, not two
    twin.emulate_graphs = eng.emulate_graphs
    for k in ("compiled", "fold", "causal", "compile_as", "_rope"):
        setattr(twin.prefix_pass, k, getattr(eng.prefix_pass, k))
    twin.gemm_tuning = eng.gemm_tuning
    return twin


def _compile_understanding(und) -> None:
    """`nn.Module.compile` of the understanding tower's text RMSNorms and MLPs and of each vision layer whole (its
    LayerNorms, rotary embedding, the transposes around attention, the residual adds and the MLP: eager kernels over
    every image token otherwise; its modules are not compiled on their own as well)."""
    for name, mod in und.named_modules():
        kind = type(mod).__name__
        if kind.endswith("VisionBlock"):
            mod.compile()
        elif (kind.endswith("RMSNorm") or kind.endswith("TextMLP")) and ".visual." not in f".{name}.":
            mod.compile()


def _elapsed_ms(marks: list) -> list[float]:
    """Milliseconds between consecutive marks (CUDA events: waits for the last one)."""
    if isinstance(marks[-1], torch.cuda.Event):
        marks[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]


class _Captured:
    """fn captured in a CUDA graph (warmed up first on a side stream: library handles, kernel selection,
    compilation), or, with the engine's emulate_graphs (CPU tests), kept and called eagerly at each replay."""

    def __init__(self, eng: InferenceEngine, fn: Callable[[], None], pool: str):
        self.fn, self.graph = fn, None
        if eng.emulate_graphs:
            return
        dev = eng.placement.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=eng.graph_pool(pool)):
            fn()

    def replay(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


class _DenoiseGraph:
    """One captured CUDA graph of the whole denoising loop (`GenerationTower.denoise`) for one (bucket, steps, S).

    Its inputs live in static buffers that every bucket's graph shares (views of the first `bucket` rows of one
    max-size set, so memory does not grow with the number of buckets); the graphs share one memory pool too, which
    is safe because they never run at the same time and leave nothing alive in it (the result is copied out)."""

    def __init__(self, eng: InferenceEngine, bucket: int, steps: int, s: int, fw: FusedWeights | None):
        m = eng.model
        self.s, self.steps, self.bucket = s, steps, bucket
        st = eng.static_buffers(s)
        self.keys = [k[:bucket] for k in st["keys"]]
        self.values = [v[:bucket] for v in st["values"]]
        self.key_mask, self.next_pos = st["key_mask"][:bucket], st["next_pos"][:bucket]
        self.x, self.out = st["x"][:bucket], st["out"][:bucket]
        self.state = st["state"][:bucket] if st["state"] is not None else None
        self.prefix = Prefix(self.keys, self.values, self.key_mask, self.next_pos)
        gen_fused = None if fw is None else fw.gen

        def loop():
            self.out.copy_(m.gen.denoise(self.prefix, self.x, self.state, steps, gen_fused))

        self.graph = _Captured(eng, loop, "denoise")

    def fill(self, prefix: Prefix, n: int) -> None:
        """The prefix of n observations into the static buffers (what a _PrefixGraph does inside its graph)."""
        for dsts, srcs in ((self.keys, prefix.keys), (self.values, prefix.values)):
            for dst, src in zip(dsts, srcs):
                write_heads(dst, src, 0)
        self.key_mask[:n, :self.s].copy_(prefix.key_mask)
        self.next_pos[:n].copy_(prefix.next_pos)

    def run_prefilled(self, x: torch.Tensor, state) -> torch.Tensor:
        """Replay with the prefix buffers already filled (by `fill` or a _PrefixGraph). Rows past n keep whatever
        they held (finite values from an earlier call or the initial zeros/ones): every row is computed
        independently, so they cannot change rows < n."""
        n = x.shape[0]
        self.x[:n].copy_(x)
        if self.state is not None:
            self.state[:n].copy_(state.to(self.state.dtype))
        self.graph.replay()
        return self.out[:n].clone()


class _PrefixGraph:
    """One captured CUDA graph of the prefix pass (prefix.PrefixPass: vision + understanding tower) for one
    (bucket, S): its model inputs in static buffers (rows past the batch keep earlier, finite values), its K/V,
    key mask and next positions written straight into the denoising graphs' static buffers (`static_buffers`)."""

    def __init__(self, eng: InferenceEngine, bucket: int, s: int, fw: FusedWeights | None):
        dev = eng.placement.device
        slots = eng.prefix_pass.image_slots
        vis = eng.model.und.visual.config
        tokens = slots[0][1]
        self.rows_per_obs = len(slots) * tokens * vis.spatial_merge_size ** 2   # patches per observation
        patch_dim = vis.in_channels * vis.temporal_patch_size * vis.patch_size ** 2
        self.inputs = {"input_ids": torch.zeros(bucket, s, dtype=torch.long, device=dev),
                       "attention_mask": torch.ones(bucket, s, dtype=torch.long, device=dev),
                       "position_ids": torch.zeros(3, bucket, s, dtype=torch.long, device=dev),
                       "pixel_values": torch.zeros(bucket * self.rows_per_obs, patch_dim, device=dev,
                                                   dtype=eng.placement.dtype)}
        st = eng.static_buffers(s)
        keys, values = [k[:bucket] for k in st["keys"]], [v[:bucket] for v in st["values"]]
        key_mask, next_pos = st["key_mask"][:bucket, :s], st["next_pos"][:bucket]

        def prefix():
            p = eng.prefix_pass(self.inputs, fw)
            for dsts, srcs in ((keys, p.keys), (values, p.values)):
                for dst, src in zip(dsts, srcs):
                    write_heads(dst, src, 0)
            key_mask.copy_(p.key_mask)
            next_pos.copy_(p.next_pos)

        self.graph = _Captured(eng, prefix, "prefix")

    def run(self, inputs: dict[str, torch.Tensor], n: int) -> None:
        st = self.inputs
        st["input_ids"][:n].copy_(inputs["input_ids"])
        st["attention_mask"][:n].copy_(inputs["attention_mask"])
        st["position_ids"][:, :n].copy_(inputs["position_ids"])
        st["pixel_values"][:n * self.rows_per_obs].copy_(inputs["pixel_values"])
        self.graph.replay()
