"""Where a results message's rows should stop riding pickled and go as Arrow in shared memory
(``runtime/wire.py``, ``ServerConfig.small_message_bytes``): the real ``Outbox`` in a
spawned process sends retrieval results (3 passages each) and generation steps (one update
per sequence, each with a prompt of token ids) of growing size through a real pipe and ring
(``ServerConfig``'s default slots); this process receives and decodes them
(``wire.read_results``). Each size is timed with both encodings interleaved, best of
``--repeats`` round trips (request -> built, sent, received, decoded); the first size where
Arrow is faster is the crossover.

    python bench/message_threshold.py --out bench/results/message_threshold.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path

PICKLED, ARROW = 1 << 40, 0  # small_message_bytes forcing one encoding
RETRIEVAL = [(1, 200), (8, 650), (32, 650), (32, 2000), (64, 2000), (64, 4000), (128, 4000),
             (128, 8000), (256, 8000), (256, 20000)]  # fmt: skip  # (results, passage chars)
GENERATION = [(8, 0), (64, 0), (64, 100), (64, 400), (128, 400), (256, 400), (256, 1000)]


def _rows(kind: str, n: int, size: int) -> list:
    from ragserve.graph import Passage
    from ragserve.scheduler import GenerationUpdate, RetrievalResult

    if kind == "retrieval":
        base = "lorem ipsum dolor sit amet " * (size // 27 + 1)
        return [RetrievalResult(f"t{i}", tuple(Passage(f"d{i}-{j}", f"{i}.{j} {base}"[:size],
                "Title", 0.5 + j) for j in range(3))) for i in range(n)]  # fmt: skip
    return [GenerationUpdate(f"g{i}", " tok", (1234,), False,
            prompt_token_ids=tuple(range(i, i + size)) if size else None)
            for i in range(n)]  # fmt: skip


def _worker(conn, handle, max_message_bytes: int) -> None:
    from ragserve.runtime.shm import ShmWriter
    from ragserve.runtime.workers import Outbox

    writer = ShmWriter(handle)
    while True:
        job = conn.recv()
        if job is None:
            return
        kind, n, size, small = job
        rows = _rows(kind, n, size)
        conn.recv()  # go
        outbox = Outbox(conn, writer, max_message_bytes, small)
        outbox.send_retrieval(rows) if kind == "retrieval" else outbox.send_generation(rows, None)


def main() -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--slot-bytes", type=int, default=None, help="ring slot size (config's)")
    ap.add_argument("--slots", type=int, default=None, help="ring slots (config's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from ragserve.runtime.config import ServerConfig
    from ragserve.runtime.shm import ShmRing
    from ragserve.runtime.wire import generation_bytes, read_results, retrieval_bytes

    config = ServerConfig()
    ring = ShmRing(args.slots or config.shm_slots, args.slot_bytes or config.shm_slot_bytes)
    ours, theirs = mp.Pipe()
    proc = mp.get_context("spawn").Process(
        target=_worker, args=(theirs, ring.handle(), config.max_message_bytes)
    )
    proc.start()
    rows_out = []
    try:
        for kind, grid in (("retrieval", RETRIEVAL), ("generation", GENERATION)):
            for n, size in grid:
                times = {"pickle": [], "arrow": []}
                for _ in range(args.repeats):
                    for name, small in (("pickle", PICKLED), ("arrow", ARROW)):
                        ours.send((kind, n, size, small))
                        t0 = time.perf_counter()
                        ours.send(b"go")
                        read_results(ours.recv(), ring)
                        times[name].append(time.perf_counter() - t0)
                rows = _rows(kind, n, size)
                est = retrieval_bytes(rows) if kind == "retrieval" else generation_bytes(rows)
                row = {"kind": kind, "n": n, "size": size, "estimated_bytes": est,
                       **{f"{k}_us": 1e6 * min(v) for k, v in times.items()}}  # fmt: skip
                rows_out.append(row)
                ratio = row["arrow_us"] / row["pickle_us"]
                print(f"{kind:10} n={n:4} size={size:6} est {est / 1024:8.1f} KiB  "
                      f"pickle {row['pickle_us']:8.0f} us  arrow {row['arrow_us']:8.0f} us  "
                      f"arrow/pickle {ratio:.2f}", flush=True)  # fmt: skip
    finally:
        ours.send(None)
        proc.join()
        ring.close()
    if args.out:
        meta = {"repeats": args.repeats, "slots": ring.num_slots, "slot_bytes": ring.slot_bytes}
        args.out.write_text(json.dumps({**meta, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
