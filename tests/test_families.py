"""Model families beside Llama, in the shared decoder: tiny models built from each family's
transformers config with fixed seeds; the service's runner (its padding, chunks, cache rows)
gives transformers' logits within 1e-4 across prefill chunks and decode steps, alone and
batched beside another row, and the same 64 greedy tokens. What is not supported is refused at
load, by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from inference_api.plan import CompilationMode, LogprobsMode
from inference_svc.compile_monitor import CompileMonitor, Origin
from inference_svc.engine.buckets import GenBuckets
from inference_svc.engine.runner import GenerateRunner
from inference_svc.limits import GenLimits
from inference_svc.models.compile import ModelContext
from inference_svc.models.generative import load_generative
from inference_svc.models.weights import convert_linears
from inference_svc.sampling import Sampler
from tests.conftest import TORCH_COMPILE

pytestmark = pytest.mark.rpc
LIMITS = GenLimits(max_batch=2, max_input_tokens=48, max_new_tokens=72, prefill_chunk=16)
COMMON = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 500000.0}  # fmt: skip
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
             "rope_theta": 10000.0}  # fmt: skip
DYNAMIC_ROPE = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
# Phi-3.5/Phi-4-mini style: rope on 3/4 of each 16-wide head (6 frequencies), long context by
# longrope; its short factor holds up to 128 positions, more than LIMITS' 120.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            "original_max_position_embeddings": 128}  # fmt: skip
GEMMA3 = {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
          "sliding_window_pattern": 2, "rope_local_base_freq": 100.0,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),  # q/k norm; wide heads
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    # windows shorter than the 40-token prompt: every layer (Mistral), the second only (Qwen2)
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True,
                                                         "sliding_window": 12,
                                                         "max_window_layers": 1}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
    "yarn-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": YARN_ROPE}),
    "dynamic-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": DYNAMIC_ROPE}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused qkv and gate/up projections
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", {"rope_parameters": LONGROPE,
                                                        "original_max_position_embeddings": 128,
                                                        "sliding_window": None}),
    # local (8-token window) then global layers, sandwich norms, (1 + w) norms, a GELU gate,
    # an attention scale of 24**-0.5 (not head_dim's), scores and logits capped hard enough
    # to matter on a tiny model's small values
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 24,
                                                     "sliding_window": 8,
                                                     "attn_logit_softcapping": 0.5,
                                                     "final_logit_softcapping": 0.2}),
    # Gemma 3: Gemma 2's layer with q/k norms and no attention cap; the local layers (window
    # 8) rotate with their own base (100), the global ones with 1e6 scaled linearly by 8
    # (the configs' old spelling: rope_scaling and rope_local_base_freq).
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3),
    # the multimodal Gemma 3 (a tiny vision tower), served as its text model: text prompts
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", GEMMA3),
    "llama-biases": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True,
                                                         "mlp_bias": True}),
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    from tests.models import packaged_tokenizer

    return packaged_tokenizer()  # the packaged SmolLM2's


def build(directory: Path, family: str, tokenizer, **extra: object) -> Path:
    import transformers

    config_cls, model_cls, options = FAMILIES[family]
    text_cls = "Gemma3TextConfig" if config_cls == "Gemma3Config" else config_cls
    config = getattr(transformers, text_cls)(**{
        "vocab_size": len(tokenizer), **COMMON, **options, **extra,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
    })  # fmt: skip
    if config_cls == "Gemma3Config":  # the text model inside a multimodal one
        config = transformers.Gemma3Config(
            text_config=config.to_dict(), vision_config=VISION, mm_tokens_per_image=4
        )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # biases are zeros at init: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def ours(directory: Path, weights: str = "same", attention: str = "native") -> GenerateRunner:
    monitor = CompileMonitor()
    ctx = ModelContext("lm", CompilationMode.NONE, monitor, torch.device("cpu"), torch.float32)
    model = load_generative(ctx, directory, LIMITS, weights=weights, attention=attention)
    buckets = GenBuckets.plan(LIMITS, CompilationMode.NONE)
    model.allocate_cache(buckets.rows_for(2 * LIMITS.max_seq_len))
    return GenerateRunner(model, Sampler("lm", CompilationMode.NONE, monitor),
                          LogprobsMode.RAW, buckets)  # fmt: skip


def transformers_next(
    directory: Path, weights: str = "same"
) -> Callable[[list[int]], torch.Tensor]:
    """transformers' logits after a sequence, from the model in ``directory`` (its linear
    layers converted to ``weights`` as the service converts its own)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    convert_linears(reference, weights)

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return reference(torch.tensor([ids])).logits[0, -1]

    return logits


def prefill(runner: GenerateRunner, row: int, ids: list[int]) -> torch.Tensor:
    chunk = runner.buckets.chunk[-1]
    for start in range(0, len(ids), chunk):
        logits = runner.pad_prefill(row, ids[start : start + chunk], start, Origin.WARMUP)
    return logits[0]


def equals_transformers(
    runner: GenerateRunner, directory: Path, weights: str = "same", atol: float = 1e-4
) -> None:
    """``runner``'s logits are transformers' within ``atol`` over a 40-token prompt (three
    chunks) and 8 decode steps batched beside a second row, and its 64 greedy tokens alone
    are transformers' argmax ones (transformers' linears converted to ``weights`` too)."""
    ref_next = transformers_next(directory, weights)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1000, (40,), generator=gen).tolist()  # three chunks of 16
    other = torch.randint(0, 1000, (21,), generator=gen).tolist()
    with torch.inference_mode():
        got = prefill(runner, 0, prompt)
        assert (got - ref_next(prompt)).abs().max() <= atol
        prefill(runner, 1, other)
        ids, extra = list(prompt), list(other)
        for step in range(8):  # teacher-forced decode, batched beside row 1
            token = int(got.argmax())
            ids.append(token)
            extra.append(step + 5)
            both = runner.pad_decode([token, step + 5], [len(ids) - 1, len(extra) - 1],
                                     Origin.WARMUP)  # fmt: skip
            got = both[0]
            assert (got - ref_next(ids)).abs().max() <= atol, f"decode step {step}"
            assert (both[1] - ref_next(extra)).abs().max() <= atol, f"row 1, step {step}"

        # 64 greedy tokens alone (row 0 again, from the start), against transformers' argmax
        mine = [int(prefill(runner, 0, prompt).argmax())]
        want = [int(ref_next(prompt).argmax())]
        while len(mine) < 64:
            logits = runner.pad_decode([mine[-1]], [len(prompt) + len(mine) - 1], Origin.WARMUP)
            mine.append(int(logits[0].argmax()))
            want.append(int(ref_next(prompt + want).argmax()))
    assert mine == want


# torch's SDPA in the decode step too (--decode-attention sdpa, a GPU's path) where the two
# attentions differ most: no window, a window on every layer, local and global layers
SDPA_TOO = ("qwen3", "mistral-window", "gemma3_text")


@pytest.mark.parametrize(
    ("family", "attention"),
    [(f, "native") for f in sorted(FAMILIES)] + [(f, "sdpa") for f in SDPA_TOO],
)
def test_logits_and_greedy_tokens_equal_transformers(
    family, attention, tokenizer, tmp_path
) -> None:
    """The decode step on this project's attention kernel (the default on a CPU, where a
    family allows it) or on torch's SDPA gives transformers' logits and tokens."""
    directory = build(tmp_path, family, tokenizer)
    runner = ours(directory, attention=attention)
    want = "sdpa" if family == "gemma2" else attention  # capped scores: SDPA's path only
    assert runner.model.lm.decode_attention == want
    equals_transformers(runner, directory)


def test_a_sharded_checkpoint_loads_whole(tokenizer, tmp_path) -> None:
    """Weights split over several safetensors files (an index names each tensor's file), as
    every model above a few GB ships: the same parity."""
    from transformers import AutoModelForCausalLM

    whole = build(tmp_path / "whole", "phi3", tokenizer)
    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(str(whole), dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="300KB")
    tokenizer.save_pretrained(sharded)
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2
    assert (sharded / "model.safetensors.index.json").is_file()
    equals_transformers(ours(sharded), whole)


@pytest.mark.parametrize(
    ("family", "extra", "message"),
    [
        (
            "phi3-longrope",
            {
                "rope_parameters": {**LONGROPE, "original_max_position_embeddings": 64},
                "original_max_position_embeddings": 64,
            },
            r"rope type 'longrope' keeps fixed frequencies up to 64 positions "
            r"\(original_max_position_embeddings\); max input \+ max new tokens = 120 would "
            r"switch to its long factor .* lower --max-input-tokens/--max-new-tokens",
        ),
        (
            "dynamic-rope",
            {"max_position_embeddings": 96},
            r"rope type 'dynamic' keeps fixed frequencies up to 96 positions "
            r"\(max_position_embeddings\); .* = 120 would rescale its frequencies",
        ),
        (
            "gemma3_text",
            {"use_bidirectional_attention": True},
            r"use_bidirectional_attention \(gemma3_text: an embedding model's attention\)",
        ),
    ],
)
def test_what_is_not_supported_is_refused_at_load_by_name(
    family, extra, message, tokenizer, tmp_path
) -> None:
    directory = build(tmp_path, family, tokenizer, **extra)
    with pytest.raises(ValueError, match=message):
        ours(directory)


def test_an_unknown_architecture_names_itself_and_what_is_supported(tokenizer, tmp_path) -> None:
    import transformers

    config = transformers.PhiConfig(vocab_size=len(tokenizer), **COMMON)  # Phi-2
    torch.manual_seed(0)
    transformers.PhiForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    supported = r"'phi' is not supported .*gemma2, gemma3, gemma3_text, llama, mistral, phi3, qwen2"
    with pytest.raises(ValueError, match=supported):
        ours(tmp_path)


def test_every_eos_id_of_the_generation_config_stops(tokenizer, tmp_path) -> None:
    """Gemma 3 lists its end-of-turn token in generation_config.json only."""
    from transformers import GenerationConfig

    directory = build(tmp_path, "gemma3", tokenizer)
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, 106]).save_pretrained(directory)
    assert {tokenizer.eos_token_id, 106} <= ours(directory).model.eos_ids


@pytest.mark.timeout(900)
# gemma2 is served compiled in tests/test_families_compiled.py (AOTInductor packages)
@pytest.mark.parametrize("family", ["qwen2-window"])
async def test_a_service_compiled_serves_eagers_tokens_with_no_late_compile(
    family, tokenizer, tmp_path
) -> None:
    """The whole service on a tiny Qwen2 with a sliding window on one layer, and on a tiny
    Gemma 2 (soft-capping, sandwich norms), windows shorter than their sequences: the warmup
    plan covers it (0 compile events after
    SERVING under random arrivals, only Describe's shapes) and compiled greedy and seeded
    tokens equal eager ones."""
    from inference_api.stubs.inference.v1 import inference_pb2 as pb
    from tests.rpc import serving
    from tests.test_compiled_tiny import random_arrivals_compile_nothing

    directory = build(tmp_path / family, family, tokenizer)  # windows of 12 and 8 tokens
    args = ["--port", "0", "--admin-port", "0", "--embed-model", "none", "--lm-model",
            str(directory), "--max-input-tokens", "32", "--max-new-tokens", "16"]  # fmt: skip
    reqs = [
        pb.GenerateRequest(prompt="the quick brown fox", sampling=pb.SamplingParams(max_tokens=8)),
        pb.GenerateRequest(
            prompt="a b c d e f g h i j k l m n o p q r s t",
            sampling=pb.SamplingParams(temperature=0.9, seed=3, max_tokens=8),
        ),
    ]
    tokens = {}
    for mode in ("none", "default"):
        flags = [*args, "--compilation-mode", mode, *TORCH_COMPILE]
        async with serving(flags, warm=True) as (service, c):
            tokens[mode] = [list((await c.inference.Generate(r)).token_ids) for r in reqs]
            if mode == "default":
                await random_arrivals_compile_nothing(service, c, seed=5, count=12)
    assert tokens["default"] == tokens["none"]
