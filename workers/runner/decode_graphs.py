"""Decode steps replayed from CUDA graphs, one graph per (batch, context) bucket.

On a GPU, a decode step of a small model, or of any model at a small batch, is mostly
kernel launches: some twenty per layer, each a few microseconds of CPU work that the GPU
waits on. A CUDA graph records a step's kernels once and replays them in one launch.

What a graph covers: a step whose every request is a decode holding a decode-workspace
row (`workers.runner.decode_workspace`), which is the steady state of serving. Any other step
(prefill chunks, decodes gathering their blocks) runs eagerly, as without graphs.

Buckets: a graph's shapes are fixed, so a step of n decodes whose longest context is L
runs the graph of the smallest batch bucket >= n and context bucket > L (`batch_buckets`,
`context_buckets`), captured the first time that bucket is needed. Rows n.. of the bucket
are padding: token 0 at position 0, their new K/V written to a sink block of the paged
cache (one block past the pool, allocated by the runner) and to position 0 of the
workspace rows past the step's (free in this step: the workspace keeps rows 0..n-1 for
the step's n decodes, and a row is filled from position 0 when it is next taken). Each
padding row attends to its own key only; its logits are dropped.

The inputs a graph reads live in static buffers, allocated once for the largest bucket:
a step copies its token ids, positions and cache slots into them (one host-to-device
copy), and the attention mask and workspace slots are computed inside the graph.

Trust, then verify: a bucket is captured with the real step's inputs in the buffers,
after an eager warm-up over the same buffers, and its first replay must give that
warm-up's logits. A mismatch or a failed capture logs the error and turns graphs off for
this engine; the step keeps the eager logits. (Both passes write the same K/V to the same
slots, so the extra pass changes nothing.)

Off the GPU (`capture=False`: the tests on the CPU), a bucket "replays" by running the
same function eagerly over the same buffers, so bucketing, padding and the buffers are
exercised on every run of the test suite; only the recording is CUDA's.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.runner.attention import AttentionMetadata
from workers.runner.decode_workspace import DecodeWorkspace
from workers.runner.model import CausalLM

log = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to `max_batch` (and `max_batch` itself): a step pads
    at most 15 rows past 16, or to the next power of two below."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def context_buckets(max_tokens: int, smallest: int = 64) -> list[int]:
    """Powers of two from `smallest` up to `max_tokens` (and `max_tokens` itself): a graph
    attends over at most twice the step's longest context (or `smallest` keys)."""
    sizes = []
    width = smallest
    while width < max_tokens:
        sizes.append(width)
        width *= 2
    return sizes + [max_tokens]


def bucket_for(value: int, buckets: list[int]) -> int:
    """The smallest bucket >= value (buckets ascending; value <= the last)."""
    return next(b for b in buckets if b >= value)


@dataclass
class _Graph:
    """One captured bucket: `replay()` recomputes `logits` from the static buffers."""

    replay: Callable[[], None]
    logits: torch.Tensor  # [batch bucket, vocab]: the graph's output buffer


class DecodeGraphs:
    """The CUDA graphs of one engine's decode steps (see the module's docstring)."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: KVCaches,
        block_size: int,
        workspace: DecodeWorkspace,
        sink_slot: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        """`sink_slot`: a slot of the paged cache no request owns (the runner allocates a
        block past the pool), where padding rows write their K/V. `capture=False` runs
        each bucket eagerly over the buffers instead of recording it (no GPU needed)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.workspace = workspace
        self.sink_slot = sink_slot
        self.device = device
        self.capture = capture
        self.batches = batch_buckets(workspace.max_rows)
        self.contexts = context_buckets(workspace.max_tokens)
        most = self.batches[-1]
        # Rows: token ids, positions, paged-cache slots: filled by one copy per step.
        self.inputs = torch.zeros((3, most), dtype=torch.long, device=device)
        self.columns = torch.arange(workspace.max_tokens, device=device)
        self.logit_rows = torch.arange(most, device=device)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.enabled = True
        self.replays = 0  # steps served from a graph
        self.padded_rows = 0  # padding rows computed in those steps

    def covers(self, num_workspace: int, num_scheduled: int) -> bool:
        """Whether a step runs from a graph: every scheduled request a workspace decode
        (`ModelRunner._order` puts those first; they are decodes by construction)."""
        return self.enabled and 0 < num_workspace == num_scheduled <= self.batches[-1]

    def run(self, input_ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """Logits [n, vocab] of a step of n workspace decodes (rows in workspace order)."""
        n = len(input_ids)
        batch = bucket_for(n, self.batches)
        context = bucket_for(max(positions) + 1, self.contexts)
        pad = batch - n
        host = torch.tensor(
            [input_ids + [0] * pad, positions + [0] * pad, slots + [self.sink_slot] * pad],
            dtype=torch.long,
        )
        self.inputs[:, :batch].copy_(host, non_blocking=True)
        graph = self.graphs.get((batch, context))
        if graph is None:
            return self._first_step(batch, context, pad)[:n]
        graph.replay()
        self.replays += 1
        self.padded_rows += pad
        return graph.logits[:n]

    def _forward(self, batch: int, context: int) -> torch.Tensor:
        """The step over the buffers' first `batch` rows, attending over `context` keys."""
        ids, pos, slots = self.inputs[0, :batch], self.inputs[1, :batch], self.inputs[2, :batch]
        meta = AttentionMetadata(
            slot_mapping=slots,
            prefills=[],
            num_workspace_decodes=batch,
            workspace=self.workspace,
            workspace_slots=self.workspace.slots(pos),
            workspace_mask=self.columns[None, :context] <= pos[:, None],
        )
        return self.model.forward(
            ids, pos, meta, self.kv_caches, self.block_size, self.logit_rows[:batch]
        )

    def _first_step(self, batch: int, context: int, pad: int) -> torch.Tensor:
        """Capture a bucket on the step that first needs it, and check its first replay
        against the eager forward over the same inputs."""
        t0 = time.perf_counter()
        try:
            eager, graph = self._record(batch, context)
            graph.replay()
        except Exception:
            log.exception(
                "decode graphs off: capturing batch %d, context %d failed; steps run eagerly",
                batch,
                context,
            )
            self.enabled = False
            return self._forward(batch, context)
        if not _same_logits(graph.logits, eager, self.kv_caches[0][0].dtype):
            diff = (graph.logits.float() - eager.float()).abs().max().item()
            log.error(
                "decode graphs off: the graph of batch %d, context %d gave logits %.3g from "
                "eager's on its first replay; steps run eagerly",
                batch,
                context,
                diff,
            )
            self.enabled = False
            return eager
        self.graphs[(batch, context)] = graph
        self.replays += 1
        self.padded_rows += pad
        log.info(
            "decode graph for batch %d, context %d %s in %.0f ms (%d graphs)",
            batch,
            context,
            "captured" if self.capture else "built (eager replay)",
            (time.perf_counter() - t0) * 1e3,
            len(self.graphs),
        )
        return graph.logits

    def _record(self, batch: int, context: int) -> tuple[torch.Tensor, _Graph]:
        """(the eager logits of this step, the bucket's graph, not yet replayed)."""
        if not self.capture:
            eager = self._forward(batch, context)
            out = torch.empty_like(eager)

            def replay() -> None:
                out.copy_(self._forward(batch, context))

            return eager, _Graph(replay, out)
        # Warm up on a side stream (lazy initialisation, workspace allocations), as
        # torch's documentation asks before a capture. Inputs are the real step's, so the
        # warm-up is also the step's eager result.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                eager = self._forward(batch, context).clone()
        torch.cuda.current_stream(self.device).wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a server's) do not void the capture.
        with torch.cuda.graph(cuda_graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._forward(batch, context)
        return eager, _Graph(cuda_graph.replay, logits)


def _same_logits(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """The same logits up to what a different summation order can change: a recording
    may pick other GEMM algorithms than the eager pass (on another stream, with another
    workspace), which moves 16-bit logits by a few units in their last place. What the
    check is for, a graph reading stale inputs or wrong addresses, moves them by their
    whole size."""
    if got.shape != want.shape or not torch.isfinite(got).all():
        return False
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    scale = max(1.0, want.abs().max().item())
    return (got - want).abs().max().item() <= tolerance * scale
