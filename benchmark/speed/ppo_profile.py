"""Where a PPO epoch's time goes: the policy script's own training step (its loading, forward, log-probs and entropy,
clipped losses, backward and TF-style Adam step) on a GPT-2 size with random weights.

    python -m benchmark.speed.ppo_profile --model gpt2 --batch-size 8     # GPT-2 124M, 8 rows of 64 + 24 tokens: ~1 min

One JSON line and a table: seconds per minibatch step (the median of --repeats), what it would take at a matmul peak
measured at start (benchmark/speed/throughput.py's: the model FLOPs the script's MFU counts over that peak), and the
step split into its matrix products, each timed alone at its own shapes (benchmark/speed/sampling_speed.py's
matrix_products: the trunk's, and the LM head's over the vocabulary), the optimizer step as timed, and everything else
(attention, GELU, layer norm, the log-softmax and entropy over the vocabulary, the tied embedding's gradient, Python:
the step's time minus the rest). For that remainder, the operations a profiled step spends most self CPU time in (the
profiler's overhead inflates those times; read them as a ranking).
"""

import json
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import tyro

import run_utils
import train_policy_accelerate as P
from benchmark.speed.sampling_speed import PRODUCTS, matrix_products, product_shapes
from benchmark.speed.throughput import SIZES, ModelSizeArgs, measure_peak_tflops


@dataclass
class Args(ModelSizeArgs):
    repeats: int = 5
    """timed steps after the warm-up (--max-warmup-steps); the median is reported"""
    threads: int = 0
    """torch threads (0: torch's default)"""
    max_warmup_steps: int = 12
    """warm-up steps at most: they go on until a step page-faults no new memory in (see `settle`)"""


def minor_page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def settle(step, max_steps: int) -> int:
    """Run warm-up steps until one takes no new page of memory from the kernel (at least 2; at most max_steps), and
    return how many ran. The first steps allocate the optimizer's state and the gradients, and for a few more the
    allocator's free blocks do not yet fit every tensor, so new pages are faulted in: measured on a 2-vCPU AMD EPYC,
    GPT-2 at batch 8 took 5.2, 3.1, 2.6 s for its first three steps (390k, 118k, 35k page faults), 2.4 s from the
    fourth (none). A profile after two warm-up steps counted that as the step's own time."""
    for count in range(1, max_steps + 1):
        before = minor_page_faults()
        step()
        if count >= 2 and minor_page_faults() == before:
            return count
    return max_steps


def main(args: Args) -> None:
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    if args.threads:
        torch.set_num_threads(args.threads)
    run_utils.setup_device(SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(allow_tf32=False))  # malloc
    torch.manual_seed(0)
    n_layer, n_embd, n_head = SIZES[args.model]
    with tempfile.TemporaryDirectory() as directory:  # loaded the scripts' way (no dropout, the fused GELU)
        GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head)).save_pretrained(directory)
        lm = P.load_pretrained(AutoModelForCausalLM, directory)
    policy = P.PolicyAndValueWrapper(lm, zero_init=False)  # random value head: its gradient flows as in training
    optimizer = P.make_optimizer(policy.parameters(), lr=1e-5, eps=1e-5, use_tensorflow_adam=True)
    ppo, vocab, pad, temperature = P.PpoHParams(), lm.config.vocab_size, lm.config.vocab_size + 2, 0.7
    B, C, T = args.batch_size, args.query_length, args.response_length
    query_responses = torch.randint(vocab, (B, C + T))
    query_responses[::2, : C // 4] = pad  # left-padded queries, as the rollout makes them
    responses, old_logprobs, old_values = query_responses[:, C:], torch.randn(B, T) - 5, torch.randn(B, T)
    advantages, returns = torch.randn(B, T), torch.randn(B, T)

    def forward_backward() -> None:  # the body of the policy script's PPO loop for one micro-batch
        logits, vpred = policy(query_responses, C, pad, temperature)
        new_logprobs, entropy = P.logprobs_from_logits(logits, responses, with_entropy=True)
        loss, _ = P.ppo_losses(new_logprobs, vpred.float(), old_logprobs, old_values, advantages, returns, ppo)
        loss.backward()

    def step() -> tuple[float, float]:  # seconds of (forward + backward, optimizer step)
        start = time.perf_counter()
        forward_backward()
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        return middle - start, time.perf_counter() - middle

    policy.train()
    warmup_steps = settle(step, args.max_warmup_steps)  # the optimizer's state exists, the allocator has its blocks
    timed = [step() for _ in range(args.repeats)]
    seconds = statistics.median(sum(t) for t in timed)
    optimizer_seconds = statistics.median(t[1] for t in timed)
    products = matrix_products(product_shapes(forward_backward, ()), args.repeats)
    optimizer.zero_grad()
    vocabulary_products = sum(n * t for shapes, n, t in products if vocab in (d for shape in shapes for d in shape))
    trunk_products = sum(n * t for _, n, t in products) - vocabulary_products
    settle(step, args.max_warmup_steps)  # timing the products alone allocated other blocks: settle again
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        forward_backward()
    optimizer.zero_grad()
    others = sorted((e for e in profile.key_averages() if e.key not in PRODUCTS), key=lambda e: -e.self_cpu_time_total)
    flops = 3 * run_utils.forward_flops(lm, B * (C + T), B * T)  # forward + backward (twice the forward)
    head_flops = 3 * run_utils.forward_flops(lm, 0, B * T)  # the LM head's part
    peak = measure_peak_tflops(torch.device("cpu")) * 1e12
    parts = {
        "trunk matrix products (timed alone)": trunk_products,
        "LM head matrix products (timed alone)": vocabulary_products,
        "optimizer step (TF-style Adam, fused)": optimizer_seconds,
    }
    parts["everything else"] = seconds - sum(parts.values())
    result = dict(model=args.model, batch_size=B, query_length=C, response_length=T, threads=torch.get_num_threads(),
                  warmup_steps=warmup_steps, seconds_per_step=seconds, model_tflop=flops / 1e12,
                  peak_tflops=peak / 1e12, mfu=flops / peak / seconds, seconds_at_peak=flops / peak, parts=parts,
                  trunk_products_fraction_of_peak=(flops - head_flops) / peak / trunk_products,
                  head_products_fraction_of_peak=head_flops / peak / vocabulary_products,
                  top_other_ops_profiled_ms={e.key: round(e.self_cpu_time_total / 1e3, 1) for e in others[:8]})  # fmt: skip
    print(json.dumps(result), flush=True)
    print(f"\n{args.model}, batch {B}, {C} + {T} tokens, {torch.get_num_threads()} threads, {warmup_steps} warm-up "
          f"steps: {seconds:.3f} s per step, "
          f"{flops / peak:.3f} s at the measured peak of {peak / 1e12:.3f} TFLOP/s (MFU {flops / peak / seconds:.2f}); "
          f"the trunk's products alone at {result['trunk_products_fraction_of_peak']:.0%} of that peak, the LM head's "
          f"at {result['head_products_fraction_of_peak']:.0%}\n")  # fmt: skip
    print("| part of the step | seconds | share |\n|---|---|---|")
    for name, part in parts.items():
        print(f"| {name} | {part:.3f} | {part / seconds:.0%} |")
    print(
        "\nprofiled self CPU time of the other operations (ms, inflated by the profiler): "
        + ", ".join(f"{k} {v}" for k, v in result["top_other_ops_profiled_ms"].items())
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
