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
OpenAI rank g's permutation of its rows in each epoch (R = --ppo.whitening-ranks), and `rows` (U, B): each query's
text in --task.query-dataset, whose fields a --rewards.function asks for (tests/test_processes.py's chat task).
Without `responses`, only the queries (and orders) are given and the script samples its own responses (the
free-running side by side).
--policy-init DIR (policy): the trained policy starts from DIR (a policy directory as the script writes it, value
head included), the reference policy from --base-model: a warm start, as OpenAI's side is given.

Every given draw must be taken, in order: a batch the script does not ask for, an epoch's order it does not use or
responses it samples for other contexts than the batch's stop the run with an error (the comparison would otherwise
run on the script's own draws and fail far from the cause).

The call sites are checked too. A replaced call discards the script's own arguments, so a wrong one would change
nothing the comparison sees; each is held against `call_sites`, what OpenAI's side passed at the same call
(benchmark/openai/tf/run_openai.py's calls.json): the rows a batch asks for (per process, as a share of OpenAI's
global batch), the temperature, response length and samples per context handed to the sampler, the rank and world
size the query stream is built with (this process's), and the PPO epochs' batch, whitening shares (OpenAI's ranks)
and minibatches. A mismatch stops the run with one line naming the argument. The replayed draws are those of the
query stream `main` builds: every draw of it in the policy script (the rollout), the normalizations' in the reward
script (`normalize_reward`); other draws (a corpus check, a sample table, labels a labeler makes) are the script's own.
"""

import json
import os
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch

OPENAI_PAD_ID = 50259  # OpenAI's pad id for GPT-2's encoding (language/encodings.py: len(encoder) + 2)


class Replay:
    """Batches given in the order the script asks for them; each process takes its share of every batch. `call_sites`:
    OpenAI's arguments at the replaced calls (rows, response_length, temperature, samples_per_query, sampler, ranks,
    pad_id, query_stream and, for PPO, nminibatches, noptepochs)."""

    def __init__(self, batches: list[tuple[np.ndarray, Optional[np.ndarray]]], pad_id: int, call_sites: dict,
                 rows: Optional[list[np.ndarray]] = None):  # fmt: skip
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.batches, self.pad_id, self.pending, self.taken = list(batches), pad_id, None, 0
        self.call_sites, self.rows = call_sites, None if rows is None else list(rows)
        self.epochs: list[int] = []  # the PPO epochs that shuffled in each update's rollout (install's minibatches)
        self.check("the pad id of the given queries", call_sites["pad_id"], OPENAI_PAD_ID)  # mapped to `pad_id`

    def share(self, rows: np.ndarray) -> np.ndarray:
        size = len(rows) // self.world
        return rows[self.rank * size : (self.rank + 1) * size]

    def check(self, what: str, ours, openai) -> None:
        """One argument of a replaced call against OpenAI's: a mismatch stops the run, naming it."""
        if ours != openai:
            raise SystemExit(f"replay.py: {what} is {ours!r} here, {openai!r} on OpenAI's side")

    def check_stream(self, stream) -> None:
        """The query stream `main` builds: it reads this process's share (its rank and world size are the process's),
        from the run's seed (OpenAI's run.seed), holding out as many texts as OpenAI's query sampler (none)."""
        sites = self.call_sites["query_stream"]
        self.check("the query stream's (rank, world size)", (stream.rank, stream.world_size), (self.rank, self.world))
        self.check("the query stream's seed", stream.seed, sites["seed"])
        self.check("the texts the query stream holds out", len(stream.exclude), sites["excluded"])

    def queries(self, n: int) -> tuple[torch.Tensor, Optional[list[int]]]:
        """The next given batch's queries, this process's share (left-padded, with this project's pad id), and their
        dataset rows when given (None: the batch's fields are not replayed): the script must ask for exactly that
        share."""
        if not self.batches:
            raise SystemExit(f"replay.py: a batch asked for beyond the {self.taken} given ones")
        if self.pending is not None and self.pending[1] is not None:
            raise SystemExit(f"replay.py: the responses of given batch {self.taken} were never sampled for")
        sites, rows = self.call_sites, len(self.batches[0][0])
        what = f"rows asked for per process, of {self.world} (OpenAI: {sites['rows']} per rank of {sites['ranks']})"
        self.check(what, n, rows // self.world)
        queries, responses = self.batches.pop(0)
        queries = torch.from_numpy(self.share(np.asarray(queries, dtype=np.int64)))
        queries = torch.where(queries == OPENAI_PAD_ID, self.pad_id, queries)
        responses = None if responses is None else torch.from_numpy(self.share(np.asarray(responses, dtype=np.int64)))
        rows = None if self.rows is None else self.share(np.asarray(self.rows[self.taken])).tolist()
        self.pending, self.taken = (queries, responses), self.taken + 1
        return queries, rows

    def responses(self, lm, contexts: torch.Tensor, pad_id: int, response_length: int, temperature: float,
                  samples_per_context: int):  # fmt: skip
        """The given responses of the next rows of the batch the script just took (it samples in chunks), if
        `contexts` are those rows' contexts and the sampler's arguments are OpenAI's (the model that samples: the
        policy PPO trains, or for the reward model's normalizations a frozen one, as OpenAI's `ref_policy`; the pad
        id the given queries carry); None when the batch has no responses (the script samples its own) or no batch
        is pending (a draw of the script's own: label sampling, sample tables)."""
        if self.pending is None:
            return None
        sites = self.call_sites
        trained = any(parameter.requires_grad for parameter in lm.parameters())
        self.check("the sampling model", "the policy PPO trains" if trained else "a frozen model",
                   {"policy": "the policy PPO trains", "ref_policy": "a frozen model"}[sites["sampler"]])  # fmt: skip
        self.check("the sampler's pad id", pad_id, self.pad_id)
        self.check("the sampler's temperature", float(temperature), sites["temperature"])
        self.check("the sampler's response length", response_length, sites["response_length"])
        self.check("the sampler's samples per context", samples_per_context, sites["samples_per_query"])
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

    def check_orders(self, orders: np.ndarray, batch_size: int, shares: int, nminibatches: int) -> None:
        """The PPO epochs' arguments against the given orders, (U, OpenAI's ranks, epochs, rows per rank): the batch
        this process shuffles is its share of OpenAI's, its whitening shares are OpenAI's ranks, its minibatches
        OpenAI's."""
        sites = self.call_sites
        self.check("the PPO batch per process", batch_size, sites["rows"] * sites["ranks"] // self.world)
        self.check("the whitening shares in all processes (--ppo.whitening-ranks)", shares * self.world, sites["ranks"])
        self.check("the minibatches per epoch", nminibatches, sites["nminibatches"])
        if orders.shape[2] != sites["noptepochs"]:
            raise SystemExit(f"replay.py: the given orders hold {orders.shape[2]} epochs an update, OpenAI ran "
                             f"{sites['noptepochs']}")  # fmt: skip
        self.check(
            "the given orders' shape (ranks, rows per rank)", orders.shape[1::2], (sites["ranks"], sites["rows"])
        )

    def check_epochs(self, epochs: list[int]) -> None:
        """The PPO epochs that shuffled in each update (`epochs`: a count per rollout) are OpenAI's noptepochs."""
        for update, count in enumerate(epochs):
            self.check(f"the PPO epochs of update {update + 1}", count, self.call_sites["noptepochs"])

    def check_all_taken(self, orders_taken: int, orders: Optional[np.ndarray]) -> None:
        """Every given batch (and every epoch's order) was used: else the script ran on draws of its own."""
        if self.batches or (self.pending is not None and self.pending[1] is not None):
            left = len(self.batches) + (self.pending is not None)
            raise SystemExit(f"replay.py: {left} of the {self.taken + len(self.batches)} given batches were not used")
        if orders is not None and orders_taken != orders.shape[0] * orders.shape[2]:
            raise SystemExit(f"replay.py: {orders_taken} of the {orders.shape[0] * orders.shape[2]} given epoch orders "
                             "were used")  # fmt: skip


REPLAYED_IN = {"train_policy_accelerate": None, "train_reward_accelerate": "normalize_reward"}
"""Where the draws of the stream `main` builds are the given ones: everywhere (the policy's rollout), or only inside
this function of the script (the reward model's normalizations)."""


def install(script, replay: Replay, orders=None) -> list:
    """Replace the script's draws by the replay's: its QueryStream class, sample_responses and (with `orders`, for
    the policy) minibatches. Returns the list that counts the orders taken."""
    original_stream, original_sample = script.QueryStream, script.sample_responses
    window = REPLAYED_IN[script.__name__]
    inside = [window is None]  # whether the script is where the given draws are taken

    class ReplayedQueryStream(original_stream):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.replayed = sys._getframe(1).f_code is script.main.__code__  # the stream `main` builds
            if self.replayed:
                replay.check_stream(self)

        def next_batch(self, n: int, device="cpu") -> tuple[torch.Tensor, dict]:
            if not (self.replayed and inside[0]):
                return super().next_batch(n, device)
            given, rows = replay.queries(n)
            given = script.right_padding_to_left_padding(given, replay.pad_id)
            replay.pending = (self.format(given), replay.pending[1])  # what sample_responses will be handed
            if rows is None and self.texts.carried:
                raise SystemExit(f"replay.py: the script's reward function asks for {self.texts.carried}, which the "
                                 "given batches hold no `rows` for")  # fmt: skip
            return given.to(device), {} if rows is None else self.texts.fields(rows)

    def replayed_sample(lm, contexts, pad_id, response_length, temperature, samples_per_context=1, stop=None):
        given = replay.responses(lm, contexts, pad_id, response_length, temperature, samples_per_context)
        if given is None:
            return original_sample(lm, contexts, pad_id, response_length, temperature, samples_per_context, stop)
        return given

    script.QueryStream, script.sample_responses = ReplayedQueryStream, replayed_sample
    if window is not None:
        original_window = getattr(script, window)

        def replayed_window(*args, **kwargs):
            inside[0] = True
            try:
                return original_window(*args, **kwargs)
            finally:
                inside[0] = False

        setattr(script, window, replayed_window)
    calls, epochs = [], replay.epochs  # every epoch's order taken; the epochs of each update's rollout
    if orders is not None:
        original_minibatches = script.minibatches

        def replayed_minibatches(batch_size: int, shares: int, nminibatches: int, device):
            """The script's own minibatches(), its shares' shuffles (torch.randperm, one per share) drawn as OpenAI's
            ranks drew them: this process's shares are OpenAI's ranks first ... first + G - 1."""
            replay.check_orders(orders, batch_size, shares, nminibatches)
            epochs.extend([0] * (replay.taken - len(epochs)))  # a new update's rollout: its epochs start at 0
            replay.check_epochs(epochs[:-1])  # the updates before this one ran all of OpenAI's epochs
            update, epoch = replay.taken - 1, epochs[-1]
            if epoch >= orders.shape[2]:
                raise SystemExit(f"replay.py: the PPO epochs of update {update + 1} are more than the "
                                 f"{orders.shape[2]} OpenAI ran")  # fmt: skip
            calls.append(1)
            epochs[-1] += 1
            first = replay.rank * shares
            given = iter(orders[update, first : first + shares, epoch])

            def given_permutation(n: int, *, device=None, **kwargs) -> torch.Tensor:
                order = next(given, None)
                if order is None or len(order) != n:
                    raise SystemExit(f"replay.py: minibatches() shuffles {n} rows, not a share of OpenAI's ranks")
                return torch.as_tensor(order, dtype=torch.int64, device=device)

            randperm, torch.randperm = torch.randperm, given_permutation
            try:
                result = original_minibatches(batch_size, shares, nminibatches, device)
            finally:
                torch.randperm = randperm
            if next(given, None) is not None:
                raise SystemExit(f"replay.py: minibatches() shuffled fewer than its {shares} shares")
            return result

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
    if "call_sites" not in data.files:
        raise SystemExit(f"replay.py: {argv[1]} has no call_sites (OpenAI's arguments at the replaced calls): made by "
                         "an older side_by_side.py, make it again")  # fmt: skip
    call_sites = json.loads(str(data["call_sites"]))
    if script_name == "train_reward_accelerate.py":
        import train_reward_accelerate as script

        phases = [(data[f"{phase}_queries"], data[f"{phase}_responses"]) for phase in ("before", "after")]
        batches = [phases[0], phases[0], phases[1], phases[1]]  # each normalization samples twice: set, then check
        orders = rows = None
    elif script_name == "train_policy_accelerate.py":
        import train_policy_accelerate as script

        responses = data["responses"] if "responses" in data.files else [None] * len(data["queries"])
        batches = list(zip(data["queries"], responses, strict=True))
        rows = data["rows"] if "rows" in data.files else None  # the queries' dataset rows: their fields
        orders = data["orders"] if "orders" in data.files else None
        if policy_init is not None:
            start_policy_from(script, policy_init)
    else:
        raise SystemExit(f"replay.py: {script_name}: train_reward_accelerate.py or train_policy_accelerate.py")
    args = run_utils.task_cli(script.task_defaults, flags)
    tokenizer = script.load_tokenizer(args.base_model)
    replay = Replay(batches, tokenizer.pad_token_id, call_sites, rows)
    orders_taken = install(script, replay, orders)
    script.main(args)
    replay.check_all_taken(len(orders_taken), orders)
    if orders is not None:
        replay.check_epochs(replay.epochs + [0] * (replay.taken - len(replay.epochs)))


if __name__ == "__main__":
    main(sys.argv[1:])
