"""Run OpenAI's lm-human-preferences (TF 1.13, Python 3.7, MPI) unmodified on TensorFlow 2.21 / Python 3.11.

Imported before any `lm_human_preferences` module by the other files of this folder, inside the TensorFlow venv that
benchmark/openai/side_by_side.py builds. Not one line of OpenAI's code is changed: `import tensorflow` yields
`tf.compat.v1` in graph mode, `tf.contrib` is rebuilt from modules TF 2.21 still ships, mpi4py is a one-process
stand-in unless OAI_MPI=real (then the installed mpi4py under `mpiexec -n N`), the Google Cloud imports are inert,
and the paths OpenAI downloaded from (GPT-2's encoding, the query dataset) point at local files.

Environment: OAI_SRC (a checkout of openai/lm-human-preferences), OAI_TOKENIZER (a directory with GPT-2's
vocab.json and merges.txt, which are OpenAI's encoder.json and vocab.bpe), OAI_QUERIES (a text file, one query text
per line: the dataset `side_by_side`).
"""

import collections
import collections.abc
import os
import random
import sys
import types

collections.Mapping = collections.abc.Mapping  # removed in Python 3.10; utils/core.py flatten_dict uses it

import tensorflow as _tf2  # noqa: E402
from tensorflow.python.ops import summary_ops_v2  # noqa: E402  (the old tf.contrib.summary)
from tensorflow.python.util import nest  # noqa: E402  (tf.contrib.framework.nest)

tf = _tf2.compat.v1
tf.disable_v2_behavior()  # graph mode, reference variables, v1 shapes (.value) and control flow
contrib = types.ModuleType("tensorflow.contrib")
contrib.__path__ = []  # a package, so that `from tensorflow.contrib import summary` resolves
contrib.summary = summary_ops_v2
contrib.framework = types.SimpleNamespace(nest=nest, is_tensor=_tf2.is_tensor)
contrib.layers = types.SimpleNamespace(l2_regularizer=lambda scale: lambda w: scale * tf.nn.l2_loss(w))
contrib.training = types.SimpleNamespace(HParams=lambda **kw: types.SimpleNamespace(**kw))  # test_sample.py only
tf.contrib = contrib
sys.modules.update({"tensorflow": tf, "tensorflow.contrib": contrib, "tensorflow.contrib.training": contrib.training})


class OneProcessComm:
    """mpi4py's COMM_WORLD for one process: every collective is the identity."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Dup(self):
        return self

    def bcast(self, x, root=0):
        return x

    def allgather(self, x):
        return [x]

    def allreduce(self, x, op=None):
        return x

    def Allreduce(self, send, receive, op=None):
        receive[...] = send


if os.environ.get("OAI_MPI") != "real":
    _mpi = types.SimpleNamespace(COMM_WORLD=OneProcessComm(), SUM="sum")
    sys.modules.update({"mpi4py": types.SimpleNamespace(MPI=_mpi), "mpi4py.MPI": _mpi})

# utils/gcs.py imports google-cloud-storage; with local paths nothing of it is reached
for _name in ("google", "google.cloud", "google.api_core", "google.cloud.storage"):
    sys.modules.setdefault(_name, types.ModuleType(_name))
_exceptions = types.ModuleType("google.api_core.exceptions")
_exceptions.InternalServerError = _exceptions.ServiceUnavailable = type("NoCloud", (Exception,), {})
sys.modules["google.api_core.exceptions"] = _exceptions
sys.modules["google.cloud"].storage = sys.modules["google.cloud.storage"]

sys.path.insert(0, os.environ["OAI_SRC"])  # the checkout: never `pip install lm-human-preferences` (a PyPI dummy)

from lm_human_preferences.language import datasets, encodings  # noqa: E402
from lm_human_preferences.utils import gcs  # noqa: E402


def local_file(url, comm=None):
    """gcs.download_file_cached for local paths only (labels and checkpoints are given as files here)."""
    if not os.path.exists(url):
        raise FileNotFoundError(f"not a local file: {url} (this harness runs offline)")
    return url


gcs.download_file_cached = local_file
# GPT-2's encoding from local files (attributes of OpenAI's Encoding, not code)
encodings.Main.encoder_path = os.path.join(os.environ["OAI_TOKENIZER"], "vocab.json")
encodings.Main.bpe_path = os.path.join(os.environ["OAI_TOKENIZER"], "merges.txt")


def side_by_side_texts(mode, seed=0, shuffle=False, comm=None):
    """The query texts, registered in OpenAI's own dataset registry, shuffled as its books generator shuffles. OpenAI
    asks for seed 0 whatever run.seed is (lm_tasks.py make_query_sampler), so every seed would see the same queries:
    OAI_QUERY_SEED, when set, is added to it (the free-running seeds, so that their query orders differ as ours do)."""
    with open(os.environ["OAI_QUERIES"]) as file:
        texts = [line.strip() for line in file if line.strip()]
    if shuffle:
        random.seed(seed + int(os.environ.get("OAI_QUERY_SEED", "0")))
        random.shuffle(texts)
    yield from texts


datasets.Dataset("side_by_side", generator=side_by_side_texts)
