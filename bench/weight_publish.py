"""Weight publish on a GPU through the file snapshot: what a version costs the learner and an engine.

A learner process holds a Qwen2.5-0.5B-shaped model in bf16 on the GPU (random weights, built here); a reader
process on the same GPU holds a model of the same shape, as a rollout engine would. Per version the learner
changes every weight (an optimizer step's worth of writes), writes the snapshot with
``save_weights_atomically`` to /dev/shm (GPU -> host -> safetensors, temp dir + rename), and the reader loads
the file onto the GPU and into its parameters; both are timed.

Every load is checked: the reader's weights must equal the learner's bit for bit (an integer checksum of every
tensor's bits), else the run fails. Reported: per-phase medians over ``--versions`` versions after a warm-up;
end to end = publish + load (each timed where it runs; the message between the processes and the checksum
are not in it, the round trip with both is ``*_round_trip``). (The CUDA IPC path this bench also measured
until #29 went with trainer/ipc.py: nothing in the pipeline used it; weights now travel by broadcast.)
Runs on the GPU machine (``bench/gpu.sh``):

    python3 bench/weight_publish.py [--shape qwen2.5-0.5b] [--versions 10] [--json-out bench/results/weight_publish_gpu.json]
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.learner import SHAPES, shaped_config
from bench.report_json import emit


def shaped_model(shape: str, seed: int) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device("cuda"):
        return Qwen2ForCausalLM(shaped_config(shape, "bfloat16")).to(torch.bfloat16)


def checksum(model: torch.nn.Module) -> int:
    """Exact: the sum of every parameter's bits read as integers (equal weights <=> equal sums, in practice)."""
    total = torch.zeros((), dtype=torch.int64, device="cuda")
    for p in model.parameters():
        total += p.detach().view(-1).view(torch.int16).to(torch.int64).sum()
    return int(total)


def reader_main(conn, shape: str) -> None:
    """The rollout side: load each version it is told of; answers with bytes only."""
    import msgspec
    from safetensors.torch import load_file

    model = shaped_model(shape, seed=1)
    params = dict(model.named_parameters())
    conn.send_bytes(b"ready")
    while True:
        message = msgspec.json.decode(conn.recv_bytes())
        if message["op"] == "stop":
            return
        started = time.perf_counter()
        state = load_file(message["path"] + "/model.safetensors", device="cuda")
        with torch.no_grad():
            names = [n for n in state if n in params]  # a tied head is saved twice, a parameter once
            torch._foreach_copy_([params[n] for n in names], [state[n] for n in names])
        torch.cuda.synchronize()
        version = message["version"]
        seconds = time.perf_counter() - started
        conn.send_bytes(msgspec.json.encode({"version": version, "seconds": seconds, "checksum": checksum(model)}))


def measure(shape: str, versions: int, warmup: int) -> dict:
    import msgspec

    from weights.snapshots import save_weights_atomically

    model = shaped_model(shape, seed=0)
    params = [p for p in model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    conn, child_conn = context.Pipe()
    reader = context.Process(target=reader_main, args=(child_conn, shape), daemon=True)
    reader.start()
    if not conn.poll(600) or conn.recv_bytes() != b"ready":
        raise RuntimeError("the reader process did not start")

    def ask(message: dict) -> dict:
        conn.send_bytes(msgspec.json.encode(message))
        if not conn.poll(120):
            raise TimeoutError(f"no answer from the reader to {message['op']}")
        return msgspec.json.decode(conn.recv_bytes())

    seconds: dict[str, list[float]] = {
        f"{path}_{phase}": [] for path in ("file",) for phase in ("publish", "load", "end_to_end", "round_trip")
    }

    def record(path: str, publish_s: float, answer: dict, round_trip_s: float) -> None:
        seconds[f"{path}_publish"].append(publish_s)
        seconds[f"{path}_load"].append(answer["seconds"])
        seconds[f"{path}_end_to_end"].append(publish_s + answer["seconds"])
        seconds[f"{path}_round_trip"].append(round_trip_s)

    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as shm:
        for version in range(warmup + versions):
            with torch.no_grad():  # every weight changes, as after an optimizer step
                torch._foreach_add_(params, 1e-3)
            torch.cuda.synchronize()
            expected = checksum(model)
            # The file snapshot.
            started = time.perf_counter()  # file_publish: the snapshot written
            directory = save_weights_atomically(model, Path(shm) / f"v{version:06d}")
            saved = time.perf_counter()
            answer = ask({"op": "file", "path": str(directory), "version": version})
            done = time.perf_counter()
            if answer["checksum"] != expected:
                raise AssertionError(f"file version {version}: the reader's checksum {answer['checksum']} != {expected}")
            if version >= warmup:
                record("file", saved - started, answer, done - started)
    conn.send_bytes(msgspec.json.encode({"op": "stop"}))
    reader.join(60)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    return {
        "shape": shape,
        "parameters": sum(p.numel() for p in params),
        "bytes": nbytes,
        "versions": versions,
        "seconds_median": {k: round(v, 5) for k, v in median.items()},
        "seconds_all": {k: [round(x, 5) for x in v] for k, v in seconds.items()},
        "file_end_to_end_gb_per_second": round(nbytes / median["file_end_to_end"] / 1e9, 2),
        "device": torch.cuda.get_device_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": "bash bench/gpu.sh  # on the GPU machine",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json-out", default="bench/results/weight_publish_gpu.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/weight_publish.py needs a CUDA GPU (it measures a GPU learner's snapshot); run it on the GPU machine")
    emit(measure(args.shape, args.versions, args.warmup), args.json_out)


if __name__ == "__main__":
    main()
