"""The scripts' sampling loop (`sample_responses`: KV cache, logits / T, one inverse-CDF draw per step) side by side
with Hugging Face generate() set up to sample the same distribution (what the scripts used before; it draws with
torch.multinomial), on models with random weights (no download; the token count is fixed, so weights don't change the
work). For label sampling (4 samples per query) also the loop with each context's forward shared by its samples, as
the reward script samples labels. One JSON line per setting; tests/test_policy_units.py checks what the loop draws.
Against two floors: the loop's matrix products timed alone, each shape on one weight that stays in the CPU's cache
(`matmul_floor`), and in the loop's order on as many distinct weights as the model has, which a sampling step streams
from memory (`streaming_replay`). Seconds per call: the median of --repeats rounds in which generate(), the loop(s)
and the streaming replay each run once, in turn (after a warm-up call of each).

    python -m benchmark.speed.sampling_speed                  # GPT-2 124M batch 8, and the quick start's SmolLM2
    python -m benchmark.speed.sampling_speed --settings gpt2  # one of them
"""

import collections
import functools
import json
import math
import statistics
import time
from dataclasses import dataclass
from typing import Literal

import torch
import tyro
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from train_policy_accelerate import sample_responses

# (model, contexts, samples per context, context tokens, response tokens): GPT-2 124M as in the reading review; the
# quick start's PPO rollout (16 episodes of 8 + 12 tokens) and its label sampling (32 queries x 4 samples per call)
SETTINGS = {
    "tiny": ("tiny", 2, 2, 8, 6),  # a 2-layer GPT-2, for the test
    "gpt2": ("gpt2", 8, 1, 64, 24),
    "smollm2-rollout": ("smollm2", 16, 1, 8, 12),
    "smollm2-labels": ("smollm2", 32, 4, 8, 12),
}


@dataclass
class Args:
    settings: tuple[Literal["tiny", "gpt2", "smollm2-rollout", "smollm2-labels"], ...] = tuple(SETTINGS)[1:]
    """which settings to measure"""
    repeats: int = 5
    """rounds, each timing every method once, in turn (after one warm-up call of each)"""
    threads: int = 0
    """torch threads (0: torch's default)"""


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "tiny":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000)).eval()
    if name == "gpt2":
        # 124M: 12 layers, 768 wide, 50257 tokens; its GELU as the scripts load GPT-2 (load_pretrained: fused)
        return GPT2LMHeadModel(GPT2Config(activation_function="gelu_pytorch_tanh")).eval()
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


def digits(seconds_: float) -> float:
    """A time with 4 significant digits: a tiny model's floors take a fraction of a millisecond."""
    return float(f"{seconds_:.4g}")


def seconds_in_turns(calls: dict, repeats: int) -> dict:
    """Median seconds of each of `calls` (name: a function of no arguments): a warm-up call of each, then `repeats`
    rounds in which each runs once, in turn (a GPU synchronized around each). In turns, so that a slower stretch of
    the machine (its host's other guests, its clock) falls on every method alike: timed one method after the other,
    with the floor's best replay against the loop's median call, one loop read 1.32x and 1.57x its streaming floor
    within one session. benchmark/speed/optimizations.py times each detail's before and after with it too."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


PRODUCTS = {"aten::mm": slice(0, 2), "aten::addmm": slice(1, 3), "aten::bmm": slice(0, 2)}  # where the operands are


def product_shapes(function, arguments: tuple) -> list[tuple[tuple, tuple]]:
    """The operand shapes of the call's matrix products, in the order it ran them (torch.profiler records them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        function(*arguments)
    return [tuple(map(tuple, e.input_shapes[PRODUCTS[e.name]])) for e in profile.events() if e.name in PRODUCTS]


def matrix_products(shapes: list[tuple[tuple, tuple]], repeats: int) -> list[tuple[tuple, int, float]]:
    """The products of `shapes` (product_shapes) as (operand shapes, count, seconds of one): each shape timed on its
    own with contiguous random operands, the best of `repeats` measurements. No implementation of the call can do
    them faster; its other time is everything else."""
    products = []
    for (a_shape, b_shape), count in collections.Counter(shapes).items():
        a, b = torch.randn(a_shape), torch.randn(b_shape)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(repeats):  # 10 products a measurement: one small product is a few microseconds
            start = time.perf_counter()
            for _ in range(10):
                a @ b
            best = min(best, (time.perf_counter() - start) / 10)
        products.append(((a_shape, b_shape), count, best))
    return products


def matmul_floor(shapes: list[tuple[tuple, tuple]], repeats: int) -> float:
    """Seconds the products alone take at their shapes, each on one operand pair that stays in the CPU's cache."""
    return sum(count * seconds for _, count, seconds in matrix_products(shapes, repeats))


def product_sequence(shapes: list[tuple[tuple, tuple]], model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """The products of `shapes` in order, as operand pairs of random tensors: an operand of a weight's size takes, in
    turn, one of as many tensors as the model has weights of that size (so that the replay reads as many bytes of
    weights as the call); any other operand one tensor per shape."""
    sizes = collections.Counter(parameter.numel() for parameter in model.parameters())
    pools, turns, sequence = {}, collections.Counter(), []
    for pair in shapes:
        operands = []
        for shape in pair:
            if shape not in pools:
                pools[shape] = [torch.randn(shape) for _ in range(max(sizes[math.prod(shape)], 1))]
            operands.append(pools[shape][turns[shape] % len(pools[shape])])
            turns[shape] += 1
        sequence.append(operands)
    return sequence


def streaming_replay(shapes: list[tuple[tuple, tuple]], model: torch.nn.Module):
    """A function that runs the products of `shapes` once, in the call's order, with as many distinct weights as the
    model has of each size: the streaming floor is its time. matmul_floor times each shape on one weight, 10 times
    over, so that weight stays in the CPU's cache; a sampling step reads every weight of the model once (GPT-2 124M:
    ~500 MB, far more than any cache), so its products wait on memory too: this floor counts that trip."""
    sequence = product_sequence(shapes, model)

    def replay() -> None:
        for a, b in sequence:
            a @ b

    return replay


def main(args: Args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    for setting in args.settings:
        name, num_contexts, samples, context_length, length = SETTINGS[setting]
        lm = make_model(name)
        pad_id = lm.config.vocab_size
        contexts = torch.randint(0, pad_id, (num_contexts, context_length), generator=torch.Generator().manual_seed(0))
        contexts[: num_contexts // 2, : context_length // 4] = pad_id  # left padding on half the rows
        rows = contexts.repeat_interleave(samples, 0)  # what generate() and the plain loop get
        with torch.no_grad():
            shapes = product_shapes(sample_responses, (lm, rows, pad_id, length, 0.7))
            calls = {
                "generate": functools.partial(library_generate, lm, rows, pad_id, length, 0.7),
                "loop": functools.partial(sample_responses, lm, rows, pad_id, length, 0.7),
                "streaming_floor": streaming_replay(shapes, lm),
            }
            if samples > 1:
                calls["shared"] = functools.partial(sample_responses, lm, contexts, pad_id, length, 0.7, samples)
            median = seconds_in_turns(calls, args.repeats)
            library, loop, streaming = median["generate"], median["loop"], median["streaming_floor"]
            floor = matmul_floor(shapes, args.repeats)
            row = dict(setting=setting, batch=len(rows), samples_per_context=samples, context=context_length,
                       response=length, threads=torch.get_num_threads(), generate_s=digits(library),
                       loop_s=digits(loop), loop_over_generate=round(loop / library, 3),
                       matmul_floor_s=digits(floor), loop_over_floor=round(loop / floor, 3),
                       generate_over_floor=round(library / floor, 3), streaming_floor_s=digits(streaming),
                       loop_over_streaming_floor=round(loop / streaming, 3),
                       generate_over_streaming_floor=round(library / streaming, 3))  # fmt: skip
            if samples > 1:
                shared = median["shared"]
                row.update(shared_context_s=digits(shared), shared_over_generate=round(shared / library, 3))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
