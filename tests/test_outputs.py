"""What a user takes away works outside the scripts: the reward model scores texts in the few lines of
docs/outputs-and-metrics.md (and a stock sequence-classification load refuses it instead of scoring with a random
head), the trained model goes to the Hub, the sample tables go to wandb, services are checked before anything is
written, gradient checkpointing changes nothing but memory."""

import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch
import tyro
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import run_utils
import train_policy_accelerate as P
import train_reward_accelerate as R
from tests.conftest import run_script

PAD = 50257


@pytest.fixture(scope="module")
def reward_model_dir(gpt2_tokenizer_dir, tmp_path_factory):
    """A reward_model/ directory as train_reward_accelerate.py writes it, on a tiny random GPT-2."""
    base = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64)).save_pretrained(base)
    tokenizer = R.load_tokenizer(str(gpt2_tokenizer_dir))
    model = R.RewardModel(R.load_pretrained(AutoModel, str(base)), tokenizer.pad_token_id)
    with torch.no_grad():
        model.reward_gain.fill_(1.7)
        model.reward_bias.fill_(-0.4)
    directory = tmp_path_factory.mktemp("rm") / "reward_model"
    directory.mkdir()
    R.save_reward_model(model, directory, tokenizer, str(base), R.TaskHParams())
    return directory, model.eval(), tokenizer


def test_the_readme_snippet_scores_query_response_texts(reward_model_dir):
    directory, model, tokenizer = reward_model_dir
    directory = str(directory)
    # --- docs/outputs-and-metrics.md: score texts with the reward model
    from transformers import AutoTokenizer

    from train_policy_accelerate import load_reward_model  # importing a script runs nothing

    tokenizer = AutoTokenizer.from_pretrained(directory)
    reward_model = load_reward_model(directory).eval()
    queries, responses = ["He opened the letter.", "He opened the door"], [" It was wonderful news.", " and left."]

    def padded(texts):  # token ids, padded with the pad id (anywhere: the reward model moves pads out of the way)
        ids = [torch.tensor(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
        return torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=tokenizer.pad_token_id)

    with torch.no_grad():
        scores = reward_model(padded(queries), padded(responses))  # one normalized reward per (query, response)
    # ---
    with torch.no_grad():  # each pair unpadded, by the trained model
        alone = torch.stack([model(padded([q]), padded([r]))[0] for q, r in zip(queries, responses, strict=True)])
    torch.testing.assert_close(scores, alone, atol=1e-5, rtol=0)
    assert scores[0] != scores[1]


def test_a_stock_sequence_classification_load_refuses_the_reward_model(reward_model_dir):
    """Its head has no bias and no gain: loading it would silently score with a random head; the saved `score.weight`
    has the head's shape plus one (weight and offset), which transformers refuses."""
    directory, model, _ = reward_model_dir
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForSequenceClassification.from_pretrained(directory, num_labels=1)
    from safetensors.torch import load_file

    score = load_file(directory / "model.safetensors")["score.weight"]  # the head's affine map, as one on [h; 1]
    hidden = torch.randn(3, 64)
    with torch.no_grad():
        expected = model.reward_gain * model.scalar_head(hidden).squeeze(-1) + model.reward_bias
    torch.testing.assert_close(torch.cat([hidden, torch.ones(3, 1)], 1) @ score[0], expected, atol=1e-5, rtol=0)


class FakeAccelerator:
    is_main_process, num_processes, process_index, device = True, 1, 0, torch.device("cpu")
    state = SimpleNamespace(deepspeed_plugin=None)  # no DeepSpeed

    def wait_for_everyone(self):
        pass


def test_upload_pushes_the_trained_model_directory(tmp_path, monkeypatch):
    calls = []

    class FakeApi:
        def create_repo(self, repo_id, exist_ok):
            calls.append(("create", repo_id, exist_ok))
            return types.SimpleNamespace(repo_id=f"user/{repo_id}")

        def upload_folder(self, repo_id, folder_path):
            calls.append(("upload", repo_id, sorted(p.name for p in folder_path.iterdir())))

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    args = R.Args(output_dir=str(tmp_path), run_name="rm-run", upload_model=True, tensorboard=False)
    run = run_utils.Run(args, FakeAccelerator(), "reward_model", set())
    run.save_result(lambda directory: (directory / "reward_head.safetensors").write_bytes(b"x"))
    run.close()
    assert calls == [("create", "rm-run", True), ("upload", "user/rm-run", ["reward_head.safetensors"])]


def test_sample_tables_go_to_wandb_as_tables(tmp_path, monkeypatch):
    logged = []

    class FakeRun:
        step = 0

        def log(self, row, step):
            logged.append((step, row))

    table = lambda columns, data: ("table", columns, data)  # noqa: E731
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: FakeRun(), Table=table))
    args = P.Args(output_dir=str(tmp_path), run_name="r", track=True, tensorboard=False,
                  rewards=P.RewardHParams(trained_model="rm"))  # fmt: skip
    run = run_utils.Run(args, FakeAccelerator(), "policy", set(), step_name="update")
    run.samples("samples.jsonl", 3, {"query": ["q"], "response": ["r"], "score": [0.5]})
    assert logged == [(3, {"samples": ("table", ["query", "response", "score"], [["q", "r", 0.5]])})]


def test_track_without_wandb_credentials_fails_before_anything_is_written(tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    result = run_script("train_reward_accelerate.py", "--base-model", str(tiny_assets["model"]), "--label-dataset",
                        str(tiny_assets["small_labels"]), "--task.query-dataset", str(tiny_assets["corpus"]),
                        "--output-dir", str(output_dir), "--track",
                        env={"WANDB_MODE": "", "WANDB_API_KEY": "", "HOME": str(tmp_path), "NETRC": ""})  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --track: no wandb credentials; run `wandb login` (or set WANDB_API_KEY, or WANDB_MODE=offline)"
    )
    assert not output_dir.exists()  # so the corrected command is not refused as an "unfinished run"


def test_upload_model_checks_hub_access_before_training(monkeypatch):
    monkeypatch.setattr(run_utils, "hub_is_reachable", lambda timeout=3.0: False)
    with pytest.raises(SystemExit) as failure:
        run_utils.check_services(R.Args(upload_model=True, tensorboard=False))
    assert str(failure.value) == "error: --upload-model: the Hugging Face Hub is unreachable (or HF_HUB_OFFLINE=1)"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch-size", "0"], "error: --batch-size must be positive, got 0"),
        (["--lr", "-1"], "error: --lr must be positive, got -1.0"),
        (["--labels.num-train", "100", "--batch-size", "16"], "error: --labels.num-train 100 is not a multiple of "
         "--batch-size 16"),
    ],
)  # fmt: skip
def test_sizes_and_rates_are_checked_with_one_line_naming_the_flag(flags, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as failure:
        R.validate_args(tyro.cli(R.Args, args=flags))
    assert str(failure.value) == message


def test_a_dry_run_checks_every_local_input(tiny_assets, tmp_path, capsys):
    common = ["--base-model", str(tiny_assets["model"]), "--task.query-dataset", str(tiny_assets["corpus"]),
              "--dry-run"]  # fmt: skip
    bad_labels = tmp_path / "labels.json"
    bad_labels.write_text(json.dumps([{"query": [1]}]))
    cases = [
        (R, ["--base-model", str(tmp_path / "missing"), "--dry-run"], "no such file or directory"),
        (R, [*common, "--label-dataset", str(bad_labels)], "record 0: 'query' must be a list of 64 token ids"),
        (R, [*common, "--label-dataset", str(tiny_assets["small_labels"])], "fewer than --labels.num-train 4992"),
        (P, [*common, "--rewards.trained-model", str(tmp_path)], "not a reward model directory"),
        (P, [*common, "--rewards.trained-model", str(tmp_path / "missing")], "missing': no such directory"),
    ]
    for module, flags, words in cases:
        with pytest.raises(SystemExit) as failure:
            module.main(tyro.cli(module.Args, args=flags))
        assert words in str(failure.value), (flags, str(failure.value))
    R.main(tyro.cli(R.Args, args=[*common, "--label-dataset", str(tiny_assets["small_labels"]), "--labels.num-train",
                                  "64", "--batch-size", "16"]))  # fmt: skip
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dry_run"] == "ok"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_gradient_checkpointing_gives_the_same_gradients(kind):
    def policy():
        torch.manual_seed(0)
        config = dict(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
        )
        lm = (GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_layer=2, n_head=4, n_embd=64)) if kind == "gpt2"
              else LlamaForCausalLM(LlamaConfig(**config, num_key_value_heads=2)))  # fmt: skip
        wrapper = P.PolicyAndValueWrapper(lm)
        torch.nn.init.normal_(wrapper.value_head.weight)
        return wrapper.train()

    tokens = torch.randint(0, 1000, (3, 12), generator=torch.Generator().manual_seed(1))
    tokens[1, :3] = 1000  # left padding (pad one past the vocabulary)
    gradients, layer_forwards = [], []
    for checkpointing in (False, True):
        model = policy()
        if checkpointing:
            run_utils.enable_gradient_checkpointing(model.lm)
        calls = []  # forwards of the first layer's MLP: once, or again in the backward pass when the layer recomputes
        mlp = (model.lm.transformer.h if kind == "gpt2" else model.lm.model.layers)[0].mlp
        mlp.forward = lambda *inputs, calls=calls, forward=mlp.forward: calls.append(1) or forward(*inputs)
        logits, values = model(tokens, 6, 1000, 0.7)
        (logits.logsumexp(-1).mean() + values.square().mean()).backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        layer_forwards.append(len(calls))
    assert layer_forwards == [1, 2]  # checkpointing is on: the same gradients are not those of an unchanged model
    assert gradients[0].abs().max() > 0
    torch.testing.assert_close(gradients[1], gradients[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "module, flags, message",
    [
        (R, ["--labels.source", "sentiment"], "--labels.source sentiment needs the vaderSentiment package"),
        (R, ["--labels.source", "descriptiveness"], "--labels.source descriptiveness needs the textblob package"),
        (P, ["--rewards.trained-model", "x", "--task.gold-labeler", "sentiment"], "--task.gold-labeler sentiment "
         "needs the vaderSentiment package"),
    ],
)  # fmt: skip
def test_an_option_whose_package_is_missing_says_which_package(module, flags, message, monkeypatch):
    """Optional packages are imported only where their option is used (a GPU node may lack them)."""
    import importlib.util

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("vaderSentiment", "textblob") else object()
    )
    with pytest.raises(SystemExit) as failure:
        module.validate_args(tyro.cli(module.Args, args=flags))
    assert str(failure.value) == f"error: {message}: pip install {message.split()[-2]}"
