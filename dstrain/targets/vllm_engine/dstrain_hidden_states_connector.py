"""vLLM's ExampleHiddenStatesConnector without CUDA: it copies a finished request's hidden states out of the
cache-only layer and writes them synchronously (the example's writer records torch.cuda events on a copy stream and
pins host memory, which a CPU build of torch refuses, so its files never appear). Loaded by vLLM through
kv_connector_module_path; runs in the engine's interpreter.

A request whose hidden_states_path is mooncake://KEY goes to Mooncake Store as the sample KEY (its parts, then its
manifest: dstrain/transport, importable here because the server's client puts the repository on PYTHONPATH; the
store's master is kv_connector_extra_config's dstrain_mooncake_master). Any other path is a safetensors file,
complete when its .lock is released, as in the example (the one-host fallback).

The write happens when the engine next steps after the request finished (the scheduler hands the save to the worker
in the following step's metadata): server.py drives one more step per batch.
"""

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as example

MOONCAKE = "mooncake://"


class DstrainHiddenStatesConnector(example.ExampleHiddenStatesConnector):
    _store = None

    def _mooncake(self):
        if self._store is None:
            from dstrain.transport.mooncake import SampleStore

            master = self._kv_transfer_config.get_from_extra_config("dstrain_mooncake_master", None)
            self._store = SampleStore(master, segment_mib=int(os.environ.get("DSTRAIN_MOONCAKE_SEGMENT_MIB", "512")),
                                      buffer_mib=int(os.environ.get("DSTRAIN_MOONCAKE_BUFFER_MIB", "256")))
        return self._store

    def wait_for_save(self) -> None:
        """Lock files for file paths only: a Mooncake sample is complete when its manifest is there."""
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, example.ExampleHiddenStatesConnectorMetadata):
                meta.new_req_filenames = {r: f for r, f in meta.new_req_filenames.items() if not f.startswith(MOONCAKE)}
        super().wait_for_save()

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None] + block_ids[:, None] * self._block_size).flatten()
        hidden = example.extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        if pending.filename.startswith(MOONCAKE):  # the parts straight from the cache's rows, no copy kept here
            self._mooncake().put(pending.filename[len(MOONCAKE):], {"hidden_states": hidden,
                                                                     "token_ids": pending.token_ids})
        else:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            try:
                save_file({"hidden_states": hidden.clone(), "token_ids": pending.token_ids.clone()}, pending.filename)
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)  # releases LOCK_EX: readers waiting on LOCK_SH go on
        self._written = getattr(self, "_written", set()) | {pending.req_id}

    def get_finished(self, finished_req_ids):
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, example.ExampleHiddenStatesConnectorMetadata):
                for pending in meta.pending_saves:
                    self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        written = getattr(self, "_written", set())
        done = {r for r in self._accumulated_finished_req_ids if r in written}
        self._accumulated_finished_req_ids -= done
        self._written = written - done
        return done or None, None
