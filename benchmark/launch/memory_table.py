"""The README's memory table: the estimated peak GPU memory per process (memory_estimate.estimate_peak_memory, the formulas
of docs/memory.md) of train_policy_accelerate.py at OpenAI's defaults (a batch of 512 episodes, 64 + 24 tokens, no
gradient accumulation: micro-batches of 512 / processes) for GPT-2's four sizes, on 1 and 8 GPUs, in fp32 and bf16,
and under ZeRO-2. An estimate, not a measurement: no GPU has run this project yet (benchmark/launch/gpu/check.sh records
torch.cuda.max_memory_allocated next to the estimate, to check it).

    python -m benchmark.launch.memory_table            # the README's markdown table
    python -m benchmark.launch.memory_table gpt2-xl    # docs/memory.md's: gpt2-xl's options, part by part
"""

import sys

import memory_estimate
import run_utils
import train_policy_accelerate

COLUMNS = {  # header: (processes, ZeRO stage, --mixed-precision)
    "1 GPU fp32": (1, 0, "no"),
    "1 GPU bf16": (1, 0, "bf16"),
    "8 GPUs fp32": (8, 0, "no"),
    "8 GPUs bf16": (8, 0, "bf16"),
    "8 GPUs ZeRO-2 fp32": (8, 2, "no"),
}
GPU_GB = 80  # the cells above MEMORY_HEADROOM of it are marked
GPT2_XL_CASES = {  # setup: (processes, ZeRO stage, flags)
    "1 GPU, the defaults (micro-batch 512)": (1, 0, {}),
    "1 GPU, --ppo.gradient-accumulation-steps 8": (1, 0, {"ppo.gradient_accumulation_steps": 8}),
    "1 GPU, --ppo.gradient-accumulation-steps 16": (1, 0, {"ppo.gradient_accumulation_steps": 16}),
    "1 GPU, --mixed-precision bf16, accumulation 8": (1, 0, {"mixed_precision": "bf16",
                                                              "ppo.gradient_accumulation_steps": 8}),
    "1 GPU, --gradient-checkpointing, accumulation 4": (1, 0, {"gradient_checkpointing": True,
                                                                "ppo.gradient_accumulation_steps": 4}),
    "8 GPUs, DDP (micro-batch 64)": (8, 0, {}),
    "8 GPUs, ZeRO-2 (benchmark/launch/large_models.sh)": (8, 2, {}),
}  # fmt: skip


def memory_table() -> str:
    lines = ["| model | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for model in memory_estimate.GPT2_SIZES:
        cells = [f"{model} ({memory_estimate.model_shape(model).lm_parameters / 1e6:,.0f}M)"]
        for processes, zero_stage, precision in COLUMNS.values():
            args = run_utils.replace_fields(train_policy_accelerate.task_defaults(), {"base_model": model,
                                                                                      "mixed_precision": precision})  # fmt: skip
            total = memory_estimate.estimate_peak_memory(args, processes, zero_stage)["total"]
            cells.append(f"{total:.0f}" + (" ✗" if total > run_utils.MEMORY_HEADROOM * GPU_GB else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gpt2_xl_table() -> str:
    """gpt2-xl's options, the parts grouped: what lives the whole run, the training peak, the rollout's."""
    lines = ["| setup | weights, gradients, Adam, frozen models | activations | logits | rollout | total |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for setup, (processes, zero_stage, flags) in GPT2_XL_CASES.items():
        args = run_utils.replace_fields(train_policy_accelerate.task_defaults(), {"base_model": "gpt2-xl", **flags})
        shape = memory_estimate.model_shape("gpt2-xl")
        parts = memory_estimate.peak_memory_parts(args, shape, shape, processes, zero_stage)
        static, _, _ = memory_estimate.peak_memory_phases(parts)
        cells = [
            static,
            parts["activations"],
            parts["logits"],
            parts["rollout"],
            memory_estimate.peak_memory_total(parts),
        ]
        lines.append(f"| {setup} | " + " | ".join(f"{value / memory_estimate.GB:.1f}" for value in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(gpt2_xl_table() if sys.argv[1:] == ["gpt2-xl"] else memory_table())
