"""Other Llama-family architectures (tiny random weights): Qwen2 (qkv bias), Mistral (sliding window).

Weights are drawn with a large std so greedy choices are well separated; the engine must match
transformers' own generate, including attention limited to the sliding window.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.support.engine import run_to_completion
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, SamplingOptions
from shared.settings import WorkerSettings

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    eos_token_id=0,
    bos_token_id=1,
    pad_token_id=0,
)


def tiny(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32).eval()  # the engine edits it
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32).eval()
    ref.load_state_dict(model.state_dict())
    return model, ref


# CONVEYOR_CPU_ISA=avx2 (say) runs the kernel path on that build of the CPU kernels (head dim 16: avx2's vector path)
PATHS = {
    "fused-kernel": {"cpu_isa": WorkerSettings().cpu_isa},
    "transformers-gather": {"fused_model": False, "cpu_kernels": False},
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize(
    "config",
    [
        Qwen2Config(**COMMON),
        MistralConfig(**COMMON, sliding_window=12),
    ],
    ids=["qwen2", "mistral-sliding-window"],
)
def test_engine_matches_hf_on_other_architectures(config, path):
    """Both forward paths: the engine's fused one with the CPU decode kernel, and transformers' modules."""
    model, ref = tiny(config)
    engine = LLMEngine.from_model(
        model,
        EngineConfig(
            block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=8, huge_pages=False, **PATHS[path]
        ),
    )
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (5, 23, 9)]  # 23 > window: chunked
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), p, SamplingOptions(temperature=0, max_tokens=12, ignore_eos=True)))
    runs, _ = run_to_completion(engine)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        ref.generation_config.eos_token_id = None  # like ignore_eos
        expected = ref.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12, min_new_tokens=12
        )[0, len(p) :].tolist()
        assert runs[str(i)].tokens == expected, (config.model_type, i)
    engine.check_no_leak()


def test_unsupported_architecture_runs_on_transformers_modules():
    from transformers import Qwen3Config

    from services.worker.engine.model.fused_llama import unsupported_reason

    model, _ = tiny(Qwen3Config(**COMMON))  # q/k norms: not in the fused forward
    assert "qwen3" in unsupported_reason(model)
    engine = LLMEngine.from_model(
        model, EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, huge_pages=False)
    )
    assert engine.runner.fused is None
    engine.add_request(EngineRequest("a", [5, 6, 7], SamplingOptions(temperature=0, max_tokens=4, ignore_eos=True)))
    runs, _ = run_to_completion(engine)
    assert len(runs["a"].tokens) == 4
