"""The planner on CUDA (pure arithmetic, no GPU): what CUDA's kernels save, cuBLAS's workspaces,
the caching allocator's reserve (rayhybrid/plan/allocator.py), against the figures measured on an
H200 (issue 40: Llama 3.2 1B, seq 2048, bfloat16 autocast, dp1, torch.cuda.max_memory_allocated)."""

import json
import subprocess
import sys

import pytest

from rayhybrid.plan import allocator
from rayhybrid.plan.dry_run import build_plan
from rayhybrid.plan.peak_memory import rank_memory
from rayhybrid.preflight import load_config

MB = 2**20
MiB = 2**20
H200_MB = 143_156  # usable
H200_ALLOCATED_MB = {8: 69_006, 12: 95_238, 16: 121_440}  # micro-batch 17 ran out of memory
# As measured on the H200 (issue 40): the loss over whole logits, before train.loss_chunk.
SHAPE = ["model=llama3.2_1b", "data=synthetic", "data.seq_len=2048", "train.dtype=bfloat16", "train.loss_chunk=0"]


def llama_1b(mb: int):
    return load_config([*SHAPE, f"train.global_batch_size={mb}", f"train.micro_batch_size={mb}"])


def test_blocks_are_rounded_to_512_bytes_and_segments_to_the_pools_sizes():
    assert allocator.block_size(0) == 0
    assert allocator.block_size(1) == allocator.block_size(512) == 512
    assert allocator.block_size(513) == 1024
    # small pool: up to 1 MiB, 2 MiB segments
    assert allocator.segment_size(4) == allocator.segment_size(MiB) == 2 * MiB
    # large pool: under 10 MiB share 20 MiB segments; larger ones are rounded up to 2 MiB
    assert allocator.segment_size(MiB + 1) == allocator.segment_size(10 * MiB - 512) == 20 * MiB
    assert allocator.segment_size(10 * MiB) == 10 * MiB
    assert allocator.segment_size(10 * MiB + 1) == 12 * MiB
    assert allocator.segment_size(4_000 * MiB + 3) == 4_002 * MiB


def test_pool_waste_packs_small_and_middle_blocks_and_rounds_large_ones():
    assert allocator.pool_waste([]) == 0
    # 300 tensors of 8 KB (norm weights): 2.34 MiB of blocks in two 2 MiB segments
    assert allocator.pool_waste([8192] * 300) == 4 * MiB - 300 * 8192
    # five 4 MiB tensors share one 20 MiB segment, a sixth needs another
    assert allocator.pool_waste([4 * MiB] * 5) == 0
    assert allocator.pool_waste([4 * MiB] * 6) == 40 * MiB - 24 * MiB
    # a 11 MiB tensor gets a 12 MiB segment; odd bytes round to 512 then to the segment
    assert allocator.pool_waste([11 * MiB]) == MiB
    assert allocator.pool_waste([11 * MiB, 100]) == MiB + 2 * MiB - 100
    # the reserve: the live bytes, the rounding and one segment of the largest block
    assert allocator.reserved_bytes(100 * MiB, [11 * MiB], 31 * MiB - 5) == 100 * MiB + MiB + 32 * MiB


def test_the_cuda_plan_is_within_2_percent_of_the_h200_peaks_and_the_cpu_plan_keeps_its_count():
    for mb, measured in H200_ALLOCATED_MB.items():
        cfg = llama_1b(mb)
        cuda, cpu = rank_memory(cfg, 0, cuda=True), rank_memory(cfg, 0)
        assert abs(cuda.total / MB / measured - 1) < 0.02, (mb, cuda.total / MB, measured)
        # The difference is CUDA's fused RMSNorm (x/rms not kept: 2 s d per block, s d in the
        # head, float32) less cuBLAS's two workspaces.
        s_d = 4 * 2048 * 2048
        assert cpu.total - cuda.total == mb * (16 * 2 * s_d + s_d) - 2 * 32 * MB
        assert cpu.reserved == 0 and cuda.reserved > cuda.total


def test_the_reserved_plan_fits_16_on_an_h200_and_not_17():
    """Micro-batch 16 trained on the H200 and 17 ran out of memory: the reserved plan says so."""
    assert rank_memory(llama_1b(16), 0, cuda=True).reserved / MB < H200_MB
    assert rank_memory(llama_1b(17), 0, cuda=True).reserved / MB > H200_MB


def test_the_plan_device_defaults_from_the_backend_and_the_cli_chooses_it():
    cfg = llama_1b(8)
    assert build_plan(cfg)["memory"]["device"] == "cpu"
    assert build_plan(cfg)["memory"]["max_reserved_mb"] is None
    on_gpu = load_config([*SHAPE, "cluster.use_gpu=true"])
    assert build_plan(on_gpu)["memory"]["device"] == "cuda"
    assert build_plan(on_gpu, device="cpu")["memory"]["device"] == "cpu"
    plan = build_plan(cfg, device="cuda")["memory"]
    assert plan["max_reserved_mb"] > plan["max_mb"]
    (mem,) = plan["per_pp_rank"]
    parts = ("params", "grads", "optimizer", "activations", "pipeline_buffers", "transient", "batch")
    parts += ("dp_buffers", "autocast_weights", "workspace")
    assert sum(mem[f"{k}_mb"] for k in parts) == pytest.approx(mem["total_mb"]) and mem["workspace_mb"] == 64
    assert mem["reserved_mb"] == plan["max_reserved_mb"]
    run = [sys.executable, "-m", "rayhybrid.plan", "--json", *SHAPE, "--device", "cuda"]
    out = subprocess.run(run, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["memory"]["device"] == "cuda"
    bad = subprocess.run([*run[:-1], "gpu"], check=False, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith("--device: is cpu or cuda, got 'gpu'")


def test_the_gpts_layernorm_saves_the_same_on_cuda_and_llamas_rmsnorm_less():
    for model, less in (("gpt_tiny", False), ("llama3_debug", True)):
        cfg = load_config([f"model={model}"])
        cpu, cuda = rank_memory(cfg, 0), rank_memory(cfg, 0, cuda=True)
        assert (cuda.activations < cpu.activations) is less and cuda.activations <= cpu.activations
        assert cpu.workspace == 0 and cuda.workspace == 2 * 32 * MB
