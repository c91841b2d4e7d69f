"""TensorFlow checkpoints <-> .npz files of named arrays, for the bridges of benchmark/openai/bridge.py.

    python -m benchmark.openai.tf.checkpoint write ARRAYS.npz CHECKPOINT_PREFIX  # e.g. DIR/model.ckpt: variables
    python -m benchmark.openai.tf.checkpoint read CHECKPOINT_PREFIX ARRAYS.npz   # every variable (Adam's slots too)

Runs in the TensorFlow venv, from the repository root; the names are OpenAI's (model/h0/attn/c_attn/w, ...), chosen on the PyTorch side.
"""

import sys

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1
v1.disable_v2_behavior()


def write(arrays_path: str, prefix: str) -> None:
    arrays = np.load(arrays_path)
    with tf.Graph().as_default():
        variables = [v1.get_variable(name, initializer=arrays[name]) for name in sorted(arrays.files)]
        with v1.Session() as session:
            session.run(v1.global_variables_initializer())
            v1.train.Saver(variables).save(session, prefix, write_meta_graph=False)


def read(prefix: str, arrays_path: str) -> None:
    reader = v1.train.load_checkpoint(prefix)
    np.savez(arrays_path, **{name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()})


if __name__ == "__main__":
    {"write": write, "read": read}[sys.argv[1]](*sys.argv[2:])
