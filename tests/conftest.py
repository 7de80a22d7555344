"""Settings for the whole suite.

One intra-op thread per process unless ``OMP_NUM_THREADS`` says otherwise: the tests'
tensors are tiny, where a second thread costs more in synchronisation than it saves, and
the tests that start two processes (DDP, FSDP, launchers) would otherwise run four busy
threads on CI's two cores. The CLI subprocesses the tests start inherit the variable.
Measured on an idle 2-core CPU at commit c90a1df: the default suite took 4 min 49 s with
one thread and 5 min 8 s with two.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after the variable, so that a fresh import reads it)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
