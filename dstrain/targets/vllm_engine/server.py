"""The vLLM side of target.backend=vllm: serve a frozen target in vLLM and hand back the hidden states the engine
itself computes, prefill only. Runs in the engine's interpreter (its own venv): of dstrain, only its connector imports
dstrain.transport (the client puts the repository on PYTHONPATH).

vLLM runs the target with the `extract_hidden_states` speculative method (a cache-only draft layer stores the
auxiliary hidden states of every prompt token) and this folder's DstrainHiddenStatesConnector, which writes them to
--scratch as safetensors. vLLM's layer id k is the residual stream entering layer k; id num_hidden_layers is the final
pre-norm state.

Protocol (the client is dstrain/targets/vllm.py): one JSON object per line. Lines on stdout that carry the protocol
start with "@dstrain "; everything else there is vLLM's own output. After start-up the server says
{"ready": true, "vllm": VERSION, "architecture": ..., "num_hidden_layers": N, "hidden_size": H, "device": "cpu"},
or {"error": "..."} and exits 2. Each
request {"rows": [[token ids], ...]} is answered with {"files": [path per row]}: complete files (their locks
released), holding "hidden_states" [tokens, layer ids, hidden] and "token_ids"; the client deletes them. With
--mooncake-master, a request {"rows": [...], "keys": [sample key per row]} puts each row's "hidden_states" and
"token_ids" into Mooncake Store as that sample (manifest last) and is answered {"keys": [...]}; the client reads and
removes them (dstrain/transport/mooncake.py).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import sys
import traceback

TAG = "@dstrain "


def say(obj: dict) -> None:
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def wait_written(path: str) -> None:
    """Until the connector has released the file's lock (it holds LOCK_EX from before the request was answered)."""
    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
    os.remove(path + ".lock")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layer-ids", required=True, help="comma-separated vLLM hidden-state ids")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--scratch", required=True)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--mooncake-master", help="hand features over through Mooncake Store (its master's HOST:PORT)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the connector module

    try:
        import vllm
        from vllm import LLM

        ids = [int(x) for x in args.layer_ids.split(",")]
        llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, seed=0, enforce_eager=True,
                  max_model_len=args.max_model_len, max_num_batched_tokens=args.max_model_len,
                  enable_chunked_prefill=False, enable_prefix_caching=False,
                  tensor_parallel_size=args.tensor_parallel_size,
                  speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                      "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}},
                  kv_transfer_config={"kv_connector": "DstrainHiddenStatesConnector",
                                      "kv_connector_module_path": "dstrain_hidden_states_connector",
                                      "kv_role": "kv_producer",
                                      "kv_connector_extra_config": {"shared_storage_path": args.scratch,
                                                                    "allow_custom_save_path": bool(args.mooncake_master),
                                                                    "dstrain_mooncake_master": args.mooncake_master}})
        from vllm.platforms import current_platform

        hf = llm.llm_engine.model_config.hf_config
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        say({"ready": True, "vllm": vllm.__version__, "architecture": (hf.architectures or [None])[0],
             "num_hidden_layers": text.num_hidden_layers, "hidden_size": text.hidden_size,
             "device": current_platform.device_type})
    except Exception as exc:  # the client turns it into one line naming the fix
        traceback.print_exc(file=sys.stderr)
        say({"error": f"{type(exc).__name__}: {exc}"})
        return 2

    # SIGTERM (the kernel's, when the client rank dies: PR_SET_PDEATHSIG) ends the loop like a closed stdin, so the
    # hand-over folder below still goes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return serve(llm, args.scratch)
    finally:  # the client's stdin closed (it finished, or died without closing us): the hand-over folder goes too
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a client's death brings EOF and SIGTERM at once: finish this
        shutil.rmtree(args.scratch, ignore_errors=True)


def serve(llm, scratch: str) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    once = SamplingParams(max_tokens=1, temperature=0.0)
    flush: list[str] = []  # the previous flush request's file: written by this batch's first step
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        rows, keys = request["rows"], request.get("keys")
        # with keys, each row's features go to Mooncake Store as that sample (the connector's mooncake:// paths)
        params = [SamplingParams(max_tokens=1, temperature=0.0,
                                 extra_args={"kv_transfer_params": {"hidden_states_path": "mooncake://" + k}})
                  for k in keys] if keys else once
        outs = llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
        files = [o.kv_transfer_params["hidden_states_path"] for o in outs]
        # the connector writes a request's features when the engine next steps: one more one-token request drives it
        extra = llm.generate([TokensPrompt(prompt_token_ids=rows[0][:1])], once, use_tqdm=False)
        for path in ([] if keys else files) + flush:
            wait_written(path)
        for path in flush:
            os.remove(path)
        flush = [extra[0].kv_transfer_params["hidden_states_path"]]
        say({"keys": keys} if keys else {"files": files})
    return 0


if __name__ == "__main__":
    sys.exit(main())
