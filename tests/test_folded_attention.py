"""wam-ref attention=triton (policies/wam_ref/folded_attention.py): the loop's folded attention as a Triton kernel
gives SDPA's result (run in Triton's CPU interpreter: with and without the key mask, split over the keys or not, a
split whose keys are all masked, fp16, the output written token-major), and a policy built with it gives the
actions of attention=sdpa while the kernel really runs; the kernels compile for sm_90 ahead of time (the
interpreter runs no compiler); where it cannot run (no Triton, no CUDA, no interpreter) the policy falls back to
SDPA."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

from wamkit.core.errors import UserError
from wamkit.core.types import Observation
from wamkit.policies import make_policy
from triton_interpreter import interpret, needs_interpreter
from wamkit.policies.wam_ref import folded_attention as fa

KERNEL_CHECK = textwrap.dedent("""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from wamkit.core.types import Observation
    from wamkit.policies import make_policy
    from wamkit.policies.wam_ref import folded_attention as fa
    from wamkit.policies.wam_ref.model import additive_mask

    assert fa.available()[0], fa.available()
    g = torch.Generator().manual_seed(0)

    def check(b, kvh, m, n, hd, masked=None, splits=None, dtype=torch.float32, tol=1e-5, tokens=None):
        q, k, v = (torch.randn(b, kvh, r, hd, generator=g).to(dtype) for r in (m, n, n))
        mask = None
        if masked is not None:
            keep = torch.ones(b, n, dtype=torch.bool)
            keep[:, masked[0]:masked[1]] = False
            mask = additive_mask(keep, dtype)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                             attn_mask=None if mask is None else mask.float())
        got = fa.folded_attention(q, k, v, mask, splits, tokens)
        if tokens is not None:   # token-major: row g * tokens + t of kv head h is head h * group + g, token t
            assert got.is_contiguous()
            ref = ref.view(b, kvh, m // tokens, tokens, hd).permute(0, 3, 1, 2, 4).reshape(b, tokens, -1, hd)
        assert got.dtype == dtype and got.shape == ref.shape
        d = float((got.float() - ref).abs().max())
        assert d < tol, (b, kvh, m, n, hd, masked, splits, dtype, d)

    check(2, 2, 8, 70, 16)                                # 4 programs < 132 SMs: the keys split in two
    check(2, 2, 8, 70, 16, splits=1)                      # one program per (batch, kv head)
    check(2, 2, 8, 70, 16, masked=(20, 60))
    check(2, 2, 8, 70, 16, masked=(20, 60), splits=1)
    check(1, 2, 20, 200, 32, masked=(64, 128), splits=3)  # the middle split's keys all masked
    check(3, 1, 40, 33, 16, masked=(5, 9))                # rows and keys not multiples of the blocks
    check(1, 1, 40, 150, 16, masked=(10, 20))             # split: the combine over 3 row tiles, the last part-live
    check(1, 2, 16, 100, 16, masked=(50, 90), dtype=torch.float16, tol=5e-3)   # (the interpreter has no bf16)
    check(2, 2, 12, 70, 16, masked=(20, 60), tokens=3)    # written token-major: 4 query heads a kv head, split
    check(2, 2, 12, 70, 16, masked=(20, 60), splits=1, tokens=3)
    check(1, 3, 5, 40, 16, tokens=5)                      # one query head a kv head: token-major is (B, n, Hkv, hd)
    assert fa.splits_for(512, 292, 132) == 1 and fa.splits_for(8, 292, 132) == 5

    # the model's call: (B, heads, n, hd) as SDPA's, a view of the token-major output
    from wamkit.policies.wam_ref.model import attend_folded
    qf, kk, vv = torch.randn(2, 2, 12, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g), torch.randn(
        2, 2, 40, 16, generator=g)
    a = attend_folded(qf, kk, vv, None, 8, "triton")
    assert a.shape == (2, 8, 3, 16) and a.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(a, attend_folded(qf, kk, vv, None, 8, "sdpa"), rtol=1e-5, atol=1e-5)

    # a policy: the kernel inside the denoising loop gives attention=sdpa's actions, and runs
    rng = np.random.default_rng(0)
    obs = [Observation({c: rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for c in ("image", "wrist_image")},
                       rng.standard_normal(8).astype(np.float32), f"task {i}") for i in range(3)]
    ref = make_policy("wam-ref", size="tiny", num_inference_steps=2, state_dim=8, attention="sdpa")
    tri = make_policy("wam-ref", size="tiny", num_inference_steps=2, state_dim=8)   # attention=triton: the default
    calls = []
    real = fa.folded_attention
    fa.folded_attention = lambda *a, **k: calls.append(1) or real(*a, **k)
    a, b = ref.predict(obs, [1, 2, 3]), tri.predict(obs, [1, 2, 3])
    blocks = len(tri.model.gen.blocks)
    assert len(calls) == 2 * blocks, (len(calls), blocks)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    print("KERNEL_OK")
""")


@needs_interpreter
def test_kernel_equals_sdpa_in_the_interpreter():
    r = interpret(KERNEL_CHECK, timeout=600)
    assert r.returncode == 0 and "KERNEL_OK" in r.stdout, r.stdout + r.stderr[-4000:]


HOPPER_COMPILE = textwrap.dedent("""
    import inspect
    import subprocess
    import sys
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from wamkit.policies.wam_ref import folded_attention as fa

    KINDS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "mask_ptr": "*bf16", "o_ptr": "*bf16",
             "part_ptr": "*fp32", "stat_ptr": "*fp32", "scale": "fp32"}

    def compile_(kernel, const, warps):
        names = inspect.signature(kernel.fn).parameters
        sig = {n: "constexpr" if n in const else KINDS.get(n, "i32") for n in names}
        src = ASTSource(fn=kernel, signature=sig, constexprs=const)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 2})

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    for split, per in ((1, 320), (5, 64)):   # nano batch 64 (292 keys, one split) and batch 1 (five)
        for warps in (4, 8):
            k = compile_(fa._attn_kernel, {"HAS_MASK": True, "SPLIT": split, "PER_SPLIT": per, "BLOCK_M": 64,
                                           "BLOCK_N": 64, "D": 128}, warps)
            Path("k.cubin").write_bytes(k.asm["cubin"])
            use = subprocess.run([str(tool), "-res-usage", "k.cubin"], capture_output=True, text=True).stdout
            print(split, warps, [ln.strip() for ln in use.splitlines() if "REG:" in ln])
    compile_(fa._combine_kernel, {"SPLIT": 5, "BLOCK_M": 64, "ROWS": fa.COMBINE_ROWS, "D": 128}, 4)
    print("COMPILED")
""")


@needs_interpreter
def test_kernels_compile_for_hopper(tmp_path):
    """The interpreter runs Python, not Triton's compiler: the kernels also compile for sm_90 at nano's shapes (Triton
    compiles ahead of time here, no GPU needed), one split and five, 4 and 8 warps."""
    r = interpret(f"import os; os.chdir({str(tmp_path)!r})\n" + HOPPER_COMPILE, interpreter=False, timeout=600)
    assert r.returncode == 0 and "COMPILED" in r.stdout, r.stdout + r.stderr[-4000:]


def test_splits_cover_the_keys_once():
    """Splits only where the programs leave SMs idle, never more than there are key blocks, each split >= 1."""
    assert fa.splits_for(512, 292, 132) == 1          # batch 64 x 8 kv heads: one program each fills the GPU
    assert fa.splits_for(8, 292, 132) == 5            # batch 1: the 5 key blocks of 64 over 40 programs
    assert fa.splits_for(8, 64, 132) == 1             # one key block: nothing to split
    for programs in (1, 3, 8, 40, 200):
        for keys in (1, 63, 64, 65, 292, 1000):
            s = fa.splits_for(programs, keys, 132)
            blocks = -(-keys // fa.BLOCK_N)
            assert 1 <= s <= blocks


def test_triton_attention_falls_back_to_sdpa_where_it_cannot_run():
    """attention=triton on a host where the kernel cannot run (this CPU without the interpreter): SDPA, the same
    actions; an unknown choice is refused with the choices."""
    if fa.applies(torch.zeros(1, 1, 16, 16), "triton"):
        pytest.skip("the kernel runs here (CUDA or TRITON_INTERPRET=1)")
    rng = np.random.default_rng(1)
    obs = [Observation({c: rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for c in ("image", "wrist_image")},
                       np.zeros(8, np.float32), "pick") for _ in range(2)]
    ref = make_policy("wam-ref", size="tiny", num_inference_steps=2, state_dim=8, attention="sdpa")
    tri = make_policy("wam-ref", size="tiny", num_inference_steps=2, state_dim=8)   # attention=triton: the default
    assert all(b.attention == "triton" for b in tri.model.gen.blocks)
    np.testing.assert_array_equal(tri.predict(obs, [4, 5]), ref.predict(obs, [4, 5]))
    with pytest.raises(UserError, match="attention must be one of sdpa, triton"):
        make_policy("wam-ref", size="tiny", attention="flash")


def test_token_major_attention_output_needs_no_copy_before_the_output_projection():
    """The compiled code after attention (model._block_out) reads attention's output through a transposing reshape:
    given SDPA's layout (B, heads, n, hd) contiguous, Inductor copies it (a clone kernel) before the output
    projection; given the Triton kernel's token-major output (its transpose), it runs no such copy."""
    from torch._inductor.utils import run_and_get_code
    from wamkit.policies.wam_ref import model as wm
    b, n, heads, hd, hidden, ffn = 2, 4, 4, 16, 64, 96
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, n, hidden, generator=g)
    mods = [torch.randn(b, hidden, generator=g) for _ in range(4)]
    weights = (torch.randn(hidden, heads * hd, generator=g), torch.randn(2 * ffn, hidden, generator=g),
               torch.randn(hidden, ffn, generator=g))
    a = torch.randn(b, heads, n, hd, generator=g)
    outs, codes = [], []
    for layout in (a, a.transpose(1, 2).contiguous().transpose(1, 2)):
        torch._dynamo.reset()
        out, code = run_and_get_code(torch.compile(wm._block_out, fullgraph=True), x, layout, *mods, *weights, 1e-6)
        outs.append(out)
        codes.append("\n".join(code))
    assert "clone" in codes[0]          # the check can fail: SDPA's layout is copied
    assert "clone" not in codes[1]
    torch.testing.assert_close(outs[1], outs[0])
