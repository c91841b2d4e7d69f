"""This project's models in OpenAI's checkpoint names and back, for the side-by-side (benchmark/openai/side_by_side.py).

OpenAI's lm-human-preferences loads GPT-2 from a directory with `hparams.json` and a TensorFlow checkpoint whose
variables are named as in GPT-2's release (language/model.py): a Hugging Face GPT-2 maps one to one, the Conv1D
weights [nx, nf] become [1, nx, nf]. Scalar heads sit at `model/heads/{value,reward}/{w,b}`; a trained reward model
(rewards.py TrainedRewardModel) is the same under `reward_model/`, plus `reward_model/reward_norm/{gain,bias}`.
These functions produce and read the arrays; benchmark/openai/tf/checkpoint.py turns them into a checkpoint in the
TensorFlow venv. The label files need no bridge: this project writes OpenAI's schema, pad id 50259 included.
"""

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

# Hugging Face GPT-2 name (after `transformer.`) -> OpenAI's, and whether the weight gains OpenAI's leading axis of 1
LAYER_NAMES = {
    "ln_1.weight": ("ln_1/g", False), "ln_1.bias": ("ln_1/b", False),
    "attn.c_attn.weight": ("attn/c_attn/w", True), "attn.c_attn.bias": ("attn/c_attn/b", False),
    "attn.c_proj.weight": ("attn/c_proj/w", True), "attn.c_proj.bias": ("attn/c_proj/b", False),
    "ln_2.weight": ("ln_2/g", False), "ln_2.bias": ("ln_2/b", False),
    "mlp.c_fc.weight": ("mlp/c_fc/w", True), "mlp.c_fc.bias": ("mlp/c_fc/b", False),
    "mlp.c_proj.weight": ("mlp/c_proj/w", True), "mlp.c_proj.bias": ("mlp/c_proj/b", False),
}  # fmt: skip
TOP_NAMES = {"wte.weight": "wte", "wpe.weight": "wpe", "ln_f.weight": "ln_f/g", "ln_f.bias": "ln_f/b"}


def openai_names(n_layer: int) -> dict[str, tuple[str, bool]]:
    """Every trunk parameter of a Hugging Face GPT2Model (names without `transformer.`) -> (OpenAI's name under
    `model/`, whether OpenAI's array has a leading axis of 1)."""
    names = {hf: (ours, False) for hf, ours in TOP_NAMES.items()}
    for i in range(n_layer):
        names.update({f"h.{i}.{hf}": (f"h{i}/{ours}", conv) for hf, (ours, conv) in LAYER_NAMES.items()})
    return names


def trunk_to_openai(trunk: dict[str, torch.Tensor], n_layer: int, scope: str = "model") -> dict[str, np.ndarray]:
    """A GPT2Model state dict (no `transformer.` prefix) as OpenAI's arrays under `scope`."""
    arrays = {}
    for hf, (name, conv) in openai_names(n_layer).items():
        array = trunk[hf].detach().float().cpu().numpy()
        arrays[f"{scope}/{name}"] = array[None] if conv else array
    return arrays


def trunk_from_openai(arrays: dict[str, np.ndarray], n_layer: int, scope: str = "model") -> dict[str, torch.Tensor]:
    """OpenAI's arrays under `scope` as a GPT2Model state dict (no `transformer.` prefix)."""
    trunk = {}
    for hf, (name, conv) in openai_names(n_layer).items():
        array = np.asarray(arrays[f"{scope}/{name}"], dtype=np.float32)
        trunk[hf] = torch.from_numpy(array[0] if conv else array).clone()
    return trunk


def head_to_openai(weight: torch.Tensor, bias: torch.Tensor, prefix: str) -> dict[str, np.ndarray]:
    """An nn.Linear(d, 1) as OpenAI's scalar head (language/model.py fc_layer): w (d,), b ()."""
    return {f"{prefix}/w": weight.detach().float().reshape(-1).numpy(), f"{prefix}/b": np.float32(bias.item())}


def model_hparams(config) -> dict:
    """OpenAI's hparams.json of a GPT-2 config (language/model.py HParams; dropout 0, as OpenAI trains)."""
    return dict(n_vocab=config.vocab_size, n_ctx=config.n_positions, n_embd=config.n_embd, n_head=config.n_head,
                n_layer=config.n_layer, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0, head_pdrop=0.0)  # fmt: skip


def lm_arrays(lm_dir: Path) -> tuple[dict, dict]:
    """(hparams, arrays) of a Hugging Face GPT-2 directory as OpenAI's model (task.policy.initial_model): the trunk
    under `model/`; scalar heads are added with head_to_openai."""
    lm = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    trunk = {k.removeprefix("transformer."): v for k, v in lm.state_dict().items() if k.startswith("transformer.")}
    return model_hparams(lm.config), trunk_to_openai(trunk, lm.config.n_layer)


def reward_model_arrays(reward_dir: Path) -> tuple[dict, dict]:
    """(hparams, arrays) of a reward_model/ directory of train_reward_accelerate.py as OpenAI's trained reward model
    (train_dir/hparams.json, train_dir/checkpoints/): trunk, head, gain and bias under `reward_model/`."""
    config = json.loads(Path(reward_dir, "config.json").read_text())
    state = load_file(Path(reward_dir, "model.safetensors"))
    head = load_file(Path(reward_dir, "reward_head.safetensors"))
    arrays = trunk_to_openai({k: v for k, v in state.items() if k != "score.weight"}, config["n_layer"],
                             "reward_model/model")  # fmt: skip
    arrays.update(
        head_to_openai(head["scalar_head.weight"], head["scalar_head.bias"], "reward_model/model/heads/reward")
    )
    arrays["reward_model/reward_norm/gain"] = np.float32(head["reward_gain"].item())
    arrays["reward_model/reward_norm/bias"] = np.float32(head["reward_bias"].item())
    hparams = dict(n_vocab=config["vocab_size"], n_ctx=config["n_positions"], n_embd=config["n_embd"],
                   n_head=config["n_head"], n_layer=config["n_layer"])  # fmt: skip
    return hparams, arrays


def reward_model_from_openai(arrays: dict[str, np.ndarray], like_dir: Path, out_dir: Path) -> Path:
    """OpenAI's trained reward model (its checkpoint's arrays) as a reward_model/ directory of this project, with
    the tokenizer, config and reward_model.json of `like_dir` (a reward_model/ directory of the same shape)."""
    like_dir, out_dir = Path(like_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads(Path(like_dir, "config.json").read_text())
    trunk = trunk_from_openai(arrays, config["n_layer"], "reward_model/model")
    gain, bias = (float(arrays[f"reward_model/reward_norm/{k}"]) for k in ("gain", "bias"))
    head = {
        "scalar_head.weight": torch.from_numpy(np.asarray(arrays["reward_model/model/heads/reward/w"])).reshape(1, -1),
        "scalar_head.bias": torch.tensor([float(arrays["reward_model/model/heads/reward/b"])]),
        "reward_gain": torch.tensor(gain),
        "reward_bias": torch.tensor(bias),
    }
    score = torch.cat([gain * head["scalar_head.weight"], (gain * head["scalar_head.bias"] + bias).reshape(1, 1)], 1)
    save_file({**trunk, "score.weight": score}, out_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(head, out_dir / "reward_head.safetensors")
    for name in like_dir.iterdir():
        if name.name not in ("model.safetensors", "reward_head.safetensors"):
            (out_dir / name.name).write_bytes(name.read_bytes())
    return out_dir
