"""Imported once by the workers' fork server (``worker_start.py``): the libraries every
worker needs, so that a worker forked from it starts without importing them again."""

import os
import signal

# NOTE: the workers' tracker: were it to die of a SIGTERM sent to the whole group (systemd's
# stop), the server would read every worker as dead (exit code 255) while it drains. The
# stdlib ignores SIGINT here already; it exits when the server does (its alive pipe closes).
signal.signal(signal.SIGTERM, signal.SIG_IGN)

# NOTE: OpenMP reads its wait policy when the library loads, here; the workers share the CPU
# cores with the server, where spin-waiting makes small matmuls ~30x slower (workers.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faiss  # noqa: E402, F401
import torch  # noqa: E402, F401
from transformers import AutoModel, AutoTokenizer  # noqa: E402, F401

import ragserve.generation.llm_engine  # noqa: E402, F401
import ragserve.retrieval.embedder  # noqa: E402, F401
import ragserve.runtime.staged_retrieval  # noqa: E402, F401
import ragserve.runtime.workers  # noqa: E402, F401
