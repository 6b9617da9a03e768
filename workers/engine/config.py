"""Engine configuration: one dataclass, defaults here, filled from YAML by entry points."""

from dataclasses import dataclass, field


@dataclass
class SchedulerConfig:
    """Batch shape and fairness of the continuous-batching scheduler."""

    max_num_seqs: int = 128  # requests resident in one batch
    max_num_batched_tokens: int = 2048  # tokens computed per step (decodes + prefill chunks)
    max_prefill_chunk: int | None = None  # per-request prefill cap per step; None = the budget
    # A chunked prefill token that attends over L tokens already in the cache costs
    # 1 + L / this of the step's budget, so chunks after long context shrink and a step's
    # time (hence every decode's gap) stays bounded: the context length at which a token's
    # attention takes as long as its linear layers. None = half the length at which their
    # multiply-adds are equal (`ModelConfig.attention_parity_context`), because attention
    # over a chunk's few queries runs at about half the linear layers' rate (CPU, bench
    # model, a least-squares fit over 342 chunk steps: a chunk token after L tokens of
    # context cost 1 + L / 1,580 tokens' time once the context's gather was counted apart,
    # against 1 + L / 2,880 by multiply-adds). 0 = tokens only.
    attention_parity_context: int | None = None
    enable_chunked_prefill: bool = True  # False: a prompt is prefilled in one step or waits
    aging_steps: int = 64  # a waiting request gains one priority level per this many steps
    # Fair share between tenants, in tokens of work: each step's prefill budget goes chunk
    # by chunk to the tenant served the fewest tokens (prefill and decode) lately, counted
    # with this half-life in steps. So one tenant's queue of long prompts cannot hold back
    # another tenant's first token; within a tenant the order is unchanged.
    fair_share_half_life_steps: int = 64
    # The inter-token latency the batch is bounded by: the engine learns what a step costs
    # (`workers.engine.step_model`) and admits a sequence into the running batch only while
    # the predicted decode step stays within this, and shortens prefill chunks so a step
    # carrying one does too. None: the batch is bounded by max_num_seqs and the token
    # budget alone. `itl_headroom`: the fraction of the target a predicted step may take
    # (a step's time varies; the target is a p99).
    itl_target_s: float | None = None
    itl_headroom: float = 0.8


@dataclass
class GrammarCacheConfig:
    """Bounds of one engine's compiled JSON-schema grammars (`workers.engine.grammar_cache`).

    An entry is charged the heap bytes its build left allocated plus what its lexer may
    still grow to: llguidance builds lexer states lazily, as requests use the grammar, into
    the cached grammar itself (shared by every request's copy), up to `max_lexer_states` of
    about 1 KiB each. A request whose grammar needs more states fails, alone."""

    max_bytes: int = 512 * 2**20  # all entries together
    max_tenant_bytes: int = 128 * 2**20  # one tenant's entries; a larger grammar is not kept
    max_entries: int = 256
    max_lexer_states: int = 8192  # per grammar (llguidance's own default: 250,000)
    # A tenant's schema compiles in flight (building or waiting for the build lane); one
    # more is refused (429), a cached schema never is.
    max_compiles_per_tenant: int = 2


DECODE_GRAPH_MODES = ("auto", "off", "eager")
QUANTIZATIONS = ("none", "int8", "q4")
KV_CACHE_DTYPES = ("auto", "int8")
SPECULATIVE_METHODS = ("none", "ngram")


@dataclass
class SpeculativeConfig:
    """Speculative decoding without a draft model (`workers.engine.speculative`).

    "ngram" (prompt lookup): a decoding request's last tokens are looked up in its prompt
    and output so far, and the up to `num_tokens` tokens that followed their latest earlier
    occurrence are verified in one forward pass with its next token; the longest prefix
    the model agrees with is kept, plus the model's own next token. Greedy output and the
    sampled distribution are those of plain decoding. "none": never.
    """

    method: str = "none"  # "ngram" | "none"
    num_tokens: int = 4  # k: tokens proposed per step, at most (a request may ask fewer)
    # Shortest suffix looked up: a single token recurs too often in free text to predict
    # what follows (SmolLM2-135M, greedy, free chat: 39% of drafts kept at 1, 63% at 2;
    # copy-heavy prompts 3.9 tokens a step at 2, 4.0 at 1).
    min_ngram: int = 2
    max_ngram: int = 3  # longest suffix looked up (the longest that matches wins)
    # Whether a request that does not say (`SamplingParams.num_speculative_tokens` None)
    # speculates; either way a request may ask for it on or off within `num_tokens`.
    default_on: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"not {self.method!r}"
            )
        if self.num_tokens < 1:
            raise ValueError("speculative.num_tokens must be at least 1")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("speculative needs 1 <= min_ngram <= max_ngram")


@dataclass
class EngineConfig:
    """Everything the engine needs besides the checkpoint directory."""

    # "float32" | "bfloat16" | "float16" | "auto": bfloat16 where the device runs it natively
    # (a GPU; a CPU with AVX512-BF16 or AMX), else float32 (`workers.runner.loader.resolve_dtype`).
    dtype: str = "float32"
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # fixed KV pool size; None = planned as below
    # The planned KV pool is the smallest of: `kv_cache_gib`, `kv_memory_fraction` of the
    # memory free after the weights, and what max_num_seqs x max_model_len could ever use.
    kv_cache_gib: float | None = 0.5  # absolute KV budget; None = no absolute cap
    kv_memory_fraction: float = 0.5  # of the memory left after weights, given to KV
    # What the KV cache stores: "auto" = the model's dtype; "int8" = int8 with a bf16 scale
    # per token and KV head (`workers.runner.kv_int8`): 1.94x the tokens of bf16 in the same
    # bytes at head dim 64, every attention reading the int8 values.
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # cap on prompt + output; None = the checkpoint's
    enable_prefix_caching: bool = True
    # Decoding sequences whose context fits in this many tokens also keep their KV in
    # contiguous rows, allocated at start-up (max_num_seqs x this many tokens): more
    # memory, far less bandwidth per decode step on CPUs. 0 = gather blocks every step.
    decode_workspace_tokens: int = 1024
    # Cap on the workspace: rows = min(max_num_seqs, what fits here); decodes without a
    # row gather their blocks instead.
    decode_workspace_gib: float = 0.25
    # Workspace decodes on the CPU attend through our C++ kernel (`workers.runner.native`) when it
    # builds here, in float32 and bfloat16; False (or SWITCHYARD_NATIVE_KERNELS=0) = torch.
    native_kernels: bool = True
    # On the CPU, linear weights are reordered once at load (`workers.runner.packing.pack_weights`):
    # into our kernel's tiles (`workers/runner/native/linear.cpp`; AVX-512, bf16 AVX512-BF16, or
    # AVX2), else oneDNN's blocked layout (bf16 on AVX2: dense, oneDNN cannot run it).
    # Faster matmuls, same memory but for a packed copy of a tied
    # LM head. False = dense weights through F.linear.
    packed_weights: bool = True
    # Linear weights quantized at load (`workers.runner.quant`): "none" (the checkpoint's
    # dtype), "int8" (a scale per output row) or "q4" (GGUF Q4_1's blocks: a scale and a
    # minimum per 32 input dims); the LM head is int8 in both, embeddings stay in `dtype`.
    # Activations stay in `dtype`. On the CPU our kernel decodes them in its tile loop
    # (`workers/runner/native/quant_linear.cpp`), elsewhere torch dequantizes per call.
    quantization: str = "none"
    # On a GPU, a step whose requests are all workspace decodes replays a CUDA graph of its
    # (batch, context) bucket (`workers.runner.decode_graphs`), captured on first use and checked
    # against the eager step. "auto": on CUDA; "off": never; "eager": the same buckets,
    # padding and buffers run without recording, on any device (to tell a capture
    # problem from a bucketing one).
    decode_graphs: str = "auto"
    # A worker runs a fixed plan of synthetic steps before it reports ready
    # (`workers.engine.calibration`), so its step model bounds the batch and /load reports
    # its capacity from the first request. False: it learns from live steps only.
    calibrate: bool = True
    threads: int | None = None  # torch intra-op threads; None = CPUs we may run on, at most 8
    scheduler: SchedulerConfig | None = None
    grammar_cache: GrammarCacheConfig = field(default_factory=GrammarCacheConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    seed: int = 0  # for unseeded sampling

    def __post_init__(self) -> None:
        if self.decode_graphs not in DECODE_GRAPH_MODES:
            raise ValueError(
                f"decode_graphs must be one of {', '.join(DECODE_GRAPH_MODES)}, "
                f"not {self.decode_graphs!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"not {self.kv_cache_dtype!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}"
            )
        if self.scheduler is None:
            self.scheduler = SchedulerConfig()
        if isinstance(self.grammar_cache, dict):  # a config passed on as a plain mapping
            self.grammar_cache = GrammarCacheConfig(**self.grammar_cache)
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig(**self.speculative)
