"""The model runner: owns the weights and the KV tensors, turns a scheduled step into tokens."""

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workers.engine.config import EngineConfig
from workers.engine.outputs import TokenLogprobs
from workers.engine.request import Request
from workers.models.model_config import ModelConfig, load_model_config
from workers.runner import kv_int8, native, quant_files
from workers.runner.attention import AttentionMetadata, PrefillSeq
from workers.runner.decode_graphs import DecodeGraphs
from workers.runner.decode_workspace import DecodeWorkspace
from workers.runner.loader import load_weights, parse_dtype, resolve_dtype
from workers.runner.memory import zeros
from workers.runner.model import CausalLM, ModelWeights
from workers.runner.packing import can_pack, on_huge_pages, pack_weights
from workers.runner.plan import (
    kv_bytes_per_token,
    kv_sink_slots,
    num_cpus,
    plan_graph_mode,
    plan_max_model_len,
    plan_num_kv_blocks,
    plan_packing,
    plan_sdpa_prompts_over,
    plan_threads,
    plan_workspace_rows,
    uses_native_kernels,
)
from workers.runner.quant import quant_kernel, quantize_weights, weight_bytes
from workers.runner.sampler import compute_logprobs, make_sampling_batch, sample, skip_draws
from workers.runner.verify import verify_drafts

if TYPE_CHECKING:
    from workers.tp.shard import RankShard

log = logging.getLogger(__name__)


@dataclass
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None
    # A verify chunk (speculative decoding): its drafts the target agreed with, emitted
    # before `token_id` (the target's own token after them).
    accepted: list[int] = field(default_factory=list)


def available_memory_bytes(device: torch.device) -> int:
    """Memory free for the KV cache now: device memory on CUDA, MemAvailable on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelRunner:
    """Runs one step of the model over a flat batch and samples the next tokens."""

    def __init__(
        self, model_dir: Path, config: EngineConfig, shard: "RankShard | None" = None
    ) -> None:
        """`shard`: this process is one rank of a shard group (`workers.tp`) and holds its
        share of the heads, MLP columns and vocabulary; None = the whole model here."""
        t0 = time.perf_counter()
        self.device = torch.device(config.device)
        config = replace(config, dtype=resolve_dtype(config.dtype, self.device))  # "auto"
        self.config = config
        self.shard = shard
        self.num_threads = plan_threads(config.threads, num_cpus())
        torch.set_num_threads(self.num_threads)
        self.dtype = parse_dtype(config.dtype)
        self.model_config = load_model_config(model_dir)
        self.max_model_len = plan_max_model_len(config.max_model_len, self.model_config.max_context)
        native_cpu = uses_native_kernels(config.native_kernels, self.device, self.dtype)
        cfg, weights = self._load_weights(model_dir)
        self.num_parameters = weights.num_parameters(
            cfg.tie_word_embeddings if shard is None else None
        )
        self.model = self._build_model(cfg, weights, native_cpu)
        self.block_size = config.block_size
        self.kv_int8 = config.kv_cache_dtype == "int8"
        self.kv_bytes_per_token = kv_bytes_per_token(cfg, self.dtype, config.kv_cache_dtype)
        # int8 KV (`kv_int8`): its native kernels where ours run, else None (torch)
        self.kv_int8_kernels = native.kv_int8() if native_cpu and self.kv_int8 else None
        self.num_kv_blocks = self._plan_kv_blocks(cfg)
        self.kv_capacity_tokens = self.num_kv_blocks * self.block_size
        graph_mode = plan_graph_mode(
            config.decode_graphs, self.device, shard is None, config.decode_workspace_tokens
        )
        self.kv_caches = self._allocate_kv_caches(cfg, graph_mode)
        self.workspace = self._make_workspace(cfg)
        self.graphs = self._make_graphs(graph_mode)
        self._choose_attention_kernels(cfg, native_cpu)
        self._log_plan(model_dir, cfg, graph_mode, time.perf_counter() - t0)

    def _load_weights(self, model_dir: Path) -> tuple[ModelConfig, ModelWeights]:
        """The weights this process holds and the config they are sized by: the whole
        model's, or with a shard this rank's share (`self.model_config` stays the whole
        model's)."""
        cfg = self.model_config
        kind = self.config.quantization
        # where the quantized linear weights come from (the load log says): None = float
        self.quantized_from: str | None = None if kind == "none" else "quantized at load"
        if self.shard is None:
            pre = None if kind == "none" else quant_files.load(model_dir, kind, cfg, self.device)
            if pre is not None:
                self.quantized_from = f"read from {pre.path} ({pre.origin})"
            weights = load_weights(
                cfg,
                model_dir,
                self.dtype,
                self.device,
                as_stored=kind != "none",
                quantized=None if pre is None else pre.matrices,
            )
            return cfg, weights
        weights = self.shard.load_weights(cfg, model_dir, self.dtype, self.device)
        return self.shard.local_config(cfg), weights

    def _build_model(self, cfg: ModelConfig, weights: ModelWeights, native_cpu: bool) -> CausalLM:
        """The forward pass and the kernels of its layers: the per-layer ops fused in our C++
        where `native_cpu` (`fused_ops`), else torch's; the linear weights packed
        (`packed`) into our kernel's tiles where it runs (`linear_kernel`) and on huge
        pages, else into oneDNN's layout where it takes them, else left dense."""
        config = self.config
        fused = native.fused_ops() if native_cpu else None
        self.fused_ops = fused is not None
        onednn = can_pack(self.device, self.dtype)
        self.linear_kernel = None  # the native linear layers, when the weights use them
        if config.packed_weights and native_cpu:
            self.linear_kernel = native.linear(str(self.dtype).removeprefix("torch."))
        self.packed = plan_packing(config.packed_weights, onednn, self.linear_kernel is not None)
        self.quant_kernel = None  # the quantized linear layers' kernel, when it runs
        if config.quantization != "none":  # before packing, which leaves them as they are
            self.quant_kernel = quant_kernel(config.dtype) if native_cpu else None
            weights = quantize_weights(weights, config.quantization, self.quant_kernel)
        if self.packed:
            weights = pack_weights(weights, self.linear_kernel, onednn)
        if self.linear_kernel is not None or self.quant_kernel is not None:
            weights = on_huge_pages(weights)  # our tiles, streamed every step
        self.weight_bytes = weight_bytes(weights)  # of the linear layers, as held
        return CausalLM(cfg, weights, self.max_model_len, self.shard, fused, self.packed)

    def _plan_kv_blocks(self, cfg: ModelConfig) -> int:
        """Blocks in the KV pool: the configured number, else what fits in
        `kv_memory_fraction` of the memory free now (the weights loaded) and in
        `kv_cache_gib`, no more than `max_num_seqs` sequences of `max_model_len` can use.
        The ranks of a shard group agree on their least."""
        config = self.config
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            assert config.scheduler is not None
            num_blocks = plan_num_kv_blocks(
                available_memory_bytes(self.device),
                config.kv_memory_fraction,
                self.kv_bytes_per_token,
                self.block_size,
                config.scheduler.max_num_seqs * self.max_model_len,
                None if config.kv_cache_gib is None else int(config.kv_cache_gib * 2**30),
            )
        if self.shard is not None:  # every rank holds the same blocks (of its own KV heads)
            num_blocks = self.shard.agree_min(num_blocks)
        return num_blocks

    def _allocate_kv_caches(
        self, cfg: ModelConfig, graph_mode: str
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V tensors, [KV heads, slots, head dim]: the pool's slots and,
        where decode graphs run, a sink block past them (`plan.kv_sink_slots`)."""
        num_slots = self.kv_capacity_tokens + kv_sink_slots(graph_mode, self.block_size)
        shape = (cfg.num_kv_heads, num_slots, cfg.head_dim)
        if self.kv_int8:
            kernels = self.kv_int8_kernels
            return kv_int8.allocate(cfg.num_layers, shape, self.dtype, self.device, kernels)
        return [
            (zeros(shape, self.dtype, self.device), zeros(shape, self.dtype, self.device))
            for _ in range(cfg.num_layers)
        ]

    def _make_workspace(self, cfg: ModelConfig) -> DecodeWorkspace | None:
        """The decode workspace (None: `decode_workspace_tokens` is 0): rows of that many
        tokens (at most `max_model_len`), as many as `decode_workspace_gib` holds, at most
        one per sequence."""
        config = self.config
        if config.decode_workspace_tokens <= 0:
            return None
        assert config.scheduler is not None
        row_tokens = min(config.decode_workspace_tokens, self.max_model_len)
        rows = plan_workspace_rows(
            int(config.decode_workspace_gib * 2**30),
            self.kv_bytes_per_token,
            row_tokens,
            config.scheduler.max_num_seqs,
        )
        return DecodeWorkspace(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            rows,
            row_tokens,
            self.dtype,
            self.device,
            self.kv_int8,
            self.kv_int8_kernels,
        )

    def _make_graphs(self, graph_mode: str) -> DecodeGraphs | None:
        """Per-bucket decode graphs over the workspace (None: `graph_mode` is "off" or
        there is no workspace), captured as CUDA graphs on first use where "auto"."""
        if graph_mode == "off" or self.workspace is None:
            return None
        return DecodeGraphs(
            self.model,
            self.kv_caches,
            self.block_size,
            self.workspace,
            self.kv_capacity_tokens,
            self.device,
            capture=graph_mode == "auto",
        )

    def _choose_attention_kernels(self, cfg: ModelConfig, native_cpu: bool) -> None:
        """Our attention kernels, each None where it does not run (off the CPU, another
        dtype or head dim, not built): prompt chunks (`prefill_kernel`, which long whole
        prompts on an AVX2 CPU leave for SDPA: `sdpa_prompts_over`), decodes that read
        their blocks in place (`paged_kernel`) and decodes in workspace rows
        (`decode_kernel`)."""
        self.prefill_kernel = None
        self.sdpa_prompts_over: int | None = None
        self.paged_kernel = None
        self.decode_kernel = None
        if not native_cpu:
            return
        self.prefill_kernel = native.prefill_attention(self.config.dtype, cfg.head_dim)
        if self.prefill_kernel is not None:
            self.sdpa_prompts_over = plan_sdpa_prompts_over(torch.backends.cpu.get_cpu_capability())
        int8 = self.kv_int8_kernels  # an int8 cache's decodes: its own kernels (or torch)
        if self.kv_int8:
            self.paged_kernel = None if int8 is None else kv_int8.paged_kernel(int8)
            if self.workspace is not None and int8 is not None:
                self.decode_kernel = kv_int8.workspace_kernel(int8)
            return
        self.paged_kernel = native.paged_decode_attention()
        if self.workspace is not None:
            self.decode_kernel = native.decode_attention()

    def _log_plan(self, model_dir: Path, cfg: ModelConfig, graph_mode: str, load_s: float) -> None:
        """One line for the model, its kernels and the KV pool; one each for the decode
        graphs and the workspace where they run."""
        num_slots = self.kv_capacity_tokens
        log.info(
            "loaded %s (%s, %.1fM parameters, %s%s on %s, %d threads) in %.1fs; KV cache holds "
            "%d tokens (%d blocks of %d, %.2f GiB, %s)",
            model_dir,
            cfg.architecture,
            self.num_parameters / 1e6,
            self.config.dtype,
            _packing(self.packed, self.linear_kernel is not None)
            + _quantized(
                self.config.quantization, self.quant_kernel, self.weight_bytes, self.config.dtype
            ),
            self.device,
            self.num_threads,
            load_s,
            num_slots,
            self.num_kv_blocks,
            self.block_size,
            num_slots * self.kv_bytes_per_token / 2**30,
            "int8 and a bf16 scale per row" if self.kv_int8 else self.config.dtype,
        )
        if self.quantized_from is not None:
            log.info("%s linear weights %s", self.config.quantization, self.quantized_from)
        if self.graphs is not None:
            log.info(
                "decode graphs: %s, batch buckets %s, context buckets %s",
                "CUDA graphs, each captured on first use" if graph_mode == "auto" else "eager",
                self.graphs.batches,
                self.graphs.contexts,
            )
        if self.workspace is not None:
            log.info(
                "decode workspace: %d rows x %d tokens (%.2f GiB), attention in %s",
                self.workspace.max_rows,
                self.workspace.max_tokens,
                self.workspace.nbytes() / 2**30,
                "the native kernel" if self.decode_kernel is not None else "torch",
            )

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Request, int]], block_tables: dict[str, list[int]]
    ) -> dict[str, SampledToken]:
        """Compute the scheduled tokens; sample for requests whose last token was computed,
        and verify the drafts of verify chunks (`accepted`)."""
        batch, num_ws = self._order(scheduled, block_tables)
        input_ids, positions, slots, logit_rows, samplers, drafts = self._flatten(
            batch, block_tables
        )
        dev = self.device
        if self.graphs is not None and self.graphs.covers(num_ws, len(batch)):
            logits = self.graphs.run(input_ids, positions, slots)
        else:
            logits = self.model.forward(
                torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                self._metadata(batch, num_ws, block_tables, slots),
                self.kv_caches,
                self.block_size,
                torch.tensor(logit_rows, dtype=torch.long, device=dev),
            )
        if num_ws:
            self.workspace.commit([req.request_id for req, _ in batch[:num_ws]])
        if not samplers or (self.shard is not None and self.shard.rank != 0):
            return {}  # ranks other than 0 only compute their shard; rank 0 samples
        for req in samplers:
            if req.params.seed is not None and req.generator is None:
                req.generator = torch.Generator(device=dev).manual_seed(req.params.seed)
                if req.num_output_tokens and req.params.temperature > 0:
                    # Resumed from another replica's output: past the draws its tokens took
                    # (one row of noise per sampled token, as `sample` draws it).
                    skip_draws(req.generator, req.num_output_tokens, logits.shape[-1], dev)
        out = {}
        if drafts:  # verify chunks: their rows follow the samplers' (`_flatten`)
            verifiers = samplers[len(samplers) - len(drafts) :]
            samplers = samplers[: len(samplers) - len(drafts)]
            verdicts = verify_drafts(
                logits[len(samplers) :], verifiers, drafts, dev, self.model.ops.argmax_rows
            )
            for req, (kept, token) in zip(verifiers, verdicts, strict=True):
                out[req.request_id] = SampledToken(token, None, kept)
            if not samplers:
                return out
            logits = logits[: len(samplers)]
        sb = make_sampling_batch(samplers, dev)
        tokens = sample(logits, sb, self.model.ops.argmax_rows)
        token_list = tokens.tolist()
        if sb.max_logprobs is not None:
            chosen, top_vals, top_ids = compute_logprobs(logits, tokens, sb.max_logprobs)
            chosen_l, vals_l, ids_l = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
        for row, req in enumerate(samplers):
            lp = None
            n = req.params.logprobs
            if n is not None:
                lp = TokenLogprobs(
                    chosen_l[row], list(zip(ids_l[row][:n], vals_l[row][:n], strict=True))
                )
            out[req.request_id] = SampledToken(token_list[row], lp)
        return out

    def _order(
        self, scheduled: list[tuple[Request, int]], block_tables: dict[str, list[int]]
    ) -> tuple[list[tuple[Request, int]], int]:
        """Workspace decodes (in row order), then gather decodes, then prefill chunks."""
        decodes = [item for item in scheduled if item[1] == 1]
        prefills = [item for item in scheduled if item[1] > 1]
        ws = self.workspace
        if ws is None or not decodes:
            return decodes + prefills, 0
        use = [d for d in decodes if ws.fits(d[0].num_computed_tokens)][: ws.max_rows]
        chosen = {id(d) for d in use}
        rest = [d for d in decodes if id(d) not in chosen]
        order = ws.prepare(
            [r.request_id for r, _ in use],
            [r.num_computed_tokens for r, _ in use],
            [block_tables[r.request_id] for r, _ in use],
            self.kv_caches,
            self.block_size,
        )
        return [use[i] for i in order] + rest + prefills, len(use)

    def _flatten(self, batch: list[tuple[Request, int]], block_tables: dict[str, list[int]]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        samplers: list[Request] = []
        verify_rows: list[int] = []
        verifiers: list[Request] = []
        drafts: list[list[int]] = []
        for req, n in batch:
            start = req.num_computed_tokens
            table = block_tables[req.request_id]
            input_ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            num_drafts = start + n - req.num_tokens
            if num_drafts > 0:  # a verify chunk: the last token, then drafts; logits at each
                drafts.append(req.spec_token_ids[:num_drafts])
                input_ids.extend(drafts[-1])
                verify_rows.extend(range(len(input_ids) - n, len(input_ids)))
                verifiers.append(req)
            elif start + n == req.num_tokens:
                logit_rows.append(len(input_ids) - 1)
                samplers.append(req)
        # Samplers' rows first, then each verify chunk's (`execute` splits them so).
        return input_ids, positions, slots, logit_rows + verify_rows, samplers + verifiers, drafts

    def _metadata(
        self,
        batch: list[tuple[Request, int]],
        num_ws: int,
        block_tables: dict[str, list[int]],
        slots: list[int],
    ) -> AttentionMetadata:
        bs, dev = self.block_size, self.device
        num_decodes = sum(1 for _, n in batch if n == 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            prefills=[],
            prefill_kernel=self.prefill_kernel,
            sdpa_prompts_over=self.sdpa_prompts_over,
        )
        if num_ws:
            computed = [r.num_computed_tokens for r, _ in batch[:num_ws]]
            positions = torch.tensor(computed, dtype=torch.long, device=dev)
            meta.num_workspace_decodes = num_ws
            meta.workspace = self.workspace
            if self.decode_kernel is not None:
                meta.workspace_kernel = self.decode_kernel
                meta.workspace_lengths = positions + 1
            else:
                meta.workspace_slots = self.workspace.slots(positions)
                meta.workspace_mask = _length_mask(positions + 1, max(computed) + 1)
        gather = [r for r, _ in batch[num_ws:num_decodes]]
        if gather:
            rows = [block_tables[r.request_id] for r in gather]
            width = max(len(t) for t in rows)
            meta.num_gather_decodes = len(gather)
            meta.decode_block_tables = torch.tensor(
                [t + [0] * (width - len(t)) for t in rows], device=dev
            )
            lengths = torch.tensor([r.num_computed_tokens + 1 for r in gather], device=dev)
            if self.paged_kernel is not None:
                meta.paged_kernel = self.paged_kernel
                meta.decode_lengths = lengths
            else:
                meta.decode_mask = _length_mask(lengths, width * bs)
        row = num_decodes
        for req, n in batch[num_decodes:]:
            ctx = req.num_computed_tokens
            block_ids, first = None, None
            if ctx:
                table = block_tables[req.request_id][: -(-(ctx + n) // bs)]
                block_ids = torch.tensor(table, dtype=torch.long, device=dev)
                if table == list(range(table[0], table[0] + len(table))):
                    first = table[0]
            meta.prefills.append(PrefillSeq(row, n, ctx, block_ids, first))
            row += n
        return meta


def _packing(packed: bool, native: bool) -> str:
    if not packed:
        return ""
    return ", weights packed for our linear kernel" if native else ", weights packed for oneDNN"


def _quantized(quantization: str, kernel, nbytes: int, dtype: str) -> str:
    if quantization == "none":
        return ""
    where = f"our kernel ({kernel.path(dtype)})" if kernel is not None else "torch"
    return f", {quantization} linear weights in {where}, {nbytes / 2**20:.1f} MiB"


def _length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[len(lengths), width] bool: True for the first `lengths[i]` positions of row i."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
