"""run_utils.py: the run tooling both scripts import. It must hold no algorithm (no model, no backward, no
generation) and import nothing from the scripts or from rlhf_data.py (the data they read, which imports run_utils);
its helpers are tested here on fakes, the scripts' use of them by the end-to-end and resume tests."""

import ast
import json
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import run_utils
import train_policy_accelerate
from tests.conftest import REPO


def policy_args(**fields) -> train_policy_accelerate.Args:
    """The policy's Args with its one required flag given (a reward model directory, never read here)."""
    return train_policy_accelerate.Args(rewards=train_policy_accelerate.RewardHParams(trained_model="rm"), **fields)


def imported_modules(path) -> list[str]:
    tree = ast.parse(path.read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    return imported + [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]


def test_run_utils_holds_no_algorithm_and_imports_no_script():
    tree = ast.parse((REPO / "run_utils.py").read_text())
    imported = imported_modules(REPO / "run_utils.py")
    assert not [name for name in imported if name.startswith(("train_", "quickstart", "rlhf_data"))], imported
    bases = [ast.unparse(base) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for base in node.bases]
    assert not [base for base in bases if "Module" in base or "Optimizer" in base], bases
    calls = [
        node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    ]
    assert "backward" not in calls and "generate" not in calls and "step" not in calls


def test_rlhf_data_prepares_data_without_tensors_and_imports_no_script():
    """rlhf_data.py reads and cleans texts and label files; every tensor operation stays in the scripts."""
    imported = imported_modules(REPO / "rlhf_data.py")
    assert "run_utils" in imported, imported
    assert not [name for name in imported if name.startswith(("train_", "quickstart", "torch"))], imported


class FakeAccelerator:
    """One process: what Run needs of an Accelerator."""

    is_main_process, num_processes, process_index, device = True, 1, 0, torch.device("cpu")
    state = SimpleNamespace(deepspeed_plugin=None)  # no DeepSpeed

    def wait_for_everyone(self):
        pass

    def reduce(self, tensor, reduction):
        return tensor

    def gather(self, tensor):
        return tensor


def test_tracked_resume_continues_the_same_wandb_run(tmp_path, monkeypatch):
    """--track: a fresh run gets a new wandb id (kept in OUTPUT_DIR/wandb_run_id); --resume reuses it, and rows of
    steps the interrupted attempt already sent are not sent again (the resumed run recomputes the same rows)."""
    inits, logged = [], []

    class FakeRun:
        def __init__(self, step):
            self.step = step

        def log(self, row, step):
            logged.append(step)

    def init(**kwargs):
        inits.append(kwargs)
        return FakeRun(step=5 if len(inits) == 3 else 0)  # the server holds steps 0..4 of the resumed run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    for resume in (False, False, True):
        args = policy_args(resume=resume, overwrite=not resume, output_dir=str(tmp_path), track=True,
                                            tensorboard=False, run_name="r")  # fmt: skip
        run = run_utils.Run(args, FakeAccelerator(), "policy", set())
        run.log({"x": 1.0}, step=4)
        run.log({"x": 2.0}, step=5)
        run.file.close()
        run.lock.release()  # each attempt, as the process that ran it would at its end
    first, fresh, resumed = (kwargs["id"] for kwargs in inits)
    assert first != fresh and resumed == fresh == (tmp_path / "wandb_run_id").read_text()  # --overwrite: a new run
    assert all(kwargs["resume"] == "allow" and kwargs["dir"] == tmp_path for kwargs in inits)  # wandb/ in the run
    assert logged == [4, 5, 4, 5, 5]  # the resumed logger skips step 4, which wandb already has


def test_progress_in_a_log_file_prints_plain_lines(monkeypatch, capsys, tmp_path):
    """Under sbatch / nohup stdout is a file, where rich draws its bar only at the end: a plain line after the first
    item, then one per `log_every_s` seconds, and one at the end, each with the count, elapsed time and what is left."""
    run = run_utils.Run.__new__(run_utils.Run)
    run.main = True
    clock = iter([0.0, 10.0, 20.0, 70.0, 80.0, 90.0, 100.0])  # start, then once after each of the 6 items
    monkeypatch.setattr(run_utils.time, "perf_counter", lambda: next(clock))
    assert list(run.progress(range(6), "simulating labels")) == list(range(6))
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "simulating labels: 1/6 (17%), 10 s, ~50 s left",  # 10 s per item so far, 5 items to go
        "simulating labels: 3/6 (50%), 70 s, ~70 s left",  # 60 s after the previous line
        "simulating labels: 6/6 (100%), 100 s, ~0 s left",
    ]
    run.main = False
    assert list(run.progress(range(3), "training reward model")) == [0, 1, 2]
    assert capsys.readouterr().out == ""  # other processes print nothing


def test_tensorboard_gets_the_metrics_and_the_sample_tables(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = policy_args(output_dir=str(tmp_path), run_name="r")
    run = run_utils.Run(args, FakeAccelerator(), "policy", set(), step_name="update")
    for update in (1, 2):
        run.log({"update": update, "objective/scores": 0.5 * update, "ppo/lr": 1e-5}, update)
    run.samples("samples.jsonl", 2, {"query": ["Hello"], "response": [" world."], "score": [0.25]})
    run.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("objective/scores")] == [(1, 0.5), (2, 1.0)]
    assert "update" not in events.Tags()["scalars"]  # the step itself is not a curve
    table = events.Tensors("samples/text_summary")[0]
    assert table.step == 2 and b"| Hello |  world. | 0.250 |" in table.tensor_proto.string_val[0]
    assert json.loads((tmp_path / "samples.jsonl").read_text()) == {"update": 2, "query": "Hello",
                                                                     "response": " world.", "score": 0.25}  # fmt: skip


def test_sample_tables_and_printed_lines_are_text_not_rich_markup(tmp_path, capsys):
    """A generated sample holding "[/...]" once crashed the run (rich read it as a closing tag); "[bold]" vanished."""
    args = policy_args(output_dir=str(tmp_path), run_name="r")
    run = run_utils.Run(args, FakeAccelerator(), "policy", set(), step_name="update")
    run.samples("samples.jsonl", 1, {"query": ["a [/b] c"], "response": ["[bold]d"], "score": [0.5]})
    run.print("eval [/x] and [red]y")
    run.close()
    out = capsys.readouterr().out
    assert "a [/b] c" in out and "[bold]d" in out and "eval [/x] and [red]y" in out


def test_reduce_metrics_means_and_spreads():
    class TwoProcesses(FakeAccelerator):
        def gather(self, tensor):  # process 1 has 3 more of everything
            return torch.cat([tensor, tensor + 3])

    row = run_utils.reduce_metrics(TwoProcesses(), {"a": torch.tensor(1.0), "b": torch.tensor(2.0)}, {"c": 0.5})
    assert row == {"a": 2.5, "b": 3.5, "c": 3.0}


def test_stop_if_not_finite_names_the_metric_the_step_and_the_last_good_checkpoint(tmp_path):
    run = run_utils.Run.__new__(run_utils.Run)
    run.output_dir, run.step_name, run.result = tmp_path, "update", "policy"
    for step in (2, 4):
        (tmp_path / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    (tmp_path / "checkpoints" / ".step-00000006.tmp").mkdir()  # a checkpoint killed mid-write is not "good"
    losses = torch.zeros(4 * 2 * 2)  # (epochs * minibatches * micro-batches)
    loop = {"PPO epoch": 4, "minibatch": 2, "micro-batch": 2}
    assert run_utils.first_non_finite(losses, loop, 0) == ""
    run.stop_if_not_finite({"ppo/loss/total": 0.5}, 7)  # all finite: no error
    losses[2 * 4 + 3] = float("nan")  # epoch 2, minibatch 1, micro-batch 1
    where = run_utils.first_non_finite(losses, loop, 0)
    assert where == ", first in PPO epoch 2, minibatch 1, micro-batch 1 on process 0"
    with pytest.raises(SystemExit) as error:
        run.stop_if_not_finite({"ppo/loss/total": float("nan"), "objective/kl": 1.0}, 7, where)
    message = str(error.value)
    assert len(message.splitlines()) == 1
    assert "ppo/loss/total" in message and "update 7" in message and "objective/kl" not in message
    assert where in message and "policy/ written" in message
    assert message.endswith(f"last good checkpoint: {tmp_path / 'checkpoints' / 'step-00000004'}")


def test_trunk_parameters_count_what_a_token_multiplies_with():
    """For MFU: a 2-layer GPT-2 (d 64) has 12·d² + 13·d parameters per block, d·64 position embeddings and a final
    LayerNorm; the token embedding (tied with the LM head) is a lookup and is not counted."""
    from transformers import GPT2Config, GPT2LMHeadModel

    d = 64
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_layer=2, n_embd=d, n_head=4, n_positions=64))
    assert run_utils.trunk_parameters(lm) == 64 * d + 2 * (12 * d * d + 13 * d) + 2 * d == 104192
    assert run_utils.trunk_parameters(lm.transformer) == 104192  # the reward model's backbone: no LM head at all
    # a forward over 10 tokens, the LM head (2·d·V) on 4 of them
    assert run_utils.forward_flops(lm, 10, 4) == 2 * 104192 * 10 + 2 * d * 1000 * 4


def test_a_run_without_deepspeed_saves_its_model_without_importing_deepspeed(tmp_path):
    """accelerate's unwrap_model, which transformers' save_pretrained calls, imports DeepSpeed when it is installed
    (1.2 s of every start); check_launch of a run without a DeepSpeed engine answers that test: saving then imports
    nothing, and without the check it does (tests/test_deepspeed.py runs the DeepSpeed engine's own unwrapping)."""
    import importlib.util
    import subprocess

    assert importlib.util.find_spec("deepspeed") is not None  # requirements-dev.txt installs it: the case tested
    code = """if True:
        import sys, types
        import run_utils
        from transformers import GPT2Config, GPT2LMHeadModel
        accelerator = types.SimpleNamespace(num_processes=1, state=types.SimpleNamespace(deepspeed_plugin=None))
        if sys.argv[2] == "checked":
            run_utils.check_launch(accelerator, None)
        GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16)).save_pretrained(sys.argv[1])
        print("deepspeed" in sys.modules)"""
    environment = {key: value for key, value in os.environ.items() if key != "WORLD_SIZE"}
    for case, imported in (("checked", "False"), ("unchecked", "True")):
        result = subprocess.run([sys.executable, "-c", code, str(tmp_path / case), case], capture_output=True,
                                text=True, cwd=REPO, env=environment, timeout=120)  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.split()[-1] == imported, (case, result.stdout)
        assert (tmp_path / case / "model.safetensors").is_file()


def test_a_build_lock_a_process_holds_is_waited_for_and_one_no_process_holds_is_named(tmp_path):
    """run_utils.check_build_locks: a DeepSpeed build in progress (its builder holds the lock open, as torch's
    FileBaton does) is left to finish; a lock that no process holds stops the run with one line naming it."""
    lock = tmp_path / "py_cpu" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    held = os.open(lock, os.O_CREAT | os.O_EXCL)
    try:
        run_utils.check_build_locks(tmp_path)  # a live builder: no error
    finally:
        os.close(held)
    with pytest.raises(SystemExit, match=f"a DeepSpeed build lock that no process holds: {lock}"):
        run_utils.check_build_locks(tmp_path)
    run_utils.check_build_locks(tmp_path / "absent")  # no extension folder yet
