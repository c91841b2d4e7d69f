"""This project's training scripts on given samples: "ours" in the side-by-side with OpenAI's code
(benchmark/openai/side_by_side.py) and in its CI test (tests/test_openai_reference.py).

    python -m benchmark.openai.replay train_reward_accelerate.py SAMPLES.npz FLAGS...   # normalizations, given samples
    python -m benchmark.openai.replay train_policy_accelerate.py ROLLOUTS.npz FLAGS...  # PPO, given queries, responses
    torchrun --standalone --nproc_per_node 2 -m benchmark.openai.replay train_policy_accelerate.py ROLLOUTS.npz FLAGS...

The script's own main() runs with its own flags; only the random draws are replaced, as OpenAI's side is given them
(benchmark/openai/tf/run_openai.py): which queries a batch holds (QueryStream.next_batch) and which responses are
sampled (sample_responses); for the policy also each PPO epoch's shuffle of the minibatch rows (minibatches), which
OpenAI draws with numpy. Everything else — log-probs, values, truncation, scores, rewards, whitening, GAE, the PPO
epochs, Adam, the lr schedule, the KL controller, the normalization's arithmetic — is the script's.

A global batch of N rows is split as OpenAI's ranks split it: process r of W takes rows r * N / W ... (r + 1) * N / W.
SAMPLES.npz: `{before,after}_{queries,responses}`, (N, C) and (N, T), OpenAI's right-padded queries (pad 50259).
ROLLOUTS.npz: `queries` (U, B, C), `responses` (U, B, T) per update and, optionally, `orders` (U, R, epochs, B / R):
OpenAI rank g's permutation of its rows in each epoch (R = --ppo.whitening-ranks). Without `responses`, only the
queries (and orders) are given and the script samples its own responses (the free-running side by side).
--policy-init DIR (policy): the trained policy starts from DIR (a policy directory as the script writes it, value
head included), the reference policy from --base-model: a warm start, as OpenAI's side is given.

Every given draw must be taken, in order: a batch the script does not ask for, an epoch's order it does not use or
responses it samples for other contexts than the batch's stop the run with an error (the comparison would otherwise
run on the script's own draws and fail far from the cause).
"""

import os
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch

OPENAI_PAD_ID = 50259  # OpenAI's pad id for GPT-2's encoding (language/encodings.py: len(encoder) + 2)


class Replay:
    """Batches given in the order the script asks for them; each process takes its share of every batch."""

    def __init__(self, batches: list[tuple[np.ndarray, Optional[np.ndarray]]], pad_id: int):
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.batches, self.pad_id, self.pending, self.taken = list(batches), pad_id, None, 0

    def share(self, rows: np.ndarray) -> np.ndarray:
        size = len(rows) // self.world
        return rows[self.rank * size : (self.rank + 1) * size]

    def queries(self, n: int):
        """The next batch's queries if it has n rows per process (left-padded, with this project's pad id), else
        None: the script draws other batches (a check of the corpus, a sample table) itself."""
        if not self.batches or len(self.batches[0][0]) != n * self.world:
            return None
        if self.pending is not None and self.pending[1] is not None:
            raise SystemExit(f"replay.py: the responses of given batch {self.taken} were never sampled for")
        queries, responses = self.batches.pop(0)
        queries = torch.from_numpy(self.share(np.asarray(queries, dtype=np.int64)))
        queries = torch.where(queries == OPENAI_PAD_ID, self.pad_id, queries)
        responses = None if responses is None else torch.from_numpy(self.share(np.asarray(responses, dtype=np.int64)))
        self.pending, self.taken = (queries, responses), self.taken + 1
        return queries

    def responses(self, contexts: torch.Tensor):
        """The given responses of the next rows of the batch the script just took (it samples in chunks), if
        `contexts` are those rows' contexts; None when the batch has no responses (the script samples its own) or no
        batch is pending (a draw of the script's own: label sampling, sample tables)."""
        if self.pending is None:
            return None
        given_contexts, responses = self.pending
        if responses is None:
            self.pending = None
            return None
        rows = slice(0, len(contexts))
        if not torch.equal(given_contexts[rows].to(contexts.device), contexts):
            raise SystemExit(f"replay.py: given batch {self.taken}'s responses requested for other contexts")
        rest = (given_contexts[rows.stop :], responses[rows.stop :])
        self.pending = rest if len(rest[0]) else None
        return responses[rows].to(contexts.device)

    def check_all_taken(self, orders_taken: int, orders: Optional[np.ndarray]) -> None:
        """Every given batch (and every epoch's order) was used: else the script ran on draws of its own."""
        if self.batches or (self.pending is not None and self.pending[1] is not None):
            left = len(self.batches) + (self.pending is not None)
            raise SystemExit(f"replay.py: {left} of the {self.taken + len(self.batches)} given batches were not used")
        if orders is not None and orders_taken != orders.shape[0] * orders.shape[2]:
            raise SystemExit(f"replay.py: {orders_taken} of the {orders.shape[0] * orders.shape[2]} given epoch orders "
                             "were used")  # fmt: skip


def install(script, replay: Replay, orders=None) -> list:
    """Replace the script's draws by the replay's: its QueryStream class, sample_responses and (with `orders`, for
    the policy) minibatches. Returns the list that counts the orders taken."""
    original_stream, original_sample = script.QueryStream, script.sample_responses

    class ReplayedQueryStream(original_stream):
        def next_batch(self, n: int) -> torch.Tensor:
            given = replay.queries(n)
            if given is None:
                return super().next_batch(n)
            replay.pending = (self.format(given), replay.pending[1])  # what sample_responses will be handed
            return script.right_padding_to_left_padding(given, replay.pad_id)

    def replayed_sample(lm, contexts, pad_id, response_length, temperature, samples_per_context=1):
        given = replay.responses(contexts)
        if given is None:
            return original_sample(lm, contexts, pad_id, response_length, temperature, samples_per_context)
        assert given.shape == (len(contexts), response_length) and samples_per_context == 1, given.shape
        return given

    script.QueryStream, script.sample_responses = ReplayedQueryStream, replayed_sample
    calls = []
    if orders is not None:

        def replayed_minibatches(batch_size: int, shares: int, nminibatches: int, device):
            update, epoch = divmod(len(calls), orders.shape[2])
            if update >= len(orders):
                raise SystemExit(f"replay.py: an epoch beyond the {orders.shape[0] * orders.shape[2]} given orders")
            calls.append(1)
            rows = torch.arange(batch_size, device=device).view(shares, -1)  # (G, B/G): this process's shares
            first = replay.rank * shares  # this process's shares are OpenAI's ranks first ... first + G - 1
            permutations = torch.as_tensor(
                orders[update, first : first + shares, epoch], dtype=torch.int64, device=device
            )
            return torch.gather(rows, 1, permutations).chunk(nminibatches, dim=1)

        script.minibatches = replayed_minibatches
    return calls


def start_policy_from(script, directory: str) -> None:
    """--policy-init: the script's load_models, then the trained policy's weights and value head from `directory`."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    original_load = script.load_models

    def warm_load_models(args, tokenizer, device):
        policy, ref_lm, reward_model = original_load(args, tokenizer, device)
        warm = script.load_pretrained(AutoModelForCausalLM, directory)
        policy.lm.load_state_dict(warm.state_dict())
        policy.value_head.load_state_dict(load_file(Path(directory) / "value_head.safetensors"))
        return policy, ref_lm, reward_model

    script.load_models = warm_load_models


def main(argv: list[str]) -> None:
    import run_utils

    policy_init = None
    if argv[:1] == ["--policy-init"]:
        policy_init, argv = argv[1], argv[2:]
    script_name, data, flags = argv[0], np.load(argv[1]), argv[2:]
    if script_name == "train_reward_accelerate.py":
        import train_reward_accelerate as script

        phases = [(data[f"{phase}_queries"], data[f"{phase}_responses"]) for phase in ("before", "after")]
        batches = [phases[0], phases[0], phases[1], phases[1]]  # each normalization samples twice: set, then check
        orders = None
    elif script_name == "train_policy_accelerate.py":
        import train_policy_accelerate as script

        responses = data["responses"] if "responses" in data.files else [None] * len(data["queries"])
        batches = list(zip(data["queries"], responses, strict=True))
        orders = data["orders"] if "orders" in data.files else None
        if policy_init is not None:
            start_policy_from(script, policy_init)
    else:
        raise SystemExit(f"replay.py: {script_name}: train_reward_accelerate.py or train_policy_accelerate.py")
    args = run_utils.task_cli(script.task_defaults, flags)
    tokenizer = script.load_tokenizer(args.base_model)
    replay = Replay(batches, tokenizer.pad_token_id)
    orders_taken = install(script, replay, orders)
    script.main(args)
    replay.check_all_taken(len(orders_taken), orders)


if __name__ == "__main__":
    main(sys.argv[1:])
