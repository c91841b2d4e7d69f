"""The mutation study of the comparison with OpenAI's code: does it catch every broken detail?

    python -m benchmark.openai.mutations                   # every mutation (~40 min on 2 cores), then the table
    python -m benchmark.openai.mutations --only value_clip_min gae_no_gamma_in_delta
    python -m benchmark.openai.mutations --list            # the mutations, one line each
    python -m benchmark.openai.mutations --report-only     # the table again, from OUT/results.jsonl

Each mutation is one change of the kind a careless port makes (a sign, a clip, an index, a missing factor), for
each `# detail:` of both scripts and for the PPO losses, GAE, whitening, the KL controller, log-probs and entropy,
padding and positions, truncation, the reward normalization and the label order. The tool copies the repository's
tracked files, applies the change (to both scripts where it is in the block they share), and runs the comparison,
tests/test_openai_reference.py, on the copy: the tests that end soonest first, stopping at the first failure, whose
test and assertion (the stat and update, or the step) it records. A mutation the comparison misses is then given to
the unit and end-to-end tests of the suite (SECOND_TIER). A mutation that no test can catch must be the same
computation; its note says why. OUT/results.jsonl has one line per mutation; OUT/mutations.md the table that
docs/side-by-side.md shows. The unmutated copy runs first and must pass.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import tyro

REPO = Path(__file__).resolve().parents[2]
POLICY, REWARD = "train_policy_accelerate.py", "train_reward_accelerate.py"
BOTH = (POLICY, REWARD)  # the shared block: a careless port changes its one copy, so both files get the change


@dataclass(frozen=True)
class Mutation:
    name: str
    area: str
    """the detail or part of the algorithm it breaks"""
    files: tuple[str, ...]
    edits: tuple[tuple[str, str], ...]
    """(old, new): each `old` must occur exactly once in each file"""
    what: str
    """the change, in words"""
    equivalent: str = ""
    """for a mutation that computes the same: why (the study checks that no test catches it)"""
    suite: tuple[str, ...] = ()
    """for a path the comparison never runs (OpenAI's tasks and the replay do not reach it: a resume, label generation,
    bf16, the gold evaluation): the suite's tests of that path (files, or tests outside SECOND_TIER, which the
    unmutated copy then runs too), which the study gives the mutation to directly"""


M = Mutation
MUTATIONS = [
    # the blog's details (# detail: tags), in the order the policy script implements them
    M("pad_is_eos", "pad token", BOTH,
      (('tokenizer.add_special_tokens({"pad_token": "[PAD]"})', "tokenizer.pad_token = tokenizer.eos_token"),),
      "pad with EOS (id 50256, inside the vocabulary) instead of a token of its own"),
    M("pad_logit_not_masked", "pad token", BOTH,
      (("    if pad_id < logits.shape[-1]:\n", "    if False:\n"),),
      "the pad id's logit left as the head gives it: a model whose pad id is inside its head (SmolLM2, Llama) can "
      "sample it"),
    M("dropout_on", "dropout disabled", BOTH,
      (("            setattr(config, key, 0.0)\n", "            pass\n"),
       ('    for key, value in model.config.to_dict().items():\n        assert not (("dropout" in key or "pdrop" in key)'
        ' and isinstance(value, float) and value), f"config.{key}"\n    for name, module in model.named_modules():\n'
        '        assert not isinstance(module, nn.Dropout) or module.p == 0.0, f"{name}.p = {module.p}"\n', "")),
      "keep the config's dropout (GPT-2's 0.1), active in the PPO epochs' train mode"),
    M("positions_count_pads", "position ids for padding", BOTH,
      (("    position_ids = attention_mask.cumsum(1) - attention_mask.long()\n    input_ids = torch.where(attention_mask,"
        " tokens, 0)\n    output", "    position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as("
        "tokens)\n    input_ids = torch.where(attention_mask, tokens, 0)\n    output"),),
      "positions 0, 1, ... over every column, pads included (the forward of query ⊕ response)"),
    M("sampling_positions_count_pads", "position ids for padding", BOTH,
      (("    position_ids = attention_mask.cumsum(1) - attention_mask.long()  # as padded_forward: pads don't count",
        "    position_ids = torch.arange(contexts.shape[1], device=contexts.device).expand_as(contexts)"),),
      "the sampler's positions count the left pads of a context"),
    M("pads_attended", "position ids for padding", BOTH,
      (("    output = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, "
        "use_cache=False)", "    output = backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False)"),),
      "no attention mask: real tokens attend to the pads",
      equivalent="the same computation in transformers 5: given position ids that restart at 0 (every left pad, and "
      "the first real token after them, get position 0), its masking treats each restart as the start of a packed "
      "sequence, so no real token attends to a pad either way; the scripts pass the mask, which older transformers "
      "need"),
    M("sample_at_temperature_1", "fixed-length responses", BOTH,
      (("        logits = vocabulary_logits(lm, hidden, pad_id) / temperature  # (B, V)",
        "        logits = vocabulary_logits(lm, hidden, pad_id)  # (B, V)"),),
      "sample from softmax(logits), not softmax(logits / temperature)"),
    M("truncate_drops_the_period", "rejection sampling", BOTH,
      (("    postprocessed = torch.where(index > first_cut[:, None], pad_id, responses)",
        "    postprocessed = torch.where(index >= first_cut[:, None], pad_id, responses)"),),
      "the truncate token itself becomes pad"),
    M("truncate_after_off_by_one", "rejection sampling", BOTH,
      (("    is_cut = (responses == truncate_token_id) & (index >= truncate_after)  # (B, T)",
        "    is_cut = (responses == truncate_token_id) & (index > truncate_after)  # (B, T)"),),
      "a truncate token counts from index truncate_after + 1"),
    M("no_penalty", "rejection sampling", (POLICY,),
      (("torch.where(has_cut, scores, torch.full_like(scores, task.penalty_reward_value))", "scores"),),
      "a response without a truncate token keeps its score"),
    M("torch_adam_eps", "TF-style Adam", BOTH,
      (('            group["eps"] = group["tensorflow_eps"] / math.sqrt(1 - group["betas"][1] ** t)',
        '            group["eps"] = group["tensorflow_eps"]'),),
      "PyTorch's Adam (eps inside the bias correction)"),
    M("lr_schedule_one_step_ahead", "learning rate annealing", BOTH,
      (("    return base_lr * (1 - step / num_steps)", "    return base_lr * (1 - (step + 1) / num_steps)"),),
      "the annealed lr one step ahead"),
    M("query_drops_end_text", "queries that start and end with a period", BOTH,
      (("        tokens = tokens[: hits[-1] + len(end)]", "        tokens = tokens[: hits[-1]]"),),
      "cut the query before its last end text instead of after it"),
    M("query_starts_after_last_start_text", "queries that start and end with a period", BOTH,
      (("        if hits[0] + len(start) < len(tokens):\n            tokens = tokens[hits[0] + len(start) :]",
        "        if hits[-1] + len(start) < len(tokens):\n            tokens = tokens[hits[-1] + len(start) :]"),),
      "start after the last start text instead of the first"),
    M("reward_head_init_std", "reward head initialization", BOTH,
      (("std=1 / math.sqrt(hidden_size + 1)", "std=1 / math.sqrt(hidden_size)"),),
      "N(0, 1/sqrt(d)) instead of OpenAI's 1/sqrt(d + 1)"),
    M("reward_reads_response_only", "query ⊕ response input", BOTH,
      (("        query_responses = right_padding_to_left_padding(torch.cat([queries, responses], 1), self.pad_id)",
        "        query_responses = right_padding_to_left_padding(responses, self.pad_id)"),),
      "the reward model scores the response without its query"),
    M("best_of_n_response_sees_no_query", "query ⊕ response input", (REWARD,),
      (("((part[None] == 0) | (part[None] == part[:, None]))", "(part[None] == part[:, None])"),),
      "in the reward script's best-of-4 forward, a sample does not see its query"),
    M("reward_from_a_pad", "reward from the last token", BOTH,
      (("        query_responses = right_padding_to_left_padding(torch.cat([queries, responses], 1), self.pad_id)",
        "        query_responses = torch.cat([queries, responses], 1)"),),
      "the reward read at the last column, a pad when the response was truncated"),
    M("best_of_n_reads_the_last_column", "reward from the last token", (REWARD,),
      (("        last_in_response = length - 1 - in_response.flip(2).int().argmax(2)  # (B, n)",
        "        last_in_response = torch.full_like(in_response[..., 0], length - 1, dtype=torch.long)  # (B, n)"),),
      "the best-of-4 forward reads each sample's last column, pad or not"),
    M("kl_controller_unclipped", "adaptive KL", (POLICY,),
      (("float(np.clip(current_kl / self.target - 1, -KL_ERROR_CLIP, KL_ERROR_CLIP))",
        "float(current_kl / self.target - 1)"),),
      "the controller's proportional error not clipped to ±0.2"),
    M("kl_controller_per_token_kl", "adaptive KL", (POLICY,),
      (('        kl_ctl.update(row["objective/kl"], ppo.batch_size)',
        '        kl_ctl.update(row["objective/kl"] / task.response_length, ppo.batch_size)'),),
      "the controller fed the per-token KL instead of the KL per response"),
    M("kl_controller_one_step", "adaptive KL", (POLICY,),
      (("        self.value *= 1 + proportional_error * n_steps / self.horizon",
        "        self.value *= 1 + proportional_error / self.horizon"),),
      "the controller's move not scaled by the batch's episodes"),
    M("value_head_random_init", "value head initialization", (POLICY,),
      (("        if zero_init:\n", "        if False:\n"),),
      "the value head keeps nn.Linear's random initialization"),
    M("logprobs_without_temperature", "logits scaled by the sampling temperature", (POLICY,),
      (("    return vocabulary_logits(lm, hidden, pad_id) / temperature", "    return vocabulary_logits(lm, hidden, pad_id)"),),
      "log-probs from the raw logits"),
    M("kl_sign", "per-token KL penalty", (POLICY,),
      (("    kl = logprobs - ref_logprobs\n", "    kl = ref_logprobs - logprobs\n"),),
      "KL(reference || policy)'s sign: ref_logprobs - logprobs"),
    M("kl_penalty_sign", "per-token KL penalty", (POLICY,),
      (("    non_score_reward = -kl_coef * kl\n", "    non_score_reward = kl_coef * kl\n"),),
      "the KL as a bonus instead of a penalty"),
    M("score_on_the_first_token", "per-token KL penalty", (POLICY,),
      (("    rewards[:, -1] += scores\n", "    rewards[:, 0] += scores\n"),),
      "the score added on the first response token instead of the last"),
    M("reward_whitening_shifts_the_mean", "per-minibatch reward and advantage whitening", (POLICY,),
      (("        rewards = whiten(rewards, shift_mean=False)", "        rewards = whiten(rewards)"),),
      "the rewards whitened to mean 0"),
    M("advantages_not_whitened", "per-minibatch reward and advantage whitening", (POLICY,),
      (("    return (whiten(advantages) if ppo.whiten_advantages else advantages), returns",
        "    return advantages, returns"),),
      "the advantages as GAE gives them"),
    M("whitening_unbiased_variance", "per-minibatch reward and advantage whitening", (POLICY,),
      (("    var = values.var((-2, -1), unbiased=False, keepdim=True)", "    var = values.var((-2, -1), keepdim=True)"),),
      "the unbiased variance (tf.nn.moments is biased)"),
    M("returns_from_whitened_advantages", "GAE", (POLICY,),
      (("    returns = advantages + values\n    return (whiten(advantages) if ppo.whiten_advantages else advantages), "
        "returns", "    advantages = whiten(advantages) if ppo.whiten_advantages else advantages\n    return advantages, "
        "advantages + values"),),
      "the returns computed from the whitened advantages"),
    M("gae_no_gamma_in_delta", "discount factor 1", (POLICY,),
      (("        delta = rewards[..., t] + ppo.gamma * next_value - values[..., t]",
        "        delta = rewards[..., t] + next_value - values[..., t]"),),
      "δ_t without γ"),
    M("gae_lambda_without_gamma", "GAE", (POLICY,),
      (("        last_advantage = delta + ppo.gamma * ppo.lam * last_advantage",
        "        last_advantage = delta + ppo.lam * last_advantage"),),
      "A_t = δ_t + λ A_{t+1}, without γ"),
    M("gae_next_value_off_by_one", "GAE", (POLICY,),
      (("        next_value = values[..., t + 1] if t + 1 < length else 0.0",
        "        next_value = values[..., t] if t + 1 < length else 0.0"),),
      "V_t in place of V_{t+1}"),
    M("value_clip_min", "clipped value function", (POLICY,),
      (("    vf_loss = 0.5 * (torch.max(vf_losses1, vf_losses2) if ppo.clip_value else vf_losses1).mean()",
        "    vf_loss = 0.5 * (torch.min(vf_losses1, vf_losses2) if ppo.clip_value else vf_losses1).mean()"),),
      "the smaller of the two squared errors"),
    M("value_clip_around_zero", "clipped value function", (POLICY,),
      (("    vpred_clipped = values + torch.clamp(vpred - values, -ppo.cliprange_value, ppo.cliprange_value)",
        "    vpred_clipped = torch.clamp(vpred, -ppo.cliprange_value, ppo.cliprange_value)"),),
      "the prediction clipped around 0, not around the rollout's value"),
    M("rank_seeds_equal", "different seeds for different processes", BOTH,
      (("    torch.manual_seed(args.seed + accelerator.process_index * RANK_SEED_STRIDE)",
        "    torch.manual_seed(args.seed)"),),
      "every process samples with the same seed"),
    M("one_shuffle_per_update", "batches and minibatches", (POLICY,),
      (("    order = torch.stack([share[torch.randperm(share.numel(), device=device)] for share in rows])",
        "    order = rows"),),
      "the minibatches in the rollout's order, not shuffled every epoch"),
    M("step_per_epoch", "batches and minibatches", (POLICY,),
      (("                    with accelerator.accumulate(policy):", "                    if True:"),
       ("                        optimizer.step()\n                        optimizer.zero_grad()\n",
        "                        pass\n"),
       ("        policy.eval()\n        timer(\"time/ppo_epochs\")", "            optimizer.step()\n"
        "            optimizer.zero_grad()\n        policy.eval()\n        timer(\"time/ppo_epochs\")"),),
      "one optimizer step per epoch over the summed minibatch losses"),
    # the PPO losses
    M("ratio_inverted", "PPO policy loss", (POLICY,),
      (("    ratio = torch.exp(log_ratio)\n", "    ratio = torch.exp(-log_ratio)\n"),), "the ratio old / new"),
    M("policy_clip_min", "PPO policy loss", (POLICY,),
      (("    pg_loss = torch.max(pg_losses1, pg_losses2).mean()", "    pg_loss = torch.min(pg_losses1, pg_losses2).mean()"),),
      "the optimistic bound instead of the pessimistic one"),
    M("policy_clip_twice_as_wide", "PPO policy loss", (POLICY,),
      (("torch.clamp(ratio, 1 - ppo.cliprange, 1 + ppo.cliprange)",
        "torch.clamp(ratio, 1 - 2 * ppo.cliprange, 1 + 2 * ppo.cliprange)"),),
      "the ratio clipped at ±0.4"),
    M("value_loss_unweighted", "PPO loss", (POLICY,),
      (("    loss = pg_loss + ppo.vf_coef * vf_loss\n", "    loss = pg_loss + vf_loss\n"),), "vf_coef left out"),
    M("approxkl_without_half", "PPO statistics", (POLICY,),
      (('            "ppo/policy/approxkl": 0.5 * (log_ratio**2).mean(),',
        '            "ppo/policy/approxkl": (log_ratio**2).mean(),'),),
      "approxkl as the mean squared log-ratio, without OpenAI's 1/2"),
    # log-probs and entropy
    M("entropy_without_logsumexp", "entropy", (POLICY,),
      (("        entropy = log_normalizer - ((logits - log_normalizer.unsqueeze(-1)).exp() * logits).sum(-1)",
        "        entropy = -((logits - log_normalizer.unsqueeze(-1)).exp() * logits).sum(-1)"),),
      "the entropy without its log-normalizer"),
    M("logprobs_shifted", "log-probs", (POLICY,),
      (("        hidden = padded_forward(self.lm.base_model, query_responses, pad_id)[:, context_length - 1 : -1]",
        "        hidden = padded_forward(self.lm.base_model, query_responses, pad_id)[:, context_length:]"),),
      "the policy's log-probs and values read one position late"),
    M("log_softmax", "log-probs", (POLICY,),
      (("    logprobs = logits.gather(2, tokens.unsqueeze(-1)).squeeze(-1) - log_normalizer",
        "    logprobs = F.log_softmax(logits, -1).gather(2, tokens.unsqueeze(-1)).squeeze(-1)"),),
      "F.log_softmax in place of logit - logsumexp: the same function in exact arithmetic, but torch's float32 "
      "log_softmax on a CPU is ~1e-4 nats off float64 on this task where logit - logsumexp is ~1e-6"),
    M("logprobs_unscaled_in_rollout", "logits scaled by the sampling temperature", (POLICY,),
      (("                unwrapped, ref_lm, query_responses, contexts.shape[1], pad_id, scale, args.micro_batch_size",
        "                unwrapped, ref_lm, query_responses, contexts.shape[1], pad_id, 1.0, args.micro_batch_size"),),
      "the rollout's log-probs from the raw logits, the PPO epochs' from logits / T"),
    # the reward model
    M("normalization_sample_std", "reward normalization before and after", (REWARD,),
      (("        return mean, math.sqrt(max(square_mean - mean**2, 0.0))",
        "        return mean, math.sqrt(max(square_mean - mean**2, 0.0) * n / (n - 1))"),),
      "the sample standard deviation instead of the population one"),
    M("normalization_bias_unscaled", "reward normalization before and after", (REWARD,),
      (("    model.reward_bias.fill_(-mean / std)", "    model.reward_bias.fill_(-mean)"),), "bias = -μ, not -μ/σ"),
    M("label_order_other_seed", "label order", (REWARD,),
      (("np.random.RandomState(args.seed).permutation(args.labels.num_train)",
        "np.random.RandomState(args.seed + 1).permutation(args.labels.num_train)"),),
      "the labels in another order than OpenAI's for the seed"),
    M("labels_unshuffled", "label order", (REWARD,),
      (("np.random.RandomState(args.seed).permutation(args.labels.num_train)", "np.arange(args.labels.num_train)"),),
      "the labels in file order"),
    M("best_of_n_sees_pads", "padding", (REWARD,),
      (("        sees = sees & is_token[:, None, :] | torch.eye(", "        sees = sees & (is_token | ~is_token)[:, None, :] | torch.eye("),),
      "in the best-of-4 forward, tokens attend to the pads"),
    M("labels_split_strided", "batches", (REWARD,),
      (("        local_ids = global_ids.chunk(accelerator.num_processes)[accelerator.process_index]",
        "        local_ids = global_ids[accelerator.process_index :: accelerator.num_processes]"),),
      "each process takes every world_size-th label of a step (OpenAI's split) instead of a block",
      equivalent="the same labels make up the step and DDP averages their gradients: only the order of the sums "
      "changes (OpenAI splits strided, this project in blocks)"),
    # what matters only with several processes, or only from update 2 on
    M("kl_controller_fed_local_kl", "several processes", (POLICY,),
      (('        kl_ctl.update(row["objective/kl"], ppo.batch_size)',
        '        kl_ctl.update(-(rollout["ref_logprobs"] - rollout["logprobs"]).sum(1).mean().item(), ppo.batch_size)'),),
      "the controller fed this process's KL instead of the mean over all processes"),
    M("kl_controller_local_batch", "several processes", (POLICY,),
      (('        kl_ctl.update(row["objective/kl"], ppo.batch_size)',
        '        kl_ctl.update(row["objective/kl"], args.local_batch_size)'),),
      "the controller's move scaled by this process's episodes, not the update's"),
    M("lr_schedule_counts_local_updates", "several processes", (POLICY,),
      (("        lr = linear_lr(ppo.lr, update - 1, args.num_updates)",
        "        lr = linear_lr(ppo.lr, update - 1, args.num_updates * accelerator.num_processes)"),),
      "the PPO lr annealed over updates counted per process (as if each process ran the whole schedule)"),
    M("lr_not_annealed", "learning rate annealing", (POLICY,),
      (("        lr = linear_lr(ppo.lr, update - 1, args.num_updates)", "        lr = linear_lr(ppo.lr, 0, args.num_updates)"),),
      "the PPO lr kept at its first update's value (the same as OpenAI's at update 1)"),
    M("reward_lr_schedule_counts_local_steps", "several processes", (REWARD,),
      (("        lr = linear_lr(args.lr, step - 1, args.num_updates)",
        "        lr = linear_lr(args.lr, step - 1, args.num_updates * accelerator.num_processes)"),),
      "the reward model's lr annealed over steps counted per process"),
    M("gradients_not_averaged", "several processes", (POLICY,),
      (("                    with accelerator.accumulate(policy):", "                    with accelerator.no_sync(policy):"),),
      "PPO's gradients never all-reduced: each process steps on its own rows"),
    M("normalization_local_stats", "several processes", (REWARD,),
      (('        sums = accelerator.reduce(torch.stack([scores.mean(), scores.square().mean()]), "mean")',
        "        sums = torch.stack([scores.mean(), scores.square().mean()])"),),
      "the reward normalization's mean and std from this process's samples only"),
    M("metrics_from_process_0", "several processes", ("run_utils.py",),
      (("    mean_values = gathered[:, : len(means)].mean(0).tolist()",
        "    mean_values = gathered[0, : len(means)].tolist()"),),
      "every metric (and the KL the controller reads) from process 0 instead of the mean over processes"),
    M("labels_same_block_everywhere", "several processes", (REWARD,),
      (("        local_ids = global_ids.chunk(accelerator.num_processes)[accelerator.process_index]",
        "        local_ids = global_ids.chunk(accelerator.num_processes)[0]"),),
      "every process trains on the step's first block of labels"),
    M("held_out_sums_local", "several processes", (REWARD,),
      (('    loss_sum, accuracy_sum, count = accelerator.reduce(totals, "sum").tolist()',
        "    loss_sum, accuracy_sum, count = totals.tolist()"),),
      "the held-out loss and accuracy of this process's labels only"),
    M("whitening_over_all_shares", "per-minibatch reward and advantage whitening", (POLICY,),
      (("                advantages, returns = compute_advantages(rewards[share_rows], values[share_rows], ppo)",
        "                advantages, returns = compute_advantages(rewards[share_rows.flatten()][None], "
        "values[share_rows.flatten()][None], ppo)"),),
      "one process with --ppo.whitening-ranks 2 whitens its minibatch whole, not per share (as 2 processes do)"),
    M("whitening_ranks_per_process", "several processes", (POLICY,),
      (("    args.local_whitening_ranks = ppo.whitening_ranks // processes",
        "    args.local_whitening_ranks = ppo.whitening_ranks"),),
      "each process splits its rows into all --ppo.whitening-ranks shares"),
    # the arguments at the calls the replay replaces (benchmark/openai/replay.py holds them against OpenAI's)
    M("rollout_sampled_at_temperature_1", "replaced calls", (POLICY,),
      (("                unwrapped.lm, contexts, pad_id, task.response_length, task.temperature, chunk",
        "                unwrapped.lm, contexts, pad_id, task.response_length, 1.0, chunk"),),
      "the rollout sampled at temperature 1 (the log-probs still at the task's)"),
    M("rollout_one_token_longer", "replaced calls", (POLICY,),
      (("                unwrapped.lm, contexts, pad_id, task.response_length, task.temperature, chunk",
        "                unwrapped.lm, contexts, pad_id, task.response_length + 1, task.temperature, chunk"),),
      "the rollout's responses one token longer than --task.response-length"),
    M("rollout_from_queries", "replaced calls", (POLICY,),
      (("                unwrapped.lm, contexts, pad_id, task.response_length, task.temperature, chunk",
        "                unwrapped.lm, queries, pad_id, task.response_length, task.temperature, chunk"),),
      "responses sampled after the bare queries, without the prefix and suffix"),
    M("rollout_rows_global", "replaced calls", (POLICY,),
      (("        queries, fields = stream.next_batch(args.local_batch_size, device)",
        "        queries, fields = stream.next_batch(ppo.batch_size, device)"),),
      "each process asks for the global batch's rows"),
    M("stream_rank_0", "replaced calls", (POLICY,),
      (("        texts, tokenizer, task, pad_id, args.seed, accelerator.process_index, accelerator.num_processes, gold.texts",
        "        texts, tokenizer, task, pad_id, args.seed, 0, accelerator.num_processes, gold.texts"),),
      "the policy's query stream built as process 0's on every process (all read the same texts)"),
    M("stream_world_1", "replaced calls", (POLICY,),
      (("        texts, tokenizer, task, pad_id, args.seed, accelerator.process_index, accelerator.num_processes, gold.texts",
        "        texts, tokenizer, task, pad_id, args.seed, accelerator.process_index, 1, gold.texts"),),
      "the policy's query stream built for one process (each reads every text)"),
    M("reward_stream_rank_0", "replaced calls", (REWARD,),
      (("        texts, tokenizer, task, pad_id, args.seed, accelerator.process_index, accelerator.num_processes\n",
        "        texts, tokenizer, task, pad_id, args.seed, 0, accelerator.num_processes\n"),),
      "the reward script's query stream built as process 0's on every process"),
    M("normalization_sampled_at_temperature_1", "replaced calls", (REWARD,),
      (("        responses = sample_responses(ref_lm, contexts, reward_model.pad_id, task.response_length, task.temperature)",
        "        responses = sample_responses(ref_lm, contexts, reward_model.pad_id, task.response_length, 1.0)"),),
      "the normalizations' samples drawn at temperature 1"),
    M("minibatches_doubled", "replaced calls", (POLICY,),
      (("            for share_rows in minibatches(args.local_batch_size, args.local_whitening_ranks, ppo.nminibatches, device):",
        "            for share_rows in minibatches(args.local_batch_size, args.local_whitening_ranks, 2 * ppo.nminibatches, "
        "device):"),),
      "twice --ppo.nminibatches minibatches an epoch"),
    M("minibatches_one_share", "replaced calls", (POLICY,),
      (("            for share_rows in minibatches(args.local_batch_size, args.local_whitening_ranks, ppo.nminibatches, device):",
        "            for share_rows in minibatches(args.local_batch_size, 1, ppo.nminibatches, device):"),),
      "the epochs shuffle a process's rows as one share, whatever --ppo.whitening-ranks"),
    M("kl_controller_fed_kl_1pct_high", "several processes", (POLICY,),
      (("        proportional_error = float(np.clip(current_kl / self.target - 1, -KL_ERROR_CLIP, KL_ERROR_CLIP))",
        "        proportional_error = float(np.clip(current_kl * 1.01 / self.target - 1, -KL_ERROR_CLIP, KL_ERROR_CLIP))"),),
      "the KL controller fed a KL 1% too high (the multi-rank scenarios keep it inside its clip, so each move shows it)"),
    M("rollout_sampled_by_the_reference", "replaced calls", (POLICY,),
      (("                unwrapped.lm, contexts, pad_id, task.response_length, task.temperature, chunk, stop=stop",
        "                ref_lm, contexts, pad_id, task.response_length, task.temperature, chunk, stop=stop"),),
      "the rollout sampled by the frozen reference policy instead of the policy PPO trains"),
    M("rollout_pad_id_is_eos", "replaced calls", (POLICY,),
      (("                unwrapped.lm, contexts, pad_id, task.response_length, task.temperature, chunk, stop=stop",
        "                unwrapped.lm, contexts, tokenizer.eos_token_id, task.response_length, task.temperature, chunk, "
        "stop=stop"),),
      "the sampler told the pad id is the end-of-text token: it attends to the contexts' pads"),
    M("stream_seed_shifted", "replaced calls", (POLICY,),
      (("        texts, tokenizer, task, pad_id, args.seed, accelerator.process_index, accelerator.num_processes, gold.texts",
        "        texts, tokenizer, task, pad_id, args.seed + 1, accelerator.process_index, accelerator.num_processes, "
        "gold.texts"),),
      "the policy's query stream shuffled with another seed than --seed"),
    M("stream_holds_out_a_text", "replaced calls", (POLICY,),
      (("        texts, tokenizer, task, pad_id, args.seed, accelerator.process_index, accelerator.num_processes, gold.texts",
        "        texts, tokenizer, task, pad_id, args.seed, accelerator.process_index, accelerator.num_processes,\n"
        "        gold.texts or frozenset(texts[i] for i in range(1))"),),
      "the policy's query stream holds a text out when no gold evaluation asks for any"),
    M("one_epoch_more", "replaced calls", (POLICY,),
      (("        for _ in range(ppo.noptepochs):", "        for _ in range(ppo.noptepochs + 1):"),),
      "one PPO epoch more than --ppo.noptepochs in every update"),
    # the gold evaluation, resumed state, the DeepSpeed config the scripts write, label generation, a bf16 path
    M("gold_draws_per_process", "gold evaluation", (POLICY,),
      (("                torch.manual_seed(EVAL_SEED)  # same samples on 1 or N processes; each then scores its share",
        "                torch.manual_seed(EVAL_SEED + accelerator.process_index)"),),
      "the gold evaluation's samples drawn with a seed per process: its numbers depend on the process count",
      suite=("tests/test_chat.py", "tests/test_e2e.py")),
    M("resume_forgets_kl_coef", "resume", (POLICY,),
      (("        kl_ctl.value = state[\"kl_coef\"]", "        pass"),),
      "a resumed run restarts the KL controller at --rewards.kl-coef",
      suite=("tests/test_resume.py::test_policy_sigterm_checkpoints_and_resumes_identically",)),
    M("resume_forgets_stream_position", "resume", (POLICY,),
      (("        stream.load_state(state[\"process\"][\"stream\"])", "        pass"),),
      "a resumed run reads the queries from the start of the stream again",
      suite=("tests/test_resume.py::test_policy_sigterm_checkpoints_and_resumes_identically",)),
    M("reward_resume_forgets_stream_position", "resume", (REWARD,),
      (("        query_stream.load_state(state[\"process\"][\"stream\"])", "        pass"),),
      "a resumed reward run's normalization reads the queries from the start of the stream again",
      suite=("tests/test_resume.py::test_reward_sigterm_or_ctrl_c_writes_a_checkpoint_and_stops_then_resumes_identically",)),
    M("deepspeed_clips_at_1", "DeepSpeed config", ("run_utils.py",),
      (("    config[\"gradient_clipping\"] = 0.0", "    config[\"gradient_clipping\"] = 1.0"),),
      "the DeepSpeed config the scripts write clips gradients at norm 1 (DeepSpeed's default); OpenAI clips none"),
    M("deepspeed_small_buckets", "DeepSpeed config", ("run_utils.py",),
      (("            zero[key] = memory_estimate.ZERO_BUCKET_VALUES", "            zero[key] = 1000"),),
      "ZeRO-2's reduce and all-gather buckets of 1,000 elements",
      equivalent="a bucket only chunks the all-reduce and the all-gather: each element is summed over the same "
      "processes in the same order whatever the chunk it falls in, so the weights are the same bits"),
    M("labels_picked_by_argmax", "label generation", (REWARD,),
      (("        record[\"best\"] = int(rng.choice(NUM_SAMPLES, p=probabilities / probabilities.sum()))",
        "        record[\"best\"] = int(np.argmax(probabilities))"),),
      "the simulated labeler always picks its best-scored sample instead of sampling softmax(beta * score)",
      suite=("tests/test_reward_units.py", "tests/test_tasks.py", "tests/test_e2e.py")),
    M("labels_scored_untruncated", "label generation", (REWARD,),
      (("    responses, _ = truncate_responses(responses, truncate_token_id, task.truncate_after, pad_id)  # (4n, T)",
        "    responses, _ = responses, None"),),
      "the simulated labeler scores and the label file keeps the samples before truncation",
      suite=("tests/test_reward_units.py", "tests/test_tasks.py", "tests/test_e2e.py")),
    M("heads_in_bf16", "bf16", BOTH,
      (("        with torch.autocast(device_type, enabled=False):", "        with contextlib.nullcontext():"),),
      "under --mixed-precision bf16 the LM head's logits and the scalar heads computed in bf16 (autocast left on)",
      suite=("tests/test_mixed_precision.py",)),
    # chat templates, the dataset's fields in rewards, sampling that stops (docs/chat.md): off in OpenAI's tasks, so
    # the comparison with OpenAI's code cannot see them; tests/test_chat.py and the chat task of test_processes.py can
    M("chat_end_of_turn_is_eos", "chat template", ("rlhf_data.py",),
      (('        flag, text = "--task.chat-template: the template\'s end of turn", end_of_turn_text(tokenizer)',
        '        flag, text = "--task.chat-template: the template\'s end of turn", tokenizer.eos_token'),),
      "a chat response ends at EOS, not at the template's end-of-turn token (Llama 3's <|eot_id|>, the tiny "
      "template's <|end|>)"),
    M("chat_prompt_cut_to_fit", "chat template", BOTH,
      (("        return text_tokens + [pad_id] * (task.query_length - len(text_tokens)) if fits else None",
        "        return (text_tokens + [pad_id] * (task.query_length - len(text_tokens)))[: task.query_length]"),),
      "a templated prompt longer than --task.query-length cut to fit (losing the assistant's opened turn), not skipped"),
    M("fields_shuffled_apart", "the dataset's fields", BOTH,
      (("        return queries.to(device), self.texts.fields([row for row, _ in batch])",
        "        return queries.to(device), self.texts.fields(sorted(row for row, _ in batch))"),),
      "a batch's fields in the dataset's order, not its queries' (shuffled) order"),
    M("fields_lost_in_the_checkpoint", "the dataset's fields", BOTH,
      (("        return dict(epoch=self.epoch, used=self.used, produced=self.produced, buffer=self.buffer)",
        "        return dict(epoch=self.epoch, used=self.used, produced=self.produced, "
        "buffer=[[0, query] for _, query in self.buffer])"),),
      "the checkpoint keeps the buffered queries but not their rows: after --resume their fields are another text's"),
    M("fields_of_the_first_chunk", "the dataset's fields", (POLICY,),
      (("                           **{name: values[i : i + chunk] for name, values in fields.items()})",
        "                           **{name: values[:chunk] for name, values in fields.items()})"),),
      "every scoring chunk handed the first chunk's fields"),
    M("gold_fields_of_process_0", "the dataset's fields", (POLICY,),
      (("            name: [value for value in values[rows] for _ in range(samples)] for name, values in self.fields.items()",
        "            name: [value for value in values[: len(queries) // samples] for _ in range(samples)]\n"
        "            for name, values in self.fields.items()"),),
      "the gold evaluation hands every process the fields of process 0's held-out queries"),
    M("sampling_stops_before_truncate_after", "sampling that stops", BOTH,
      (("            ended |= (token[:, 0] == stop[0]) & (step >= stop[1])",
        "            ended |= token[:, 0] == stop[0]"),),
      "a row counts as ended at a truncate token before --task.truncate-after"),
    M("sampling_stops_at_the_first_end", "sampling that stops", BOTH,
      (("            if ended.all():\n                break", "            if ended.any():\n                break"),),
      "sampling stops once any row has ended, not every row"),
    M("rollout_length_per_process", "sampling that stops", (POLICY,),
      (("    if torch.distributed.is_available() and torch.distributed.is_initialized():\n        longest",
        "    if False:\n        longest"),),
      "each process keeps its own responses' length: the processes train on other columns than one process would"),
    M("short_chunk_padded", "sampling that stops", (POLICY,),
      (("            r = torch.cat([r, sample_responses(lm, contexts, pad_id, length - r.shape[1], temperature)], 1)",
        "            r = torch.cat([r, r.new_full((len(r), length - r.shape[1]), pad_id)], 1)"),),
      "a rollout chunk that stopped sooner padded to the batch's length instead of sampled on"),
]  # fmt: skip

REFERENCE_TESTS = "tests/test_openai_reference.py::"
PROCESSES_TESTS = "tests/test_processes.py::"
COMPARISON = [  # the comparison with OpenAI's code and of N processes with 1, the ones that end soonest first
    f"{REFERENCE_TESTS}test_queries_are_cut_at_the_start_and_end_text_as_openais_dataset_cuts_them",
    f"{REFERENCE_TESTS}test_the_sampler_gives_openais_samples_openais_logprobs",
    f"{REFERENCE_TESTS}test_reward_model_training_matches_openai_one_rank",
    f"{REFERENCE_TESTS}test_ppo_update_1_matches_openai[1-1]",
    f"{REFERENCE_TESTS}test_ppo_update_1_matches_openai[2-1]",
    f"{REFERENCE_TESTS}test_policy_scenarios_match_openai[details]",
    f"{REFERENCE_TESTS}test_policy_scenarios_match_openai[plain]",
    f"{REFERENCE_TESTS}test_reward_scenarios_match_openai[padded]",
    f"{REFERENCE_TESTS}test_ppo_update_1_matches_openai[1-2]",
    f"{REFERENCE_TESTS}test_ppo_update_1_matches_openai[2-2]",
    f"{REFERENCE_TESTS}test_policy_scenarios_match_openai[ranks_2]",
    f"{REFERENCE_TESTS}test_policy_scenarios_match_openai[ranks_4]",
    f"{REFERENCE_TESTS}test_reward_model_training_matches_openai_two_ranks",
    f"{REFERENCE_TESTS}test_teacher_forced_updates_match_openai",
    f"{PROCESSES_TESTS}test_the_reward_model_on_two_processes_is_the_reward_model_on_one[ddp]",
    f"{PROCESSES_TESTS}test_ppo_on_two_processes_is_ppo_on_one[ddp]",
    f"{PROCESSES_TESTS}test_the_reward_model_on_two_processes_is_the_reward_model_on_one[zero2]",
    f"{PROCESSES_TESTS}test_ppo_on_two_processes_is_ppo_on_one[zero2]",
    f"{REFERENCE_TESTS}test_free_running_curves_agree_with_openais_seeds",
    f"{PROCESSES_TESTS}test_a_chat_task_with_fields_on_two_processes_is_the_task_on_one",
]
SECOND_TIER = ["tests/test_policy_units.py", "tests/test_reward_units.py", "tests/test_shared_helpers.py",
               "tests/test_mixed_precision.py", "tests/test_tasks.py", "tests/test_chat.py", "tests/test_e2e.py"]  # fmt: skip
"""The suite's unit and end-to-end tests of the scripts, run on what the comparison misses."""


@dataclass
class Args:
    out: str = "runs/mutations"
    """where the results and the table go"""
    only: tuple[str, ...] = ()
    """run these mutations only, in this order (default: all)"""
    list: bool = False
    """print the mutations, one line each, and exit"""
    report_only: bool = False
    """only write the table, from OUT/results.jsonl"""
    second_tier: bool = True
    """give what the comparison misses to the unit and end-to-end tests (SECOND_TIER)"""
    timeout: int = 1800
    """seconds per test run"""
    publish: bool = False
    """copy the newest result of every mutation and its table to docs/mutations.jsonl and docs/mutations.md"""


def apply(mutation: Mutation, root: Path) -> None:
    """The mutation's edits in the copy at `root`: each `old` exactly once per file, or an error naming it."""
    for name in mutation.files:
        path = root / name
        text = path.read_text()
        for old, new in mutation.edits:
            if text.count(old) != 1:
                raise SystemExit(f"mutation {mutation.name}: its code occurs {text.count(old)} times in {name}, not "
                                 f"once: update the mutation ({old.strip()[:60]!r})")  # fmt: skip
            text = text.replace(old, new)
        path.write_text(text)


def copy_repository(source: Path, destination: Path) -> Path:
    """The tracked files (git ls-files) of `source` copied to `destination`, as a git repository of their own (tests
    read the tracked files), the caches (.cache/: the tokenizer, the tiny models) linked."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=source, capture_output=True, text=True, check=True).stdout
    names = [name for name in names.split("\0") if name and (source / name).is_file()]
    for name in names:
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / name, destination / name)
    (destination / ".cache").symlink_to(REPO / ".cache")
    subprocess.run(["git", "init", "-q"], cwd=destination, check=True)
    subprocess.run(["git", "add", "--", *names], cwd=destination, check=True)
    return destination


def first_failure(output: str) -> Optional[dict]:
    """The first failing test of a pytest -x run, its message (what differed, where: the `E` lines of an assert, or
    the text of a pytest.fail without a traceback) and its report's whole text (`section`)."""
    test = re.search(r"^(FAILED|ERROR) (\S+)", output, re.MULTILINE)
    if not test:
        return None
    # its report's header: pytest centres the name in a rule of 80 columns, so a name of 73 or more characters gets
    # one or two underscores a side (and "ERROR at setup of NAME" for a fixture's failure)
    name = test.group(2).split("::")[-1]
    header = rf"^_+ (?:ERROR at \w+ of )?(?:\S+\.)?{re.escape(name)} _+\n"
    section = re.search(header + r"(.*?)(?=^_+ \S.* _+\n|^={3,})", output, re.MULTILINE | re.DOTALL)
    text = section.group(1) if section else ""
    lines = text.strip().splitlines()
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    message = errors[0] if errors else next((line.strip() for line in lines if line.strip()), "")
    return {"test": test.group(2).split("::")[-1], "assertion": message[:240], "section": text,
            "setup_error": test.group(1) == "ERROR"}  # fmt: skip


BROKEN_EXCEPTION = re.compile(
    r"^E\s+(?!AssertionError\b)(?:[\w.]+\.)?(\w+(?:Error|Exception|Interrupt)):? ?(.*)$", re.M
)


def outcome(found: Optional[dict]) -> Optional[dict]:
    """What a failure means for a mutation: `caught`, by a comparison's assertion (a number, a draw, a query that
    differs) or by one of the replay's checks of the calls it replaces (a `replay.py:` line); `broken`, when the
    mutated code did not run to a comparison: a script that crashed (a traceback), stopped itself (an `error:` line of
    run_utils.fail), an exception in the test's own code, a failing fixture, a timeout, a collection error. None: no
    test failed."""
    if found is None:
        return None
    section = found.pop("section", "")
    setup_error = found.pop("setup_error", False)
    replay = re.search(r"replay\.py: [^\n]*?(?=\\n|$)", section, re.M)
    if replay:
        return {**found, "kind": "caught", "by": "call site", "assertion": replay.group(0)[:240]}
    crash = re.findall(r"^\s*(?:E\s+)?(\w+(?:Error|Exception)): (.*)$", section.split("Traceback (most recent call last)")[-1],
                       re.M) if "Traceback (most recent call last)" in section else []  # fmt: skip
    if crash:
        name, text = crash[-1]
        return {**found, "kind": "broken", "assertion": f"crashed: {name}: {text}"[:240]}
    stopped = re.search(r"(?:^(?:E\s+)?|AssertionError: )(error: [^\n]*)", section, re.M)
    if stopped:
        return {**found, "kind": "broken", "assertion": f"the script stopped: {stopped.group(1)}"[:240]}
    exception = BROKEN_EXCEPTION.search(section)
    if exception or setup_error:
        what = f"{exception.group(1)}: {exception.group(2)}" if exception else found["assertion"]
        return {**found, "kind": "broken", "assertion": f"the test's code failed: {what}"[:240]}
    if not section.strip():  # no report of the test could be read: nothing says it compared anything (issue 66)
        return {**found, "kind": "unknown", "assertion": "its failure report could not be read"}
    return {**found, "kind": "caught", "by": "comparison"}


def run_tests(root: Path, tests: list[str], timeout: int) -> tuple[Optional[dict], float]:
    start = time.time()
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    try:
        result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout, env=environment)
    except subprocess.TimeoutExpired:
        return {"test": "(timed out)", "assertion": f"no result in {timeout} s", "kind": "broken"}, time.time() - start
    output = result.stdout + result.stderr
    if result.returncode not in (0, 1):
        last = output.strip().splitlines()[-1][:200] if output.strip() else f"exit {result.returncode}"
        return {"test": "(pytest could not run)", "assertion": last, "kind": "broken"}, time.time() - start
    return outcome(first_failure(output)), time.time() - start


def study(mutation: Optional[Mutation], snapshot: Path, args: Args) -> dict:
    """One mutation (None: the unmutated copy) applied to a fresh copy of `snapshot`, then the comparison, then the
    second tier if the comparison saw nothing."""
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        root = copy_repository(snapshot, Path(tmp))
        if mutation is not None:
            apply(mutation, root)
        if mutation is not None and mutation.suite:  # a path the comparison never runs
            row = {"name": mutation.name, "caught_by_comparison": None, "seconds": 0.0, "comparison_skipped": True}
            row["caught_by_suite"], row["suite_seconds"] = run_tests(root, list(mutation.suite), args.timeout)
            return row
        failure, seconds = run_tests(root, COMPARISON, args.timeout)
        row = {"name": mutation.name if mutation else "(none)", "caught_by_comparison": failure, "seconds": seconds}
        if failure is None and mutation is not None and args.second_tier:
            row["caught_by_suite"], row["suite_seconds"] = run_tests(root, SECOND_TIER, args.timeout)
    return row


def verdict(row: dict, mutation: Mutation) -> tuple[str, str]:
    """(what happened, where): caught by the comparison, by the replay's call-site checks or by the suite; broken (the
    mutated code crashed or stopped before any comparison); the same computation (nothing failed, and the mutation
    says why); or survived."""
    failure = row["caught_by_comparison"] or row.get("caught_by_suite")
    if failure is None:
        return ("not caught", mutation.equivalent) if mutation.equivalent else ("**survived**", "")
    where = f"`{failure['test']}`: {shorten(failure['assertion'])}"
    if failure.get("kind", "caught") in ("broken", "unknown"):
        return f"**{failure['kind']}**", where
    if row["caught_by_comparison"] is None:
        return "the suite", where
    return ("a call-site check" if failure.get("by") == "call site" else "the comparison"), where


def shorten(message: str, width: int = 110) -> str:
    """The start of an assertion message, cut at a word: the table names the test and what differed first."""
    message = message.strip() or "(the test's assertion)"
    return message if len(message) <= width else message[:width].rsplit(" ", 1)[0] + " …"


def cell(text: str) -> str:
    """A markdown table cell: `|` escaped (KL(p || q) would split the row)."""
    return text.replace("|", "\\|")


def write_table(results: Path, table: Path) -> Path:
    """The table of `results` (one JSON line per mutation) in MUTATIONS' order."""
    rows = {row["name"]: row for row in map(json.loads, results.read_text().splitlines())}
    lines = ["| mutation | detail | the change | caught by | where |", "|---|---|---|---|---|"]
    for mutation in MUTATIONS:
        if mutation.name in rows:
            caught, where = verdict(rows[mutation.name], mutation)
            lines.append("| " + " | ".join(cell(text) for text in (f"`{mutation.name}`", mutation.area, mutation.what,
                                                                   caught, where)) + " |")  # fmt: skip
    table.write_text("\n".join(lines) + "\n")
    return table


PUBLISHED = REPO / "docs" / "mutations.jsonl", REPO / "docs" / "mutations.md"
"""The last full run's results and their table (docs/side-by-side.md links it), written by --publish."""


def main(args: Args) -> None:
    out = Path(args.out)
    if args.list:
        for mutation in MUTATIONS:
            print(f"{mutation.name:40} {mutation.area:45} {mutation.what}")
        return
    names = {mutation.name for mutation in MUTATIONS}
    unknown = set(args.only) - names
    if unknown:
        raise SystemExit(f"error: --only {' '.join(sorted(unknown))}: no such mutation (--list shows them)")
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        # the working tree as it is now, once: every mutation is applied to the same code
        snapshot = copy_repository(REPO, Path(tempfile.mkdtemp(prefix="mutations-snapshot-")))
        baseline = study(None, snapshot, args)
        if baseline["caught_by_comparison"] is not None:
            raise SystemExit(f"error: the unmutated copy fails the comparison: {baseline['caught_by_comparison']}")
        print(f"mutations: the unmutated copy passes the comparison ({baseline['seconds']:.0f} s)", flush=True)
        if args.second_tier:
            with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
                failed, seconds = run_tests(copy_repository(snapshot, Path(tmp)), SECOND_TIER, args.timeout)
            if failed is not None:
                raise SystemExit(f"error: the unmutated copy fails the second tier: {failed}")
            print(f"mutations: the unmutated copy passes the second tier ({seconds:.0f} s)", flush=True)
        chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
        outside = sorted({test for m in chosen for test in m.suite if test.split("::")[0] not in SECOND_TIER})
        if outside:  # the tests a mutation's suite names beyond the second tier: they must pass unmutated too
            with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
                failed, seconds = run_tests(copy_repository(snapshot, Path(tmp)), outside, args.timeout)
            if failed is not None:
                raise SystemExit(f"error: the unmutated copy fails a mutation's suite: {failed}")
            print(f"mutations: the unmutated copy passes {len(outside)} more suite tests ({seconds:.0f} s)", flush=True)
        by_name = {mutation.name: mutation for mutation in MUTATIONS}
        for mutation in [by_name[name] for name in dict.fromkeys(args.only)] if args.only else MUTATIONS:
            row = study(mutation, snapshot, args)
            with open(out / "results.jsonl", "a") as file:
                file.write(json.dumps(row) + "\n")
            caught, where = verdict(row, mutation)
            print(f"mutations: {mutation.name}: {caught}: {where} ({row['seconds']:.0f} s)", flush=True)
        shutil.rmtree(snapshot)
    print(f"mutations: wrote {write_table(out / 'results.jsonl', out / 'mutations.md')}")
    if args.publish:
        results = {row["name"]: row for row in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
        missing = names - set(results)
        if missing:
            raise SystemExit(f"error: --publish: no result for {' '.join(sorted(missing))}: run them (--only)")
        # the newest result of each mutation, in MUTATIONS' order
        PUBLISHED[0].write_text("".join(json.dumps(results[m.name]) + "\n" for m in MUTATIONS))
        print(f"mutations: wrote {PUBLISHED[0]} and {write_table(*PUBLISHED)}")


if __name__ == "__main__":
    main(tyro.cli(Args))
