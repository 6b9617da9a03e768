"""The model runner: owns the weights and the KV tensors, turns a scheduled step into tokens."""

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workers.engine.config import EngineConfig
from workers.engine.outputs import TokenLogprobs
from workers.engine.request import Request
from workers.models.model_config import ModelConfig, load_model_config
from workers.runner import native
from workers.runner.attention import AttentionMetadata, PrefillSeq
from workers.runner.decode_graphs import DecodeGraphs
from workers.runner.decode_workspace import DecodeWorkspace
from workers.runner.loader import load_weights, parse_dtype
from workers.runner.memory import HugeArena, zeros
from workers.runner.model import CausalLM
from workers.runner.packing import can_pack, map_linears, pack_weights
from workers.runner.sampler import compute_logprobs, make_sampling_batch, sample

if TYPE_CHECKING:
    from workers.tp.shard import RankShard

log = logging.getLogger(__name__)

NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what workers.runner.native's kernels take
AVX2_SDPA_PROMPTS_OVER = 1024  # whole prompts longer than this: SDPA on an AVX2 CPU


@dataclass
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


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


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def plan_num_kv_blocks(
    available_bytes: int,
    fraction: float,
    bytes_per_token: int,
    block_size: int,
    max_useful_tokens: int,
    budget_bytes: int | None = None,
) -> int:
    """KV blocks within `fraction` of the free memory and `budget_bytes` (None: no budget),
    no more than can ever be used."""
    limit = int(available_bytes * fraction)
    if budget_bytes is not None:
        limit = min(limit, budget_bytes)
    fit = limit // (bytes_per_token * block_size)
    useful = -(-max_useful_tokens // block_size)
    return max(min(fit, useful), 1)


def plan_workspace_rows(
    budget_bytes: int, bytes_per_token: int, tokens_per_row: int, max_rows: int
) -> int:
    """Decode-workspace rows: at most `max_rows` (one per sequence), within the budget,
    at least one. Decodes beyond the rows gather their blocks instead."""
    fit = budget_bytes // (bytes_per_token * tokens_per_row)
    return max(min(max_rows, fit), 1)


def plan_threads(configured: int | None, num_cpus: int, cap: int = 8) -> int:
    """torch threads: the configured number, else the CPUs we may run on, at most `cap`."""
    if configured is not None:
        return max(configured, 1)
    return max(min(num_cpus, cap), 1)


def _num_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class ModelRunner:
    """Runs one step of the model over a flat batch and samples the next tokens."""

    def __init__(
        self, model_dir: Path, config: EngineConfig, shard: "RankShard | None" = None
    ) -> None:
        """`shard`: this process is one rank of a shard group (`workers.tp`) and holds its
        share of the heads, MLP columns and vocabulary; None = the whole model here."""
        t0 = time.perf_counter()
        self.config = config
        self.shard = shard
        self.num_threads = plan_threads(config.threads, _num_cpus())
        torch.set_num_threads(self.num_threads)
        self.device = torch.device(config.device)
        self.dtype = parse_dtype(config.dtype)
        self.model_config = load_model_config(model_dir)
        cfg = self.model_config
        self.max_model_len = min(config.max_model_len or cfg.max_context, cfg.max_context)
        if shard is None:
            weights = load_weights(cfg, model_dir, self.dtype, self.device)
        else:  # sized by this rank's share; self.model_config stays the whole model's
            weights = shard.load_weights(cfg, model_dir, self.dtype, self.device)
            cfg = shard.local_config(cfg)
        self.num_parameters = weights.num_parameters()
        fused = None
        native_cpu = (
            config.native_kernels and self.device.type == "cpu" and self.dtype in NATIVE_DTYPES
        )
        if native_cpu:
            fused = native.fused_ops()
        self.fused_ops = fused is not None
        onednn = can_pack(self.device, self.dtype)
        self.linear_kernel = None  # the native linear layers, when the weights use them
        if config.packed_weights and native_cpu:
            self.linear_kernel = native.linear(str(self.dtype).removeprefix("torch."))
        self.packed = config.packed_weights and (onednn or self.linear_kernel is not None)
        if self.packed:
            weights = pack_weights(weights, self.linear_kernel, onednn)
        if self.linear_kernel is not None:  # our tiles, streamed every step: huge pages
            arena = HugeArena([w for w in weights.linears() if not w.is_mkldnn])
            weights = map_linears(weights, lambda w: w if w.is_mkldnn else arena.copy(w))
        self.model = CausalLM(cfg, weights, self.max_model_len, shard, fused, self.packed)
        self.block_size = config.block_size
        per_token = kv_bytes_per_token(cfg, self.dtype)
        if config.num_kv_blocks is not None:
            self.num_kv_blocks = config.num_kv_blocks
        else:
            assert config.scheduler is not None
            self.num_kv_blocks = plan_num_kv_blocks(
                available_memory_bytes(self.device),
                config.kv_memory_fraction,
                per_token,
                self.block_size,
                config.scheduler.max_num_seqs * self.max_model_len,
                None if config.kv_cache_gib is None else int(config.kv_cache_gib * 2**30),
            )
        if shard is not None:  # every rank holds the same blocks (of its own KV heads)
            self.num_kv_blocks = shard.agree_min(self.num_kv_blocks)
        num_slots = self.num_kv_blocks * self.block_size
        graphs = _graph_mode(config, self.device, shard is None)
        # Decode graphs pad a step to its bucket; the padding rows write their K/V to a
        # block past the pool, which no request is ever given.
        sink = self.block_size if graphs != "off" else 0
        shape = (cfg.num_kv_heads, num_slots + sink, cfg.head_dim)
        self.kv_caches = [
            (zeros(shape, self.dtype, self.device), zeros(shape, self.dtype, self.device))
            for _ in range(cfg.num_layers)
        ]
        self.kv_capacity_tokens = num_slots
        self.workspace = None
        if config.decode_workspace_tokens > 0:
            assert config.scheduler is not None
            row_tokens = min(config.decode_workspace_tokens, self.max_model_len)
            rows = plan_workspace_rows(
                int(config.decode_workspace_gib * 2**30),
                per_token,
                row_tokens,
                config.scheduler.max_num_seqs,
            )
            self.workspace = DecodeWorkspace(
                cfg.num_layers,
                cfg.num_kv_heads,
                cfg.head_dim,
                rows,
                row_tokens,
                self.dtype,
                self.device,
            )
        self.graphs = None
        if graphs != "off" and self.workspace is not None:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                self.block_size,
                self.workspace,
                num_slots,
                self.device,
                capture=graphs == "auto",
            )
        # Prompt chunks attend through our kernel where it runs (head dim 64/128, AVX-512 or
        # AVX2). On AVX2 it runs 8 lanes wide, and torch's causal SDPA kernel overtakes it on
        # long whole prompts (Zen 3, a step of 2,048 prompt tokens, ours against SDPA: 4 x
        # 512 fp32 1,047 vs 1,154 ms, bf16 1,029 vs 1,182; 2 x 1,024 fp32 level, bf16 1,129
        # vs 1,217; 1 x 2,048 fp32 1,465 vs 1,407, bf16 1,371 vs 1,347).
        self.prefill_kernel = None
        self.sdpa_prompts_over: int | None = None
        if native_cpu:
            self.prefill_kernel = native.prefill_attention(config.dtype, cfg.head_dim)
            if (
                self.prefill_kernel is not None
                and torch.backends.cpu.get_cpu_capability() == "AVX2"
            ):
                self.sdpa_prompts_over = AVX2_SDPA_PROMPTS_OVER
        # Decodes without a workspace row read their blocks in place through our kernel.
        self.paged_kernel = None
        if native_cpu:
            self.paged_kernel = native.paged_decode_attention()
        self.decode_kernel = None
        if self.workspace is not None and native_cpu:
            self.decode_kernel = native.decode_attention()
        log.info(
            "loaded %s (%s, %.1fM parameters, %s%s on %s, %d threads) in %.1fs; KV cache holds "
            "%d tokens (%d blocks of %d, %.2f GiB)",
            model_dir,
            cfg.architecture,
            self.num_parameters / 1e6,
            config.dtype,
            _packing(self.packed, self.linear_kernel is not None),
            self.device,
            self.num_threads,
            time.perf_counter() - t0,
            num_slots,
            self.num_kv_blocks,
            self.block_size,
            num_slots * per_token / 2**30,
        )
        if self.graphs is not None:
            log.info(
                "decode graphs: %s, batch buckets %s, context buckets %s",
                "CUDA graphs, each captured on first use" if graphs == "auto" else "eager",
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
        """Compute the scheduled tokens; sample for requests whose last token was computed."""
        batch, num_ws = self._order(scheduled, block_tables)
        input_ids, positions, slots, logit_rows, samplers = self._flatten(batch, block_tables)
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
        sb = make_sampling_batch(samplers, dev)
        tokens = sample(logits, sb, self.model.ops.argmax_rows)
        token_list = tokens.tolist()
        out = {}
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
        for req, n in batch:
            start = req.num_computed_tokens
            table = block_tables[req.request_id]
            input_ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == req.num_tokens:
                logit_rows.append(len(input_ids) - 1)
                samplers.append(req)
        return input_ids, positions, slots, logit_rows, samplers

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


def _graph_mode(config: EngineConfig, device: torch.device, whole_model: bool) -> str:
    """ "auto" (capture CUDA graphs), "eager" (the same buckets, run eagerly) or "off":
    graphs need the whole model here (a shard group's collectives are not captured)."""
    mode = config.decode_graphs
    if not whole_model or config.decode_workspace_tokens <= 0:
        return "off"
    if mode == "auto" and device.type != "cuda":
        return "off"
    return mode


def _packing(packed: bool, native: bool) -> str:
    if not packed:
        return ""
    return ", weights packed for our linear kernel" if native else ", weights packed for oneDNN"


def _length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[len(lengths), width] bool: True for the first `lengths[i]` positions of row i."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
