"""The scripts' sampling loop (`sample_responses`: KV cache, logits / T, one draw per step) side by side with Hugging
Face generate() set up the same way (what the scripts used before): seconds per call, median of --repeats after a
warm-up, on models with random weights (no download; the token count is fixed, so weights don't change the work).
Also checks that both draw the same tokens from the same seed. One JSON line per setting.

    python benchmark/sampling_speed.py                      # GPT-2 124M batch 8, and the quick start's SmolLM2 setting
    python benchmark/sampling_speed.py --settings gpt2      # one of them
"""

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_policy_accelerate import sample_responses  # noqa: E402

# (model, batch, context tokens, response tokens): GPT-2 124M as in the reading review; the quick start's PPO rollout
# (16 episodes of 8 + 12 tokens) and its label sampling (128 rows per generate call)
SETTINGS = {
    "tiny": ("tiny", 4, 8, 6),  # a 2-layer GPT-2, for the test
    "gpt2": ("gpt2", 8, 64, 24),
    "smollm2-rollout": ("smollm2", 16, 8, 12),
    "smollm2-labels": ("smollm2", 128, 8, 12),
}


@dataclass
class Args:
    settings: tuple[Literal["tiny", "gpt2", "smollm2-rollout", "smollm2-labels"], ...] = tuple(SETTINGS)[1:]
    """which settings to measure"""
    repeats: int = 5
    """timed calls of each method (after one warm-up call)"""
    threads: int = 0
    """torch threads (0: torch's default)"""


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "tiny":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000)).eval()
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config()).eval()  # 124M: 12 layers, 768 wide, 50257 tokens
    config = LlamaConfig(  # SmolLM2-135M's shapes
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def library_generate(lm, contexts: torch.Tensor, pad_id: int, length: int, temperature: float) -> torch.Tensor:
    lm.generation_config = GenerationConfig()  # nothing of the model's own settings
    config = GenerationConfig(max_new_tokens=length, do_sample=True, top_k=0, top_p=1.0, temperature=temperature)
    mask = contexts != pad_id
    output = lm.generate(input_ids=torch.where(mask, contexts, 0), attention_mask=mask, generation_config=config)
    return output[:, contexts.shape[1] :]


def seconds(function, arguments: tuple, repeats: int) -> float:
    function(*arguments)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function(*arguments)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(args: Args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    for setting in args.settings:
        name, batch, context_length, length = SETTINGS[setting]
        lm = make_model(name)
        pad_id = lm.config.vocab_size
        contexts = torch.randint(0, pad_id, (batch, context_length), generator=torch.Generator().manual_seed(0))
        contexts[: batch // 2, : context_length // 4] = pad_id  # left padding on half the rows
        with torch.no_grad():
            torch.manual_seed(1)
            loop_tokens = sample_responses(lm, contexts, pad_id, length, 0.7)[0]
            torch.manual_seed(1)
            same = torch.equal(loop_tokens, library_generate(lm, contexts, pad_id, length, 0.7))
            loop = seconds(sample_responses, (lm, contexts, pad_id, length, 0.7), args.repeats)
            library = seconds(library_generate, (lm, contexts, pad_id, length, 0.7), args.repeats)
        row = dict(setting=setting, batch=batch, context=context_length, response=length,
                   threads=torch.get_num_threads(), generate_s=round(library, 4), loop_s=round(loop, 4),
                   loop_over_generate=round(loop / library, 3), same_tokens=same)  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
