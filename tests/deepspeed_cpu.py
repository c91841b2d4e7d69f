"""Run a training script under a DeepSpeed launch on CPU: `accelerate launch --config_file ... tests/deepspeed_cpu.py
SCRIPT FLAGS...` (or `... tests/deepspeed_cpu.py -m MODULE ARGS...`, e.g. benchmark.openai.replay). On a machine
without GPUs accelerate picks no communication backend for DeepSpeed, so every process would run alone as rank 0 of 1
(the scripts refuse that launch). Starting accelerate's process state with gloo first gives the DeepSpeed engine a
real 2-process group; the script then runs as it would on GPUs. A CPU-only launch fix: it stays in the tests.
(The other CPU-only fix, DeepSpeed's shared-memory op not built, is in every process the tests start:
tests/loopback/sitecustomize.py, no_shared_memory_op.)"""

import runpy
import sys

from accelerate import PartialState

if __name__ == "__main__":
    PartialState(backend="gloo")  # (under DeepSpeed it starts DeepSpeed's communication backend)
    if sys.argv[1] == "-m":
        module, sys.argv = sys.argv[2], sys.argv[2:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, sys.argv = sys.argv[1], sys.argv[1:]
        runpy.run_path(script, run_name="__main__")
