"""Before/after timings of the scripts' speed details, one at a time, on the current device.

Each row times the scripts' own function ("after") against the straightforward way it is often written ("before":
written out below, same inputs, same result — each pair is checked for equality before it is timed, then the two
timed in turns):

    python -m benchmark.speed.optimizations --model gpt2 --batch-size 8 --query-length 64 --response-length 24

The flags that change the training loop itself (--compile, --mixed-precision bf16) are
measured with benchmark/speed/throughput.py --extra="--compile", which runs the real loop.
"""

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import tyro

import train_policy_accelerate as P
import train_reward_accelerate as R
from benchmark.speed.sampling_speed import seconds_in_turns
from benchmark.speed.throughput import SIZES, ModelSizeArgs


@dataclass
class Args(ModelSizeArgs):
    repeats: int = 3
    """rounds timing before and after once each, in turn, after a warm-up of each; the medians are reported"""
    padding_rows: int = 512
    """rows for the padding / truncation timings (OAI's rollout batch)"""
    metrics: int = 25
    """scalars reduced per update (the policy script logs about this many)"""


# ---- "before": the straightforward versions ----------------------------------------------------------------------
def padded_inputs(tokens: torch.Tensor, pad_id: int) -> dict:
    """The same masked inputs as the scripts' padded_forward (pads masked, positions counting real tokens only)."""
    mask = tokens != pad_id
    return dict(input_ids=torch.where(mask, tokens, 0), attention_mask=mask, position_ids=mask.cumsum(1) - mask.long())


def full_logits(lm, tokens, context_length: int, pad_id: int, temperature: float):
    """Vocabulary logits at every position, then the response positions sliced out."""
    return lm(**padded_inputs(tokens, pad_id)).logits[:, context_length - 1 : -1] / temperature


def reward_through_lm_head(lm, head, tokens, pad_id: int):
    """A reward model kept as a causal LM: the full forward (LM head over every position) for the last hidden state."""
    output = lm(**padded_inputs(tokens, pad_id), output_hidden_states=True)
    return head(output.hidden_states[-1][:, -1]).squeeze(-1)


def left_pad_loop(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    rows = [[t for t in row if t != pad_id] for row in tokens.tolist()]
    return torch.tensor([[pad_id] * (tokens.shape[1] - len(row)) + row for row in rows])


def truncate_loop(responses: torch.Tensor, truncate_id: int, after: int, pad_id: int) -> torch.Tensor:
    out = responses.clone()
    for row in out:
        for t in range(after, len(row)):
            if row[t] == truncate_id:
                row[t + 1 :] = pad_id
                break
    return out


def tensorflow_adam_loop(params, state: dict, lr: float, eps: float, betas=(0.9, 0.999)) -> None:
    """TF1's Adam step written out per weight, six tensor operations each (the scripts' first version)."""
    (beta1, beta2), t = betas, state.setdefault("t", 0) + 1
    state["t"] = t
    for param in params:
        m, v = state.setdefault(param, (torch.zeros_like(param), torch.zeros_like(param)))
        m.lerp_(param.grad, 1 - beta1)
        v.mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
        param.data.addcdiv_(m, v.sqrt().add_(eps), value=-lr * math.sqrt(1 - beta2**t) / (1 - beta1**t))


def gelu_gradient(gelu, activations: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Forward and backward of one GELU (with gradients also where the caller has turned them off)."""
    with torch.enable_grad():
        return torch.autograd.grad(gelu(activations), activations, upstream)


def reduce_worker(rank: int, world: int, port: int, n: int, repeats: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    values = [torch.tensor(float(i)) for i in range(n)]

    def one_per_metric():
        for value in values:
            dist.all_reduce(value.clone())

    def one_for_all():
        dist.all_reduce(torch.stack(values))

    medians = seconds_in_turns({"one per metric": one_per_metric, "one for all": one_for_all}, repeats)
    timings = tuple(medians.values())
    if rank == 0:
        results.extend(timings)
    dist.destroy_process_group()


# ---- the measurements -------------------------------------------------------------------------------------------
def main(args: Args) -> None:
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.activations import NewGELUActivation

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    n_layer, n_embd, n_head = SIZES[args.model]
    lm = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head)).to(device).eval()
    pad, vocab, temperature = 50257, 50257, 0.7
    C, T, B = args.query_length, args.response_length, args.batch_size
    tokens = torch.randint(vocab, (4 * B, C + T), device=device)
    tokens[::2, : C // 4] = pad  # left-padded queries
    responses = tokens[:B, C:]
    rows = []

    def row(name: str, before, after, check) -> None:
        if check is not None:
            with torch.no_grad():
                check(before(), after())
        before_s, after_s = seconds_in_turns({"before": before, "after": after}, args.repeats).values()
        rows.append(dict(detail=name, before_s=before_s, after_s=after_s, speedup=before_s / after_s))
        print(json.dumps(rows[-1]), flush=True)

    close = lambda a, b: torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)  # noqa: E731
    with torch.no_grad():
        row(
            f"rollout forward (no grad, {B} rows): LM head on the {T} response positions, not all {C + T}",
            lambda: P.logprobs_from_logits(full_logits(lm, tokens[:B], C, pad, temperature), responses),
            lambda: P.logprobs_from_logits(P.lm_logits(lm, tokens[:B], C, pad, temperature), responses),
            close,
        )

    def train_step(logits_function):
        def step():
            lm.zero_grad(set_to_none=True)
            P.logprobs_from_logits(logits_function(lm, tokens[:B], C, pad, temperature), responses).sum().backward()

        return step

    row(
        f"PPO forward + backward ({B} rows): LM head on the response positions only",
        train_step(full_logits),
        train_step(P.lm_logits),
        None,  # the same logits as the no-grad row above, which checks them
    )
    reward = R.BestOfNRewardModel(lm.transformer, pad).to(device).eval()
    with torch.no_grad():
        row(
            f"reward forward ({4 * B} rows): backbone only, no LM head",
            lambda: reward_through_lm_head(lm, reward.scalar_head, tokens, pad),
            lambda: reward.scalar_head(R.padded_forward(lm.transformer, tokens, pad)[:, -1]).squeeze(-1),
            close,
        )
        queries, samples = tokens[:B, :C], tokens[:, C:].view(B, 4, T)
        row(
            f"best-of-4 scoring ({B} records): one row per record reads its query once, not 4 rows repeating it",
            lambda: reward(queries.repeat_interleave(4, 0), samples.flatten(0, 1)).view(B, 4),
            lambda: reward(queries, samples),
            close,
        )
    activations = torch.randn(B, C + T, 4 * lm.config.n_embd, device=device, requires_grad=True)
    gelu_new, upstream = NewGELUActivation(), torch.randn_like(activations)
    row(
        f"GELU forward + backward ({B} × {C + T} × {4 * lm.config.n_embd}, one layer): torch's fused tanh kernel, "
        "not GPT-2's gelu_new of 8 tensor operations",
        lambda: gelu_gradient(gelu_new, activations, upstream),
        lambda: gelu_gradient(lambda x: F.gelu(x, approximate="tanh"), activations, upstream),
        lambda a, b: torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5),
    )
    step_hidden = torch.randn(B, lm.config.n_embd, device=device)  # one sampling step: a row per sample
    with torch.no_grad():
        row(
            f"LM head of a sampling step ({B} rows): the product as W @ hidden^T, transposed back, not hidden @ W^T",
            lambda: lm.get_output_embeddings()(step_hidden).float(),
            lambda: P.vocabulary_logits(lm, step_hidden, pad),
            lambda a, b: torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5),
        )
    loop_weights, fused_weights = ([torch.nn.Parameter(p.detach().clone()) for p in lm.parameters()] for _ in "ab")
    for loop_weight, fused_weight in zip(loop_weights, fused_weights, strict=True):
        loop_weight.grad = fused_weight.grad = torch.randn_like(loop_weight)
    loop_state, fused = {}, R.AdamTensorFlowStyle(fused_weights, lr=1e-5, eps=1e-5)

    def same_steps(_, __) -> None:  # after the first step of each
        for loop_weight, fused_weight in zip(loop_weights, fused_weights, strict=True):
            torch.testing.assert_close(loop_weight.data, fused_weight.data, atol=1e-7, rtol=1e-6)

    row(
        f"TF-style Adam step ({sum(w.numel() for w in fused_weights) / 1e6:.0f}M weights): torch's fused Adam with "
        "eps / sqrt(1 - b2^t), not six tensor operations per weight",
        lambda: tensorflow_adam_loop(loop_weights, loop_state, 1e-5, 1e-5),
        fused.step,
        same_steps,
    )
    padded = torch.randint(vocab, (args.padding_rows, C + T))
    padded[torch.rand(padded.shape) < 0.2] = pad
    row(
        f"right-to-left padding ({args.padding_rows} × {C + T} tokens): vectorized, no Python loop",
        lambda: left_pad_loop(padded, pad),
        lambda: R.right_padding_to_left_padding(padded, pad),
        lambda a, b: torch.testing.assert_close(a, b, atol=0, rtol=0),
    )
    sampled = torch.randint(20, (args.padding_rows, T))  # token 13 ('.') about every 20th
    row(
        f"truncation ({args.padding_rows} × {T} tokens): vectorized, no Python loop",
        lambda: truncate_loop(sampled, 13, min(16, T - 1), pad),
        lambda: P.truncate_responses(sampled, 13, min(16, T - 1), pad)[0],
        lambda a, b: torch.testing.assert_close(a, b, atol=0, rtol=0),
    )
    results = mp.Manager().list()
    mp.spawn(reduce_worker, args=(2, 29517, args.metrics, 20 * args.repeats, results), nprocs=2)
    per_metric, stacked = results
    rows.append(
        dict(detail=f"metrics of an update, 2 processes (gloo): one all-reduce, not {args.metrics}",
             before_s=per_metric, after_s=stacked, speedup=per_metric / stacked)
    )  # fmt: skip
    print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.model}, {device.type}, {torch.get_num_threads()} threads, medians of {args.repeats}\n")
    print("| detail | before (s) | after (s) | speedup |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['detail']} | {r['before_s']:.4g} | {r['after_s']:.4g} | {r['speedup']:.1f}× |")


if __name__ == "__main__":
    main(tyro.cli(Args))
