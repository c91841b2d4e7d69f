"""What a GPU run meets that a CPU run cannot show, checked on CPU: every tensor the scripts make where the
accelerator's tensors meet it is made on the accelerator's device (on CUDA, torch.cat / stack refuse a CPU tensor
among CUDA ones, also a 0-dim one); no host-to-device copy in the sampling loop or the PPO step; the combinations
of --compile that are untested refused; bf16 on a GPU without bf16 units warned about."""

import ast
import types

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import run_utils
import train_policy_accelerate as P
import train_reward_accelerate as R
from tests.conftest import REPO

FACTORIES = {"tensor", "as_tensor", "from_numpy", "zeros", "ones", "full", "empty", "eye", "arange", "linspace",
             "rand", "randn", "randint", "randperm"}  # fmt: skip
CPU_SIDE = {
    ("train_policy_accelerate.py", "next_batch"): "the queries of a batch, on the CPU until the caller's .to(device)",
    ("train_reward_accelerate.py", "next_batch"): "the same (the shared QueryStream)",
    ("train_policy_accelerate.py", "__init__"): "RewardModel's gain and bias: parameters, moved with the module",
    ("train_reward_accelerate.py", "__init__"): "the same",
    ("train_policy_accelerate.py", "evaluate"): "the gold evaluation's query indices, made into a list for its samples",
    ("train_reward_accelerate.py", "load_labels"): "the label records, on the CPU; each batch goes .to(device)",
    ("train_reward_accelerate.py", "main"): "the training label order: indices into those CPU records",
    ("train_reward_accelerate.py", "held_out_ids"): "the held-out records' indices into them",
}
"""Functions that may make tensors on the default device (the CPU), and why."""


def default_device_factories(path) -> list[tuple[str, int, str]]:
    """(enclosing function, line, call) of every torch factory call without `device=` in a file."""
    found, tree = [], ast.parse(path.read_text())
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and node.func.attr in FACTORIES and "device" not in {k.arg for k in node.keywords}):  # fmt: skip
                found.append((function.name, node.lineno, ast.unparse(node)))
    return found


def test_tensors_are_made_on_the_accelerators_device_or_are_cpu_side_data():
    """A torch factory without device= makes a CPU tensor; where it meets the accelerator's tensors that fails on CUDA
    only (as the reward model's held-out evaluation did: torch.stack of its CUDA sums and a CPU count). Every such
    call in the scripts and run_utils is either given device= or named in CPU_SIDE with its reason."""
    unexpected = []
    for name in ("train_policy_accelerate.py", "train_reward_accelerate.py", "run_utils.py"):
        for function, line, call in default_device_factories(REPO / name):
            if (name, function) not in CPU_SIDE:
                unexpected.append(f"{name}:{line} in {function}: {call}")
    assert not unexpected, "made on the default device, not the accelerator's:\n" + "\n".join(unexpected)


def test_the_reward_models_evaluation_makes_nothing_on_the_default_device():
    """The held-out evaluation run with the default device set to `meta` while the model and the accelerator are on
    the CPU: a tensor made without device= lands on meta, and torch.stack refuses it among the CPU ones (as CUDA
    refuses a CPU tensor among CUDA ones)."""
    torch.manual_seed(0)
    backbone = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_layer=1, n_embd=16, n_head=2, n_positions=64)).transformer
    model = R.BestOfNRewardModel(backbone, pad_id=99).eval()
    labels = {"queries": torch.randint(0, 99, (6, 5)), "samples": torch.randint(0, 99, (6, 4, 3)),
              "best": torch.randint(0, 4, (6,))}  # fmt: skip
    accelerator = types.SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"),
                                        reduce=lambda tensor, reduction: tensor)  # fmt: skip
    args = types.SimpleNamespace(local_eval_batch_size=4)
    with torch.device("meta"):
        metrics = R.evaluate(accelerator, model, labels, torch.arange(6, device="cpu"), args.local_eval_batch_size)
    assert 0 <= metrics["test/accuracy"] <= 1 and metrics["test/loss"] > 0


PER_STEP = {"padded_forward", "vocabulary_logits", "head_product", "sample_responses", "truncate_responses",
            "forward", "normalized_reward", "best_of_4_loss", "value_of", "draw_tokens", "cache_argument",
            "response_logits", "logprobs_from_logits", "compute_rewards", "whiten", "compute_advantages",
            "ppo_losses", "minibatches"}  # fmt: skip
"""The functions every sampling step or PPO / reward-model step runs."""


def test_no_host_to_device_copy_in_a_step():
    """torch.tensor / as_tensor of host data on a GPU is a copy that waits for the GPU to finish what it queued: in
    a function every step calls, once per sampling step (the pad id's mask did it, for models whose pad id is inside
    the vocabulary: SmolLM2, Llama-style tokenizers). None of those functions make a tensor from host data."""
    copies = []
    for name in ("train_policy_accelerate.py", "train_reward_accelerate.py"):
        tree = ast.parse((REPO / name).read_text())
        methods = [node for c in tree.body if isinstance(c, ast.ClassDef) and c.name != "RewardFunction"
                   for node in c.body]  # fmt: skip  # (--rewards.function's scores come from Python, once an update)
        for function in [*tree.body, *methods]:
            if isinstance(function, ast.FunctionDef) and function.name in PER_STEP:
                copies += [f"{name}:{node.lineno} in {function.name}: {ast.unparse(node)}" for node in ast.walk(function)
                           if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                           and node.func.attr in ("tensor", "as_tensor", "new_tensor")]  # fmt: skip
    assert not copies, "\n".join(copies)


def launched(deepspeed_plugin=None) -> types.SimpleNamespace:
    """What check_launch reads of an Accelerator: one process, no mixed precision, the engine's plugin."""
    return types.SimpleNamespace(num_processes=1, mixed_precision="no",
                                 state=types.SimpleNamespace(deepspeed_plugin=deepspeed_plugin))  # fmt: skip


def test_compile_is_refused_where_it_is_untested(monkeypatch):
    """--compile under DeepSpeed (DeepSpeed has its own engine.compile()); an accelerate config with a dynamo backend
    (accelerate would compile the whole prepared model, the rollout's forwards included); --compile with
    --gradient-checkpointing on several processes (DDP's graph splitting for compiled models does not handle
    activation checkpoints: pytorch#104674): each a one-line error before the run starts."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    with pytest.raises(SystemExit, match="the accelerate config sets dynamo_backend INDUCTOR"):
        run_utils.check_launch(launched(), types.SimpleNamespace(compile=False, micro_batch_size=4))
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")  # what `accelerate launch` sets without one
    with pytest.raises(SystemExit, match="--compile under DeepSpeed"):
        run_utils.check_launch(launched(deepspeed_plugin=object()), types.SimpleNamespace(compile=True))
    args = P.task_defaults()
    args.rewards.trained_model, args.compile, args.gradient_checkpointing = "reward_model", True, True
    P.validate_args(args)  # one process: compiled with checkpointing is fine
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="--compile with --gradient-checkpointing on several processes"):
        P.validate_args(args)


@pytest.mark.parametrize(("capability", "warned"), [((7, 0), True), ((8, 0), False)])
def test_bf16_on_a_gpu_without_bf16_units_is_warned(monkeypatch, capsys, capability, warned):
    """accelerate allows bf16 wherever torch can emulate it (V100, T4: compute capability 7.x), where it is slower
    than fp32: a one-line warning at the start."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    accelerator = types.SimpleNamespace(device=torch.device("cuda", 0), mixed_precision="bf16", is_main_process=True,
                                        num_processes=1, state=types.SimpleNamespace(deepspeed_plugin=None))  # fmt: skip
    args = P.validate_args(run_utils.replace_fields(P.task_defaults(), {"rewards.trained_model": "reward_model",
                                                                        "gpu_memory_gb": 80.0}))  # fmt: skip
    run_utils.setup_device(accelerator, args)
    output = capsys.readouterr().err
    expected = "warning: --mixed-precision bf16 on Tesla V100-SXM2-32GB (compute capability 7.0)"
    assert (expected in output) == warned, output
