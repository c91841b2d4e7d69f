"""OpenAI's own train_reward.train / train_policy.train, instrumented from the outside, in the TensorFlow venv.

    python -m benchmark.openai.tf.run_openai reward CONFIG.json   # a JSON line per step, normalizations, samples
    python -m benchmark.openai.tf.run_openai policy CONFIG.json   # a JSON line of OpenAI's stats per update, rollouts
    python -m benchmark.openai.tf.run_openai forward CONFIG.json  # logits, values, rewards of given tokens

CONFIG: {"hparams": {OpenAI's dotted hparams}, "out": DIR, "inject": rollouts.npz (policy, optional), "policy_init":
DIR (policy, optional: the trained policy's starting checkpoint, the reference's stays task.policy.initial_model)}.
Nothing of OpenAI's algorithm is replaced: the wrappers below record what its functions return (stats, sampled
rollouts, the numpy permutations that order labels and minibatches, the normalization's mean and std) and, with
"inject", hand its trainer given queries and responses instead of sampling them; the log-probs and values of those
then come from OpenAI's own `Policy.analyze_responses` (one forward over query + response). `calls.json` records the
arguments OpenAI's trainers passed where the side by side hands this project's scripts draws instead (the rows a
rank drew, the response length and temperature it sampled with, samples per query, which policy sampled, the pad id,
the run's seed and the texts held out of its query stream, its ranks, minibatches and epochs), so
that benchmark/openai/replay.py can hold the scripts' own arguments there against them. Under `mpiexec -n N`
(OAI_MPI=real) each rank writes its own files, `.rank{r}` before the extension.
"""

import json
import os
import sys
import time

from benchmark.openai.tf import shim  # noqa: F401  (TensorFlow 1 on 2, local files; before the imports below)

# isort: split
import numpy as np
import tensorflow as tf  # tf.compat.v1, through the shim
from lm_human_preferences import label_types, train_policy, train_reward
from lm_human_preferences.utils import core
from mpi4py import MPI

RANK, RANKS = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
PERMUTATIONS = []  # every np.random.permutation OpenAI draws (label order; each PPO epoch's minibatch order)
_permutation = np.random.permutation


def recorded_permutation(n):
    order = _permutation(n)
    PERMUTATIONS.append(order.copy())
    return order


np.random.permutation = recorded_permutation
CALLS = []  # each sampling call of OpenAI's trainer: rows, response length, temperature, samples per query (calls.json)


def record_call(rows, length, temperature, responses_rows, scope: str) -> None:
    """One sampling call: the rows, response length, temperature, samples per query, and which policy sampled (its
    variable scope: `policy` is the one train_policy's PPO trains, `ref_policy` the frozen initial model, the one
    train_reward samples its normalizations with)."""
    CALLS.append(dict(rows=int(rows), response_length=int(length), temperature=float(temperature),
                      samples_per_query=int(responses_rows) // int(rows), sampler=scope))  # fmt: skip


def write_calls(config: dict, hparams, **settings) -> None:
    """calls.json: OpenAI's sampling calls and the settings its loops ran with, on this rank: the pad id its queries
    carry (the encoding's padding_token), the seed of the run (run.seed) and the query texts its sampler skips (none:
    OpenAI's query sampler holds none out)."""
    from lm_human_preferences.language import encodings

    stream = dict(seed=int(hparams.run.seed), excluded=0)
    with open(path(config, "calls.json"), "w") as file:
        json.dump(dict(rank=RANK, ranks=RANKS, sampling=CALLS, pad_id=int(encodings.Main.get_encoder().padding_token),
                       query_stream=stream, **settings), file)  # fmt: skip


def path(config: dict, name: str) -> str:
    """A file of the run's output directory, per rank when there are several."""
    stem, ext = os.path.splitext(name)
    return os.path.join(config["out"], f"{stem}.rank{RANK}{ext}" if RANKS > 1 else name)


def write_jsonl(config: dict, name: str, rows: list[dict]) -> None:
    with open(path(config, name), "w") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)


def hparams_of(module, config: dict):
    hparams = module.HParams()
    hparams.override_from_dict(config["hparams"])
    hparams.validate()
    return hparams


def reward(config: dict) -> None:
    """train_reward.train, recording each step's loss (and accuracy, from the same 4 rewards) and the normalizations."""
    steps, normalizations, samples = [], [], []
    record_stats = core.record_stats

    def recording_stats(*, stats, summary_writer, step, log_interval, name=None, comm=None):
        keys = sorted(stats)

        def log(step_value, *values):
            steps.append({"step": int(step_value) + 1, **{k: float(v) for k, v in zip(keys, values, strict=True)}})

        logged = tf.py_func(log, [step] + [stats[k] for k in keys], [])
        return tf.group(logged, record_stats(stats=stats, summary_writer=summary_writer, step=step,
                                             log_interval=log_interval, name=name, comm=comm))  # fmt: skip

    core.record_stats = recording_stats
    loss = label_types.PickBest.loss

    def loss_with_accuracy(self, reward_model, labels):
        rewards = []

        def recording_model(queries, responses):
            rewards.append(reward_model(queries, responses))
            return rewards[-1]

        stats = loss(self, recording_model, labels)
        picked = tf.argmax(tf.stack(rewards, axis=1), axis=1, output_type=tf.int32)
        stats["accuracy"] = tf.reduce_mean(tf.cast(tf.equal(picked, labels["best"]), tf.float32))
        return stats

    label_types.PickBest.loss = loss_with_accuracy
    from lm_human_preferences.policy import Policy

    respond_op = Policy.respond_op

    sampler = {}  # the response length and temperature the normalizations' sampling op was built with

    def recording_respond_op(self, queries, length):  # built once, run for every batch the normalizations sample
        sampler.update(length=length, temperature=self.temperature, scope=self.scope.name)
        return respond_op(self, queries, length)

    Policy.respond_op = recording_respond_op
    init = train_reward.RewardModelTrainer.__init__

    def instrumented_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        sample, set_norms = self.sample_policy_responses, self.set_reward_norms

        def recording_sample(n_samples):
            batches = sample(n_samples)
            samples.append(batches)
            for queries, responses in batches:
                record_call(len(queries), sampler["length"], sampler["temperature"], len(responses), sampler["scope"])
            return batches

        def recording_set_norms(mean, std, new_mean, new_std):
            set_norms(mean, std, new_mean, new_std)
            model = self.reward_model
            gain, bias = tf.get_default_session().run((model.reward_gain, model.reward_bias))
            normalizations.append(dict(mean=float(mean), std=float(std), gain=float(gain), bias=float(bias)))

        self.sample_policy_responses, self.set_reward_norms = recording_sample, recording_set_norms

    train_reward.RewardModelTrainer.__init__ = instrumented_init
    start, hparams = time.time(), hparams_of(train_reward, config)
    train_reward.train(hparams)
    write_jsonl(config, "reward_steps.jsonl", steps)
    with open(path(config, "reward.json"), "w") as file:
        json.dump(dict(normalizations=dict(zip(("before", "after"), normalizations, strict=True)),
                       label_order=PERMUTATIONS[0].tolist(), seconds=time.time() - start), file)  # fmt: skip
    arrays = {}
    for phase, batches in zip(("before", "after"), samples, strict=True):
        arrays[f"{phase}_queries"] = np.concatenate([queries for queries, _ in batches])
        arrays[f"{phase}_responses"] = np.concatenate([responses for _, responses in batches])
    np.savez(path(config, "normalization_samples.npz"), **arrays)
    write_calls(config, hparams)


def policy(config: dict) -> None:
    """train_policy.train, one line of OpenAI's stats per update; each update's rollout and minibatch orders."""
    rows, rollouts = [], []
    given = np.load(config["inject"]) if config.get("inject") else None
    init, step = train_policy.PPOTrainer.__init__, train_policy.PPOTrainer.step

    def instrumented_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        record, compute_rewards, sample_queries = self.record_step_stats, self.compute_rewards, self.sample_queries

        def recording_record(**data):
            op, stats = record(**data)
            self.harness_stats = {key: float(value) for key, value in stats.items()}
            return op, stats

        def recording_rewards(scores, logprobs, ref_logprobs):
            rewards, non_score_reward, kl_coef = compute_rewards(scores, logprobs, ref_logprobs)
            rollouts[-1].update(scores=scores, logprobs=logprobs, ref_logprobs=ref_logprobs, rewards=rewards)
            return rewards, non_score_reward, kl_coef

        def next_queries():
            update = len(rollouts)
            queries = sample_queries() if given is None else rows_of(given["queries"][update])
            rollouts.append(dict(queries=queries))
            return queries

        self.record_step_stats, self.compute_rewards, self.sample_queries = (
            recording_record,
            recording_rewards,
            next_queries,
        )
        respond = self.policy.respond

        def recording_respond(queries, length):
            if given is None:
                result = respond(queries, length)
            else:  # the given responses; their log-probs and values from OpenAI's own forward
                responses = rows_of(given["responses"][len(rollouts) - 1])
                result = dict(responses=responses, **self.policy.analyze_responses(queries, responses))
                result.pop("entropies")
            rollouts[-1].update(responses=result["responses"], values=result["values"])
            record_call(len(queries), length, self.policy.temperature, len(result["responses"]), self.policy.scope.name)
            return result

        self.policy.respond = recording_respond

    def timed_step(self):
        first = len(PERMUTATIONS)
        start = time.time()
        step(self)
        seconds = time.time() - start
        rollouts[-1]["orders"] = np.stack(PERMUTATIONS[first:])
        rows.append({"update": len(rows) + 1, **self.harness_stats, "harness/seconds": seconds})
        write_jsonl(config, "policy_stats.jsonl", rows)  # every update, so that a stopped run keeps what it did

    train_policy.PPOTrainer.__init__, train_policy.PPOTrainer.step = instrumented_init, timed_step
    if config.get("policy_init"):
        start_trained_policy_from(config["policy_init"])
    hparams = hparams_of(train_policy, config)
    train_policy.train(hparams)
    write_calls(config, hparams, nminibatches=hparams.ppo.nminibatches, noptepochs=hparams.ppo.noptepochs)
    if config.get("dump_rollouts", True):
        np.savez(path(config, "rollouts.npz"), **{key: np.stack([r[key] for r in rollouts]) for key in rollouts[0]})


def start_trained_policy_from(checkpoint_dir: str) -> None:
    """A warm start: the trained policy (scope `policy`) initialized from another checkpoint than the reference policy
    (scope `ref_policy`, still task.policy.initial_model), value head included: the same Policy._set_initializers,
    handed another TrainedModel (a directory with hparams.json and a checkpoint) for that one scope."""
    from lm_human_preferences.language.trained_models import TrainedModel
    from lm_human_preferences.policy import Policy

    set_initializers = Policy._set_initializers

    def warm_initializers(self):
        if self.scope.name != "policy":
            return set_initializers(self)
        initial, self.trained_model = self.trained_model, TrainedModel(checkpoint_dir, savedir=checkpoint_dir)
        try:
            set_initializers(self)
        finally:
            self.trained_model = initial

    Policy._set_initializers = warm_initializers


def rows_of(batch: np.ndarray) -> np.ndarray:
    """This rank's share of a global batch: rows r * B / N ... (r + 1) * B / N, as this project's process r."""
    share = len(batch) // RANKS
    return batch[RANK * share : (RANK + 1) * share]


def forward(config: dict) -> None:
    """OpenAI's Policy.analyze_responses (log-probs, values) and TrainedRewardModel.score_fn on given tokens."""
    from lm_human_preferences.language import trained_models
    from lm_human_preferences.policy import Policy
    from lm_human_preferences.rewards import TrainedRewardModel

    tokens = np.load(config["tokens"])
    hparams = hparams_of(train_policy, config)
    with tf.Graph().as_default():
        model = trained_models.TrainedModel(hparams.task.policy.initial_model)
        policy = Policy(model, scope="policy", temperature=hparams.task.policy.temperature)
        reward_model = TrainedRewardModel(hparams.rewards.trained_model, model.encoding)
        queries, responses = tf.constant(tokens["queries"]), tf.constant(tokens["responses"])
        analysis = policy.analyze_responses_op(queries, responses)
        scores = reward_model.score_fn(queries, responses)
        with tf.Session() as session:
            session.run(tf.global_variables_initializer())
            outputs = session.run(dict(scores=scores, **analysis))
    np.savez(path(config, "forward.npz"), **outputs)


if __name__ == "__main__":
    command, config_path = sys.argv[1:]
    with open(config_path) as file:
        configuration = json.load(file)
    os.makedirs(configuration["out"], exist_ok=True)
    {"reward": reward, "policy": policy, "forward": forward}[command](configuration)
