"""Serve translated caches in vLLM: `MoTConnector`, a KV connector that loads a context's translated K/V into a
request, so the target model answers from another model's reading of the context.

```python
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

llm = LLM(model=gemma_folder, kv_transfer_config={
    "kv_connector": "MoTConnector", "kv_connector_module_path": "hf_mot.integrations.vllm",
    "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"store": "translated/"},
})
prompt = TokensPrompt(prompt_token_ids=context_ids + question_ids, cache_salt=entry_namespace)
llm.generate(prompt, SamplingParams(max_tokens=16))
```

The store is written by `hf-mot translate --to-vllm-store DIR` or `write_store_entries`
(`hf_mot.integrations.vllm_store`). A request uses an entry when its `cache_salt` is the entry's namespace (the
name of the store folder the entry is in) and its prompt starts with the entry's tokens: the salt keeps the
translated blocks out of the prefix cache that requests without it share, so a translation is never served as
the target's own reading. `kv_transfer_params={"hf_mot_entry": path}` names an entry instead of looking it up.

The dial: the connector reports the first `T - floor(recompute * T)` of the entry's `T` tokens as computed and
loads them; vLLM prefills the rest of the prompt itself (the tail of the context, attending to the translated
head, then the question), which is `translate_context`'s `recompute`. `recompute` comes from the request
(`kv_transfer_params={"hf_mot_recompute": r}`), else the connector's `kv_connector_extra_config`, else the
translator's recommended value recorded in the entry.

An entry that cannot be served (another target or revision, a corrupted or missing file, a prompt that does not
start with its tokens, no salt while prefix caching is on), or a salted request with no entry, is refused with a
log line and the request is prefilled normally. Values found broken only when the worker reads them (NaN) are
reported as a failed load, and vLLM prefills the request itself (`kv_load_failure_policy="recompute"`, which the
connector requires).

The K/V are written through the attention backend's own cache-write operation (`do_kv_cache_update`), so the
paged layout (which on the CPU depends on the instruction set) is vLLM's business. Gemma 3's sliding-window
layers are served with the hybrid KV cache manager on (`SupportsHMA`): in their groups only the blocks vLLM
keeps (those in the window) are written.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger

from ..configuration_mot import check_recompute
from .vllm_store import (
    EntryHeader,
    ServedModel,
    StoreEntryError,
    checkpoint_fingerprint,
    find_entry,
    read_header,
    read_states,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under vLLM's logger, so that its handlers and VLLM_LOGGING_LEVEL apply to these lines too.
logger = init_logger("vllm.hf_mot")

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# vLLM's block pool hands out block 0 as the null block: the placeholder for blocks a sliding-window group does
# not keep.
_NULL_BLOCK = 0


@dataclass
class _Load:
    """One request's load: the entry, which token positions to write, and where, per KV cache group."""

    request_id: str
    path: str
    tokens: int
    start: int
    end: int
    positions: dict[int, list[int]] = field(default_factory=dict)
    slots: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class MoTConnectorMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)


def _served_model(vllm_config: VllmConfig) -> ServedModel:
    model_config = vllm_config.model_config
    text_config = model_config.hf_text_config
    folder = model_config.model
    if not os.path.isdir(folder):
        from huggingface_hub import snapshot_download

        folder = snapshot_download(folder, revision=model_config.revision, local_files_only=True,
                                   allow_patterns=["*.safetensors", "*.json"])
    num_layers = text_config.num_hidden_layers
    return ServedModel(
        fingerprint=checkpoint_fingerprint(folder, num_layers),
        num_layers=num_layers,
        num_kv_heads=model_config.get_total_num_kv_heads(),
        head_dim=model_config.get_head_size(),
    )


class MoTConnector(KVConnectorBase_V1, SupportsHMA):
    """A consumer KV connector that loads translated caches from an hf_mot store (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = self._kv_transfer_config
        store = config.get_from_extra_config("store", None)
        if not store:
            raise ValueError(
                "MoTConnector needs the store to serve from: kv_connector_extra_config={'store': DIR} (written by "
                "`hf-mot translate --to-vllm-store DIR`)."
            )
        self._store = Path(store)
        recompute = config.get_from_extra_config("recompute", None)
        self._recompute = None if recompute is None else check_recompute(recompute, "extra config 'recompute'")
        if config.kv_load_failure_policy != "recompute":
            raise ValueError(
                "MoTConnector needs kv_transfer_config kv_load_failure_policy='recompute': an entry found broken "
                "while it is read must be recomputed by vLLM, not fail the request."
            )
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "MoTConnector writes every layer and KV head from one worker; tensor and pipeline parallelism "
                f"(here {parallel.tensor_parallel_size} x {parallel.pipeline_parallel_size}) are not supported yet."
            )
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype != "auto":
            raise ValueError(
                f"MoTConnector writes the model's own K/V dtype; kv_cache_dtype={cache_dtype!r} is not supported: "
                "leave it at 'auto'."
            )
        self._prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self._groups = [
            (group.layer_names, group.kv_cache_spec.block_size) for group in kv_cache_config.kv_cache_groups
        ]
        self._group_of = {name: g for g, (names, _) in enumerate(self._groups) for name in names}
        self._num_layers = vllm_config.model_config.hf_text_config.num_hidden_layers
        self._layer_indices = {}
        for name in self._group_of:
            found = _LAYER_INDEX.search(name)
            if found is None:
                raise ValueError(f"MoTConnector cannot tell which decoder layer vLLM's attention layer {name} is.")
            self._layer_indices[name] = int(found.group(1))
        # Scheduler side: entries found for requests, loads to send to the worker, entries that failed to load.
        self._served = _served_model(vllm_config) if role == KVConnectorRole.SCHEDULER else None
        self._matches: dict[str, tuple[EntryHeader, int]] = {}
        self._planned: list[_Load] = []
        self._loading: dict[str, str] = {}
        self._broken: dict[str, str] = {}
        # Worker side: requests whose load finished, and those of them that failed.
        self._finished: set[str] = set()
        self._failed: set[str] = set()

    # ------------------------------------------------------------------ scheduler side

    def _refuse(self, request: Request, reason: str) -> tuple[int, bool]:
        logger.warning("hf_mot: request %s gets no translated cache and is prefilled normally: %s",
                       request.request_id, reason)
        return 0, False

    def _find(self, request: Request) -> tuple[Path | None, str | None]:
        """The entry this request asks for (or `None`), or the reason it cannot have one."""
        params = request.kv_transfer_params or {}
        prompt = request.prompt_token_ids or []
        named = params.get("hf_mot_entry")
        salt = request.cache_salt or ""
        if named is not None:
            path = Path(named)
            if not path.is_absolute():
                path = self._store / path
            if self._prefix_caching and salt != path.parent.name:
                return None, (
                    f"it names entry {path} but its cache_salt is {salt!r}, not the entry's namespace "
                    f"{path.parent.name!r}: with prefix caching on, the translated blocks would be served to other "
                    "requests as the model's own reading. Pass cache_salt=<namespace>."
                )
            return path, None
        if not salt.startswith("hf_mot-"):
            return None, None  # a normal request
        path = find_entry(self._store, salt, prompt)
        if path is None:
            return None, (
                f"its cache_salt names namespace {salt}, but {self._store / salt} holds no context that its prompt "
                "starts with and continues past: write the context with `hf-mot translate --to-vllm-store`"
            )
        return path, None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._matches.pop(request.request_id, None)
        path, reason = self._find(request)
        if reason is not None:
            return self._refuse(request, reason)
        if path is None:
            return 0, False
        if str(path) in self._broken:
            return self._refuse(request, self._broken[str(path)])
        try:
            header = read_header(path, self._served)
        except StoreEntryError as error:
            return self._refuse(request, str(error))
        prompt = request.prompt_token_ids or []
        tokens = len(header.token_ids)
        if tokens >= len(prompt) or tuple(prompt[:tokens]) != header.token_ids:
            return self._refuse(
                request,
                f"its prompt ({len(prompt)} tokens) does not start with the {tokens} context tokens of {path} and "
                "continue past them",
            )
        params = request.kv_transfer_params or {}
        try:
            if "hf_mot_recompute" in params:
                recompute = check_recompute(params["hf_mot_recompute"], "kv_transfer_params['hf_mot_recompute']")
            else:
                recompute = self._recompute if self._recompute is not None else header.recompute
        except (TypeError, ValueError) as error:
            return self._refuse(request, str(error))
        end = tokens - int(recompute * tokens)
        if end <= num_computed_tokens:
            return 0, False
        reason = header.refusal(end)
        if reason is not None:
            return self._refuse(request, reason)
        self._matches[request.request_id] = (header, end)
        # Loaded asynchronously (between scheduler steps): vLLM recovers from a failed load of a hybrid-cache model
        # (Gemma 3's) only for such loads, by prefilling the request from scratch.
        return end - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        match = self._matches.pop(request.request_id, None)
        if num_external_tokens == 0 or match is None:
            return
        header, end = match
        load = _Load(request.request_id, str(header.path), len(header.token_ids), end - num_external_tokens, end)
        block_ids = blocks.get_block_ids()  # every block of the request, per KV cache group
        for group, (_, block_size) in enumerate(self._groups):
            positions, slots = [], []
            for position in range(load.start, load.end):
                block = block_ids[group][position // block_size]
                if block != _NULL_BLOCK:  # a sliding-window group keeps no block this far back
                    positions.append(position)
                    slots.append(block * block_size + position % block_size)
            load.positions[group], load.slots[group] = positions, slots
        self._planned.append(load)
        self._loading[request.request_id] = load.path

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = MoTConnectorMetadata(loads=self._planned)
        self._planned = []
        return meta

    def update_connector_output(self, connector_output):
        for request_id in connector_output.failed_recving or ():
            path = self._loading.get(request_id)
            if path is not None:
                # The worker logged why; later requests do not try the entry again.
                self._broken[path] = f"{path} failed to load before (see the worker's log line)"
        for request_id in connector_output.finished_recving or ():
            self._loading.pop(request_id, None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._loading.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]):
        self._loading.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MoTConnectorMetadata)
        for load in meta.loads:
            self._finished.add(load.request_id)
            try:
                states = read_states(EntryHeader(Path(load.path), (), {}), self._num_layers)
            except StoreEntryError as error:
                logger.warning("hf_mot: request %s: %s; vLLM recomputes the request.", load.request_id, error)
                self._failed.add(load.request_id)
                continue
            written, fewest = 0, load.end - load.start
            for name, layer in forward_context.no_compile_layers.items():
                kv_cache = getattr(layer, "kv_cache", None)
                if kv_cache is None or kv_cache.numel() == 0 or name not in self._group_of:
                    continue
                group = self._group_of[name]
                keys, values = states[self._layer_indices[name]]
                # A sliding-window layer's entry starts later; what it lacks, no computed token attends to (the
                # scheduler checked), and vLLM's blocks there are never read.
                first = load.tokens - keys.shape[0]
                positions = torch.tensor(load.positions[group], dtype=torch.long)
                slots = torch.tensor(load.slots[group], dtype=torch.long)
                held = positions >= first
                positions, slots = positions[held], slots[held]
                fewest = min(fewest, positions.numel())
                if positions.numel() == 0:
                    continue
                rows = positions - first
                layer.impl.do_kv_cache_update(
                    layer, keys.index_select(0, rows).to(kv_cache.device, kv_cache.dtype),
                    values.index_select(0, rows).to(kv_cache.device, kv_cache.dtype), kv_cache,
                    slots.to(kv_cache.device),
                )
                written += 1
            logger.info(
                "hf_mot: request %s: loaded %d translated tokens into %d attention layers (at least %d in every "
                "layer: sliding-window layers keep only their window) from %s", load.request_id,
                load.end - load.start, written, fewest, load.path,
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer: it never saves

    def wait_for_save(self):
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Loads run whole inside start_load_kv, so each is finished (or failed) by the end of its step.
        results = KVConnectorTransferResults(finished_recving=self._finished, failed_recving=self._failed)
        self._finished, self._failed = set(), set()
        return results

