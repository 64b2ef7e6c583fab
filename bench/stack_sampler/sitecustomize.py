"""A wall-clock stack sampler for every Python process of a bench run (the server, its worker
processes), off unless ``RAGSERVE_STACK_SAMPLE`` names a folder: put this folder first on
``PYTHONPATH`` and each process that starts imports it (``site`` runs ``sitecustomize``).

Every ``RAGSERVE_STACK_INTERVAL_S`` (default 0.01) a daemon thread reads every other thread's
stack (``sys._current_frames``) and counts, per thread name, the innermost frame ("self": where
the thread is, running or blocked in a C call) and each distinct function on the stack
("incl"). Every ``RAGSERVE_STACK_DUMP_S`` (15) s and at exit it writes
``<folder>/<pid>.json`` (a forked child starts its own sampler; a child ended by ``os._exit``
keeps its last periodic dump). A sample is taken only when the sampler thread gets the GIL, so
a process whose threads hold the GIL for long shows fewer samples than wall time / interval
(``samples`` vs ``wall_s`` says by how much).
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import threading
import time

DUMP_S = float(os.environ.get("RAGSERVE_STACK_DUMP_S", "15"))


def _where(code) -> str:
    return f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}"


def _start(folder: str, interval: float) -> None:
    names: dict[int, str] = {}
    self_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    incl_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    state = {"samples": 0, "start": time.monotonic()}
    path = os.path.join(folder, f"{os.getpid()}.json")

    def dump() -> None:
        doc = {
            "pid": os.getpid(),
            "argv": sys.argv[:4],
            "samples": state["samples"],
            "wall_s": round(time.monotonic() - state["start"], 1),
            "interval_s": interval,
            "threads": {
                t: {"samples": sum(c.values()), "self": c.most_common(40),
                    "incl": incl_counts[t].most_common(60)}
                for t, c in self_counts.items()
            },
        }  # fmt: skip
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)

    def loop() -> None:
        own, last = threading.get_ident(), time.monotonic()
        while True:
            time.sleep(interval)
            if len(names) != threading.active_count():
                names.update({t.ident: t.name for t in threading.enumerate()})
            for ident, frame in sys._current_frames().items():
                if ident == own:
                    continue
                name = names.get(ident, str(ident))
                self_counts[name][_where(frame.f_code)] += 1
                seen = set()
                while frame is not None:
                    seen.add(_where(frame.f_code))
                    frame = frame.f_back
                incl_counts[name].update(seen)
            state["samples"] += 1
            if time.monotonic() - last > DUMP_S:
                last = time.monotonic()
                dump()

    threading.Thread(target=loop, name="stack-sampler", daemon=True).start()
    atexit.register(dump)


_FOLDER = os.environ.get("RAGSERVE_STACK_SAMPLE")
if _FOLDER:
    os.makedirs(_FOLDER, exist_ok=True)
    _INTERVAL = float(os.environ.get("RAGSERVE_STACK_INTERVAL_S", "0.01"))
    _start(_FOLDER, _INTERVAL)
    # a forked child (the fork server's workers) has no sampler thread: start its own
    os.register_at_fork(after_in_child=lambda: _start(_FOLDER, _INTERVAL))
