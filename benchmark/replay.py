"""This project's training scripts on given samples: "ours" in the side-by-side with OpenAI's code
(benchmark/side_by_side.py) and in its CI test (tests/test_openai_reference.py).

    python benchmark/replay.py train_reward_accelerate.py SAMPLES.npz FLAGS...   # normalizations on given samples
    python benchmark/replay.py train_policy_accelerate.py ROLLOUTS.npz FLAGS...  # PPO on given queries, responses
    torchrun --standalone --nproc_per_node 2 benchmark/replay.py train_policy_accelerate.py ROLLOUTS.npz FLAGS...

The script's own main() runs with its own flags; only the random draws are replaced, as OpenAI's side is given them
(benchmark/openai_tf/run_openai.py): which queries a batch holds (QueryStream.next_batch) and which responses are
sampled (sample_responses); for the policy also each PPO epoch's shuffle of the minibatch rows (minibatches), which
OpenAI draws with numpy. Everything else — log-probs, values, truncation, scores, rewards, whitening, GAE, the PPO
epochs, Adam, the lr schedule, the KL controller, the normalization's arithmetic — is the script's.

A global batch of N rows is split as OpenAI's ranks split it: process r of W takes rows r * N / W ... (r + 1) * N / W.
SAMPLES.npz: `{before,after}_{queries,responses}`, (N, C) and (N, T), OpenAI's right-padded queries (pad 50259).
ROLLOUTS.npz: `queries` (U, B, C), `responses` (U, B, T) per update and, optionally, `orders` (U, R, epochs, B / R):
OpenAI rank g's permutation of its rows in each epoch (R = --ppo.whitening-ranks).
"""

import os
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]

OPENAI_PAD_ID = 50259  # OpenAI's pad id for GPT-2's encoding (language/encodings.py: len(encoder) + 2)


class Replay:
    """Batches given in the order the script asks for them; each process takes its share of every batch."""

    def __init__(self, batches: list[tuple[np.ndarray, np.ndarray]], pad_id: int):
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.batches, self.pad_id, self.pending = list(batches), pad_id, None

    def share(self, rows: np.ndarray) -> np.ndarray:
        size = len(rows) // self.world
        return rows[self.rank * size : (self.rank + 1) * size]

    def queries(self, n: int):
        """The next batch's queries if it has n rows per process (left-padded, with this project's pad id), else
        None: the script draws other batches (a check of the corpus, a sample table) itself."""
        if not self.batches or len(self.batches[0][0]) != n * self.world:
            return None
        queries, responses = (torch.from_numpy(self.share(np.asarray(x, dtype=np.int64))) for x in self.batches.pop(0))
        queries = torch.where(queries == OPENAI_PAD_ID, self.pad_id, queries)
        self.pending = (queries, responses)
        return queries

    def responses(self, contexts: torch.Tensor):
        """The responses of the batch the script just took, if `contexts` are its queries' contexts, else None."""
        if self.pending is None or len(contexts) != len(self.pending[0]):
            return None
        queries, responses = self.pending
        self.pending = None
        return responses.to(contexts.device)


def install(script, replay: Replay, orders=None) -> None:
    """Replace the script's draws by the replay's: its QueryStream class, sample_responses and (with `orders`, for
    the policy) minibatches."""
    original_stream, original_sample = script.QueryStream, script.sample_responses

    class ReplayedQueryStream(original_stream):
        def next_batch(self, n: int) -> torch.Tensor:
            given = replay.queries(n)
            if given is None:
                return super().next_batch(n)
            replay.pending = (self.format(given), replay.pending[1])  # what sample_responses will be handed
            return script.right_padding_to_left_padding(given, replay.pad_id)

    def replayed_sample(lm, contexts, pad_id, response_length, temperature, samples_per_context=1):
        given = None
        if replay.pending is not None and torch.equal(replay.pending[0].to(contexts.device), contexts):
            given = replay.responses(contexts)
        if given is None:
            return original_sample(lm, contexts, pad_id, response_length, temperature, samples_per_context)
        assert given.shape == (len(contexts), response_length) and samples_per_context == 1, given.shape
        return given

    script.QueryStream, script.sample_responses = ReplayedQueryStream, replayed_sample
    if orders is not None:
        calls = []

        def replayed_minibatches(batch_size: int, shares: int, nminibatches: int, device):
            update, epoch = divmod(len(calls), orders.shape[2])
            calls.append(1)
            rows = torch.arange(batch_size, device=device).view(shares, -1)  # (G, B/G): this process's shares
            first = replay.rank * shares  # this process's shares are OpenAI's ranks first ... first + G - 1
            permutations = torch.as_tensor(
                orders[update, first : first + shares, epoch], dtype=torch.int64, device=device
            )
            return torch.gather(rows, 1, permutations).chunk(nminibatches, dim=1)

        script.minibatches = replayed_minibatches


def main(argv: list[str]) -> None:
    import run_utils

    script_name, data, flags = argv[0], np.load(argv[1]), argv[2:]
    if script_name == "train_reward_accelerate.py":
        import train_reward_accelerate as script

        phases = [(data[f"{phase}_queries"], data[f"{phase}_responses"]) for phase in ("before", "after")]
        batches = [phases[0], phases[0], phases[1], phases[1]]  # each normalization samples twice: set, then check
        orders = None
    elif script_name == "train_policy_accelerate.py":
        import train_policy_accelerate as script

        batches = list(zip(data["queries"], data["responses"], strict=True))
        orders = data["orders"] if "orders" in data.files else None
    else:
        raise SystemExit(f"replay.py: {script_name}: train_reward_accelerate.py or train_policy_accelerate.py")
    args = run_utils.task_cli(script.task_defaults, flags)
    tokenizer = script.load_tokenizer(args.base_model)
    install(script, Replay(batches, tokenizer.pad_token_id), orders)
    script.main(args)


if __name__ == "__main__":
    # the repository's modules, and this folder's as benchmark.NAME: run as a script, this folder would come first on
    # the path, and its benchmark.py would shadow the package
    sys.path[:] = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    main(sys.argv[1:])
